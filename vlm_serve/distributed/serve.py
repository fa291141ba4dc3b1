"""A rank's life: rank 0 serves HTTP and leads; the others load their shard and follow
until rank 0 shuts the group down, or exit with an error the moment the group fails."""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import replace

from ..config import ServerConfig

log = logging.getLogger("vlm_serve.distributed")


def run_rank(config: ServerConfig) -> None:
    from ..server import StartupError
    from .group import join

    try:
        member = join(config.distributed_backend, config.tensor_parallel_timeout_s,
                      config.tensor_parallel if config.tensor_parallel > 1 else None)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        raise StartupError(f"cannot join the tensor-parallel group: {exc}") from None
    # The ranks usually share one terminal or log: say which one speaks.
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s rank {member.rank} %(levelname)s %(name)s: %(message)s"))
    if member.leader:
        from ..server import run

        run(config, parallel=member)
        member.close()
    else:
        follow(config, member)


def follow(config: ServerConfig, member) -> None:
    """Load this rank's shard and run rank 0's turns until it says stop."""
    from ..server import StartupError, build_engine, freeze_startup_objects

    # Ctrl-C in a terminal reaches every rank; only rank 0 acts on it (it drains its
    # requests, then stops the group). SIGTERM still ends a follower.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("vlm_serve.engine").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        # Warm-up runs on rank 0 and reaches followers through its plans.
        engine = build_engine(replace(config, warmup=False), parallel=member)
    except StartupError as exc:
        member.channel.closing = True
        sys.exit(f"vlm-serve: rank {member.rank}: error: {exc}")
    freeze_startup_objects()
    engine.wait()
    member.channel.wait_closed(60)
    member.close()
    log.info("rank %d: stopped", member.rank)
