"""The errors of :mod:`microspeed.elasticity`, named as DeepSpeed 0.16 names them.

They are :class:`microspeed.ConfigError` (so also :class:`ValueError`): each is caused by the
``elasticity`` section or by launching at a world size the section does not allow, and each names
the key, the value and the fix.
"""

from __future__ import annotations

from microspeed.errors import ConfigError


class ElasticityError(ConfigError):
    """Base class of every elasticity error (DeepSpeed's ``ElasticityError``)."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` section is missing, disabled or holds an invalid value (names the key)."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The data-parallel world size is not one of the GPU counts the ``elasticity`` section allows."""
