"""Rate-shaped network namespaces for benchmarks: moved to :mod:`microspeed.testing.netns` (tests use them too).

``benchmarks/slow_network.py`` imports ``from netns import SlowNetwork``; this module keeps that working.
"""

from microspeed.testing.netns import DEFAULT_PREFIX, SlowNetwork, cleanup_leftovers, parse_rate

__all__ = ["DEFAULT_PREFIX", "SlowNetwork", "cleanup_leftovers", "parse_rate"]
