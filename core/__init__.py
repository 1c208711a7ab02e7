"""microspeed: DeepSpeed's training runtime as a microkernel with plugins."""

from microspeed.errors import ConfigError, MissingPluginError, PluginError

__version__ = "0.1.0"
__all__ = ["ConfigError", "MissingPluginError", "PluginError", "__version__"]
