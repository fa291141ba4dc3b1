"""The ``vlm-serve`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import ServerConfig
from .tools import FORMATS


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="vlm-serve",
        description="Continuous-batching, OpenAI-compatible server for vision-language models on MLX.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"Every flag can also be set by an environment variable: {ENV_PREFIX} and the "
               "flag's name in capitals with '_' for '-' (--max-num-seqs: VLM_SERVE_MAX_NUM_SEQS; "
               "switches take 1/0/true/false). The command line wins.",
    )
    p.add_argument("--version", action="version", version=version_text(),
                   help="print the versions of vlm-serve, mlx, mlx-lm and mlx-vlm and exit")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="local model directory or Hugging Face repo id (loaded with mlx-vlm); "
                        "default: a built-in tiny Gemma-3-architecture demo model")
    g.add_argument("--served-model-name", default=None,
                   help="model name reported by /v1/models and accepted in requests")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="chat template file (Jinja, or JSON with a 'chat_template' key) used "
                        "instead of the checkpoint's")
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
    g.add_argument("--allowed-origins", action=_ListAction, type=_comma_list, default=[],
                   metavar="ORIGINS",
                   help="browser origins allowed by CORS, comma-separated or repeated "
                        "(e.g. http://localhost:3000; '*' for any); default: none")
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
                   help="prompt tokens per prefill pass, interleaved with decode steps; "
                        "default 2048 on a GPU, 512 on the CPU")
    g.add_argument("--prefill-token-budget", type=int, default=None,
                   help="prompt tokens prefilled between two decode steps (higher: bursts of "
                        "new requests start sooner; lower: smoother running streams); "
                        "default 4096 on a GPU, 512 on the CPU")
    g.add_argument("--prefill-wait-steps", type=_steps, default=None,
                   help="decode steps a new prompt may wait, while others are decoding, for "
                        "more prompts to share its prefill passes, where prompts have been "
                        "arriving that often lately (fewer, fuller passes: more throughput "
                        "under load, a little more time to first token; 0: never wait); "
                        "default 8 on a GPU, 0 on the CPU")
    g.add_argument("--vision-cache-size", type=int, default=d.vision_cache_size,
                   help="image sets whose vision features are kept for reuse (0: off)")
    g.add_argument("--vision-cache-gb", type=float, default=d.vision_cache_gb,
                   help="memory cap of the vision-feature cache")
    g.add_argument("--image-cache-size", type=int, default=d.image_cache_size,
                   help="images kept decoded and processed, so a resent image skips both "
                        "(entries: an image, or one request's images processed; 0: off)")
    g.add_argument("--image-cache-gb", type=float, default=d.image_cache_gb,
                   help="memory cap of the image cache")
    g.add_argument("--prefix-cache-size", type=int, default=d.prefix_cache_size,
                   help="prompts whose KV is kept to reuse for prompts sharing a prefix "
                        "(0: off); image placeholders are keyed by the images' digests")
    g.add_argument("--prefix-cache-gb", type=float, default=d.prefix_cache_gb,
                   help="memory cap of the prefix cache")
    g.add_argument("--prefix-cache-min-tokens", type=_tokens, default=None,
                   help="the fewest tokens of a cached prefix to reuse (a shorter one is "
                        "prefilled again); default 64 on a GPU, where copying a cached "
                        "prefix costs more than prefilling a few tokens, 1 on the CPU")
    g.add_argument("--kv-cache-memory", type=_memory_size, default=None, metavar="SIZE",
                   help="KV cache memory for running requests, prefills and cached prefixes "
                        "together: bytes with a unit (8GiB, 512MiB) or a fraction of the "
                        "device's memory (0.5); a request waits until it fits, one that never "
                        "can gets 400; default: 0.8 of the device's memory less the weights")
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
    g.add_argument("--min-image-pixels", type=int, default=d.min_image_pixels,
                   help="smaller images are upscaled to this area, keeping their aspect "
                        "ratio, before the model's processor (0: never)")
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
    g = p.add_argument_group("tensor parallel (one model across several devices)")
    g.add_argument("--tensor-parallel", type=int, default=d.tensor_parallel, metavar="N",
                   help="split the language model across N ranks on this machine (one GPU "
                        "each with NCCL, or CPU processes over the ring backend); rank 0 "
                        "serves HTTP. Across machines, start every rank with mlx.launch")
    g.add_argument("--distributed-backend", default=d.distributed_backend,
                   choices=["auto", "ring", "nccl", "mpi", "jaccl"],
                   help="MLX backend of the group; auto: NCCL with CUDA, else ring (or "
                        "whatever mlx.launch prepared)")
    g.add_argument("--tensor-parallel-timeout", type=float, default=d.tensor_parallel_timeout_s,
                   dest="tensor_parallel_timeout_s", metavar="SECONDS",
                   help="a rank silent this long, or a scheduler turn running this long (a "
                        "rank stuck in a collective), fails the group: the server ends with "
                        "an error instead of hanging")
    return p


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    def of(dist: str, fallback: str = "not installed") -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return fallback

    libs = ", ".join(f"{d} {of(d)}" for d in ("mlx", "mlx-lm", "mlx-vlm"))
    return f"vlm-serve {of('vlm-serve', __version__)} ({libs})"


class _ListAction(argparse.Action):
    """A repeatable list flag whose first use on the command line replaces the default
    (which may come from the environment) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, (list(current) if current is not self.default else []) + values)


def _memory_size(text: str) -> str:
    """Checked here so a bad size fails at startup; resolved once the model is loaded."""
    from .engine.memory import parse_memory

    try:
        parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _whole_number(unit: str, least: int):
    """An argument type: a whole number of ``unit``, ``least`` or more."""
    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            number = least - 1
        if number < least:
            raise argparse.ArgumentTypeError(f"expected a whole number of {unit}, {least} or more: {text!r}")
        return number

    parse.__name__ = unit
    return parse


_tokens = _whole_number("tokens", 1)
_steps = _whole_number("steps", 0)


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


# --- flags from the environment: VLM_SERVE_MAX_NUM_SEQS=64 is --max-num-seqs 64 ---------

ENV_PREFIX = "VLM_SERVE_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_name(action: argparse.Action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return ENV_PREFIX + longs[0][2:].upper().replace("-", "_") if longs else None


def apply_env(parser: argparse.ArgumentParser, environ) -> None:
    """Turn set VLM_SERVE_* variables into the parser's defaults, so the command line
    still wins; a value that does not parse ends the program with one line naming it."""
    for action in parser._actions:
        name = env_name(action)
        if name is None or name not in environ or action.default == argparse.SUPPRESS:
            continue  # --help and --version are no settings
        raw = environ[name]
        try:
            value = _env_value(action, raw)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            parser.exit(2, f"{parser.prog}: error: environment variable {name}={raw!r}: {exc}\n")
        parser.set_defaults(**{action.dest: value})


def _env_value(action: argparse.Action, raw: str):
    if action.nargs == 0:  # a switch: --x, --no-x, or --x/--no-x
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError("expected 1/0/true/false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return word in _TRUE
        return action.const if word in _TRUE else action.default
    try:
        value = action.type(raw.strip()) if action.type else raw
    except ValueError:
        raise ValueError(f"not a valid {getattr(action.type, '__name__', 'value')}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value


def parse_config(argv: list[str] | None = None, environ=None) -> ServerConfig:
    """The configuration from the command line over ``VLM_SERVE_*`` variables."""
    parser = build_parser()
    apply_env(parser, os.environ if environ is None else environ)
    return ServerConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from .distributed.group import launched_as_rank

    if config.tensor_parallel > 1 and not launched_as_rank():
        from .distributed.launch import launch

        sys.exit(launch(sys.argv[1:] if argv is None else list(argv), config.tensor_parallel,
                        config.distributed_backend))
    from .server import StartupError, run

    try:
        if launched_as_rank():
            from .distributed.serve import run_rank

            run_rank(config)
        else:
            run(config)
    except StartupError as exc:
        sys.exit(f"vlm-serve: error: {exc}")


if __name__ == "__main__":
    main()
