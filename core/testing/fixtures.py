"""pytest fixtures of the plugin-author kit: ``ms_engine_factory``, ``ms_engine`` and ``hook_recorder``.

Use them with ``pytest_plugins = ["microspeed.testing"]`` in a root ``conftest.py``, or import them into
any ``conftest.py`` (``from microspeed.testing import hook_recorder, ms_engine, ms_engine_factory``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from microspeed.testing.plugin_kit import HookRecorder, tiny_engine

if TYPE_CHECKING:
    from microspeed.engine import Engine

__all__ = ["hook_recorder", "ms_engine", "ms_engine_factory"]


@pytest.fixture
def ms_engine_factory() -> Callable[..., Engine]:
    """Fixture: :func:`tiny_engine` — ``ms_engine_factory(config=None, plugins=(), model=None, ...)``."""
    return tiny_engine


@pytest.fixture
def ms_engine() -> Engine:
    """Fixture: a :func:`tiny_engine` with the default config and the installed plugins."""
    return tiny_engine()


@pytest.fixture
def hook_recorder() -> HookRecorder:
    """Fixture: a fresh :class:`HookRecorder`; pass it in ``plugins=[hook_recorder]``."""
    return HookRecorder()
