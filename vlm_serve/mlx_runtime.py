"""MLX settings a long-running server needs, applied before MLX first touches the GPU.

Each is an environment variable MLX's CUDA backend reads once; a value the operator
already set is kept.

- ``MLX_ENABLE_CACHE_THRASHING_CHECK=0``: MLX keeps LRU caches of CUDA graphs (keyed by
  graph topology) and of cuDNN attention plans (keyed by exact shapes), and by default
  raises "Cache thrashing is happening" on every new entry once a cache has missed more
  than twice its capacity over the process's life. A server meets new topologies and
  prompt shapes for as long as it runs, so it would pass that count sooner or later and
  then fail every step that misses: serving would stop. With the check off, a miss
  costs a rebuild and nothing else.
- ``MLX_USE_CUDA_GRAPHS=0``: with graphs, MLX records every ~20 operations into a CUDA
  graph and replays it when the same topology comes again. A server's prefill passes
  are a new length nearly every time, and instantiating their graphs took 29% of the
  worker's time under a burst (H100, Gemma-3-4B shape, py-spy). Launching kernels
  directly served a burst of 64 prompts in 9.2 s instead of 20.2 s, and at concurrency 64
  gave 1,202 instead of 966 tokens/s with half the median time to first token; a lone
  stream decodes ~18% slower (126 against 154 tokens/s). Set ``MLX_USE_CUDA_GRAPHS=1``
  for a server that mostly serves one request at a time.
"""

from __future__ import annotations

import os

DEFAULTS = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0", "MLX_USE_CUDA_GRAPHS": "0"}


def apply_defaults() -> None:
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)


def cuda_available() -> bool:
    """Whether MLX's default device is a CUDA GPU (the engine's own CUDA kernels run
    there). MLX is imported here, on first call, not when this module loads."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)  # not every MLX build has the module
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


def exact_grid_block(threads: int, most: int = 256) -> int:
    """The largest power of two up to ``most`` dividing ``threads``: blocks of it tile a
    grid of exactly ``threads`` (MLX's grids count threads), none past the end, so the
    kernel needs no bound and no size."""
    return min(most, threads & -threads)


def kernel_constant(name: str, value: float) -> tuple[str, str]:
    """A float compiled into a CUDA kernel (MLX's template arguments take ints, bools and
    dtypes only): its ``#define`` line, and a tag for the kernel's name."""
    text = f"{float(value)!r}"
    return f"#define {name} {text}f\n", text.replace(".", "p").replace("-", "m")
