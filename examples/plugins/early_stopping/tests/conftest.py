"""The plugin's tests use microspeed's plugin-author kit: its pytest fixtures, imported here.

(In a plugin repository of its own, whose ``conftest.py`` is at the root, the one line
``pytest_plugins = ["microspeed.testing"]`` does the same.)
"""

from microspeed.testing import hook_recorder, ms_engine, ms_engine_factory  # noqa: F401  (pytest fixtures)
