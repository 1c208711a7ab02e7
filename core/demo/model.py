"""The demo's model: :mod:`microspeed.models.gpt` under the name scripts and tests have always imported.

``microspeed.demo.model`` *is* that module (one module object with two names), so
``from microspeed.demo.model import GPT`` gives the same class as ``from microspeed.models import GPT``
and patching a function here (``fused_kernels_wanted``) is seen by the models built afterwards.
Library code imports :mod:`microspeed.models` instead.
"""

from __future__ import annotations

import sys

from microspeed.models import gpt as _gpt

sys.modules[__name__] = _gpt
