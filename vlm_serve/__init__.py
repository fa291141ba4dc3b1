"""vlm-serve: a continuous-batching server for vision-language models on MLX."""

from .mlx_runtime import apply_defaults as _apply_mlx_defaults

__version__ = "0.1.0"

# Before any MLX GPU work: MLX reads these when it builds its CUDA caches.
_apply_mlx_defaults()
