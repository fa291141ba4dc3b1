"""MLX settings a long-running server needs, applied before MLX first touches the GPU.

MLX's CUDA backend keeps LRU caches of CUDA graphs (keyed by graph topology) and of
cuDNN attention plans (keyed by exact shapes), and by default raises "Cache thrashing is
happening" on every new entry once a cache has missed more than twice its capacity over
the process's life. A server meets new topologies and prompt shapes for as long as it
runs, so it would pass that count sooner or later and then fail every step that misses:
serving would stop. With the check off, a miss costs a rebuild and nothing else. A value
the operator already set is kept.
"""

from __future__ import annotations

import os

DEFAULTS = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}


def apply_defaults() -> None:
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
