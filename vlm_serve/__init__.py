"""vlm-serve: a continuous-batching server for vision-language models on MLX."""

__version__ = "0.1.0"
