"""One typed configuration for everything tunable; the CLI fills it in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    model: str | None = None  # None: the built-in demo model
    served_model_name: str | None = None
    chat_template: str | None = None  # a template file used instead of the checkpoint's
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    api_key: str | None = None
    shutdown_timeout_s: float = 30.0  # on SIGTERM/SIGINT: how long in-flight requests may finish
    access_log: bool = True
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: no CORS headers
    warmup: bool | None = None  # run every path once before ready; None: on a GPU only

    # Scheduling and limits
    max_num_seqs: int = 32
    max_queue_size: int = 256
    max_model_len: int | None = None  # None: from the model config
    default_max_tokens: int = 1024
    prefill_step_size: int | None = None  # None: 2048 on a GPU, 512 on the CPU
    prefill_token_budget: int | None = None  # None: 4096 on a GPU, 512 on the CPU
    prefill_wait_steps: int | None = None  # None: see server.default_prefill_wait
    vision_cache_size: int = 64  # image sets whose vision features are kept (0: off) ...
    vision_cache_gb: float = 1.0  # ... and their memory
    image_cache_size: int = 64  # loaded and processed images kept, entries (0: off) ...
    image_cache_gb: float = 1.0  # ... and memory
    prefix_cache_size: int = 16
    prefix_cache_gb: float = 2.0
    prefix_cache_min_tokens: int | None = None  # None: 64 on a GPU, 1 on the CPU
    # KV memory of running rows, prefills and cached prefixes: "8GiB", "512MiB", or a
    # fraction of the device's memory ("0.5"); None: 0.8 of it less the weights.
    kv_cache_memory: str | None = None
    request_timeout_s: float | None = None
    cpu_workers: int = 4

    # Requests and media
    max_request_bytes: int = 64 * 1024 * 1024
    limit_mm_per_prompt: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    min_image_pixels: int = 0  # smaller images are upscaled to this area (aspect kept)
    media_fetch_timeout_s: float = 10.0
    allow_private_media_urls: bool = False
    allowed_local_media_path: str | None = None
    trust_request_chat_template: bool = False  # clients may send a template in chat_template_kwargs
    max_pixels_per_request: int = 100_000_000  # decoded image pixels, all images of a request

    tool_call_parser: str | None = None  # None: chosen from the model

    # Tensor parallelism (vlm_serve.distributed): ranks started here (N > 1), or by
    # mlx.launch; the MLX backend (auto: what the launcher prepared); how long a rank
    # may be silent or a turn may run before the group is declared failed.
    tensor_parallel: int = 1
    distributed_backend: str = "auto"
    tensor_parallel_timeout_s: float = 120.0
    extra: dict = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model or "vlm-serve-demo"
