"""The ``vlm-serve`` command."""

from __future__ import annotations

import argparse
import logging
import sys

from .config import ServerConfig
from .tools import FORMATS


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="vlm-serve",
        description="Continuous-batching, OpenAI-compatible server for vision-language models on MLX.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="local model directory or Hugging Face repo id (loaded with mlx-vlm); "
                        "default: a built-in tiny Gemma-3-architecture demo model")
    g.add_argument("--served-model-name", default=None,
                   help="model name reported by /v1/models and accepted in requests")
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to bind")
    g.add_argument("--port", type=int, default=d.port, help="port to bind")
    g.add_argument("--log-level", default=d.log_level,
                   choices=["debug", "info", "warning", "error"], help="logging level")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    g.add_argument("--cpu-workers", type=int, default=d.cpu_workers,
                   help="threads for image decoding, templating and tokenization")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   dest="shutdown_timeout_s",
                   help="on SIGTERM/SIGINT: seconds in-flight requests get to finish before "
                        "they are ended with an error (new requests are refused at once; a "
                        "second signal ends them at once)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run a text and an image request through prefill and batched decode "
                        "before reporting ready, so kernels compile before the first user "
                        "request; default: on a GPU")
    g.add_argument("--no-access-log", action="store_false", dest="access_log",
                   help="don't log a line per request on the vlm_serve.access logger")
    g = p.add_argument_group("scheduling and limits")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most requests decoded together in one batch")
    g.add_argument("--max-queue-size", type=int, default=d.max_queue_size,
                   help="requests allowed to wait beyond --max-num-seqs before 503")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + max_tokens); default: from the model config")
    g.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="max_tokens when a request does not set it")
    g.add_argument("--prefill-step-size", type=int, default=d.prefill_step_size,
                   help="prompt tokens per prefill chunk, interleaved with decode steps")
    g.add_argument("--prefill-token-budget", type=int, default=None,
                   help="prompt tokens prefilled between two decode steps (higher: bursts of "
                        "new requests start sooner; lower: smoother running streams); "
                        "default 2048 on a GPU, 512 on the CPU")
    g.add_argument("--vision-cache-size", type=int, default=d.vision_cache_size,
                   help="image sets whose vision features are kept for reuse (0: off)")
    g.add_argument("--prefix-cache-size", type=int, default=d.prefix_cache_size,
                   help="text-only prompts whose KV is kept to reuse for prompts sharing a "
                        "prefix (0: off); prompts with images are never cached")
    g.add_argument("--prefix-cache-gb", type=float, default=d.prefix_cache_gb,
                   help="memory cap of the prefix cache")
    g.add_argument("--request-timeout", type=float, default=None, dest="request_timeout_s",
                   help="seconds after which a request is stopped with a timeout error")
    g = p.add_argument_group("requests and media")
    g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest accepted request body (413 above)")
    g.add_argument("--limit-mm-per-prompt", type=int, default=d.limit_mm_per_prompt,
                   help="most images in one request")
    g.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes,
                   help="largest accepted encoded image")
    g.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="largest accepted image area in pixels (decompression-bomb guard)")
    g.add_argument("--media-fetch-timeout", type=float, default=d.media_fetch_timeout_s,
                   dest="media_fetch_timeout_s", help="seconds to fetch one image URL")
    g.add_argument("--allow-private-media-urls", action="store_true",
                   help="allow image URLs on private, loopback and link-local addresses")
    g.add_argument("--allowed-local-media-path", default=None,
                   help="directory from which file:// and path image URLs may be read")
    g.add_argument("--max-pixels-per-request", type=int, default=d.max_pixels_per_request,
                   help="most decoded image pixels in one request, all its images together")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="allow clients to send their own chat template in chat_template_kwargs "
                        "(templates run server-side: enable only for trusted clients)")
    g.add_argument("--tool-call-parser", default=None,
                   choices=list(FORMATS),
                   help="tool-call format; default: chosen from the model's chat template")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = ServerConfig(**vars(args))
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from .server import StartupError, run

    try:
        run(config)
    except StartupError as exc:
        sys.exit(f"vlm-serve: error: {exc}")


if __name__ == "__main__":
    main()
