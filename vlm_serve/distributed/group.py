"""This process's place in a tensor-parallel group: joining it, and what the engine asks
of it (shard the model, lead or follow the scheduler, report the group's health).

A rank is a process started by a launcher (``vlm-serve --tensor-parallel N`` on one
machine, or ``mlx.launch`` across machines), which tells it its rank through MLX's own
environment variables (``MLX_RANK`` with ``MLX_HOSTFILE`` for the ring backend,
``NCCL_HOST_IP``/``NCCL_PORT``/``MLX_WORLD_SIZE`` for NCCL). ``mx.distributed.init``
joins the group; rank 0 then opens the control channel (``control.py``) and tells the
others where it is and the token that admits them, in one all-reduce.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict

import numpy as np

from . import control
from .replica import FollowerScheduler, LeaderScheduler

log = logging.getLogger("vlm_serve.distributed")

# How long a rank may take to load its shard before the group gives up on it.
LOAD_TIMEOUT_S = float(os.environ.get("VLM_SERVE_TP_LOAD_TIMEOUT", "3600"))


def launched_as_rank(environ=os.environ) -> bool:
    """Whether a launcher started this process as one rank of a group."""
    return "MLX_RANK" in environ or "OMPI_COMM_WORLD_RANK" in environ


def backend_from_env(environ=os.environ) -> str:
    """The MLX backend the launcher prepared this process for."""
    if "NCCL_HOST_IP" in environ:
        return "nccl"
    if "MLX_JACCL_COORDINATOR" in environ:
        return "jaccl"
    if "MLX_HOSTFILE" in environ:
        return "ring"
    if "OMPI_COMM_WORLD_RANK" in environ:
        return "mpi"
    return "any"


def leader_host(environ=os.environ) -> str:
    """An address of rank 0 that every rank can reach: the one the launcher gave MLX."""
    if environ.get("VLM_SERVE_TP_CONTROL_HOST"):
        return environ["VLM_SERVE_TP_CONTROL_HOST"]
    if environ.get("NCCL_HOST_IP"):
        return environ["NCCL_HOST_IP"]
    if environ.get("MLX_JACCL_COORDINATOR"):
        return environ["MLX_JACCL_COORDINATOR"].rsplit(":", 1)[0]
    hostfile = environ.get("MLX_HOSTFILE")
    if hostfile and os.path.exists(hostfile):
        try:
            hosts = json.loads(open(hostfile).read())
            return str(hosts[0][0]).rsplit(":", 1)[0]
        except (ValueError, IndexError, KeyError, TypeError):
            pass
    return "127.0.0.1"


class Rank:
    """One rank of the group, as the engine sees it."""

    def __init__(self, group, timeout: float, channel):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.timeout = timeout
        self.channel = channel
        self.failed: str | None = None
        self._fatal_lock = threading.Lock()
        self.on_failure = None  # rank 0: ends every request (set by the server)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- what the engine calls, on its worker thread ------------------------------------

    def shard(self, loaded) -> None:
        """Shard the loaded model's language model and materialise this rank's part."""
        import mlx.core as mx

        from .random_weights import fill_random_if_unwritten
        from .shard import parameter_bytes, shard_language_model

        started = time.monotonic()
        shard_language_model(loaded.model, self.group)
        fill_random_if_unwritten(loaded, self.rank)
        mx.eval(loaded.model.parameters())
        log.info("rank %d/%d: language model sharded in %.1f s; %.2f GB of weights on this rank",
                 self.rank, self.size, time.monotonic() - started,
                 parameter_bytes(loaded.model) / 1e9)

    @property
    def scheduler_class(self):
        return LeaderScheduler if self.leader else FollowerScheduler

    def attach(self, scheduler, loaded) -> None:
        """Join the scheduler to the group once every rank has loaded: rank 0 sends the
        settings every rank must share (a random seed, the KV memory limit) and what
        the followers check theirs against."""
        import mlx.core as mx

        scheduler.channel = self.channel
        facts = _facts(scheduler, loaded)
        if self.leader:
            self.channel.wait_ready(LOAD_TIMEOUT_S)
            start = {"seed": secrets.randbits(62), "kv_limit": scheduler.memory.limit, "facts": facts}
            self.channel.broadcast(start)
        else:
            scheduler.timeout = self.timeout
            self.channel.state = "ready"
            start = self.channel.receive(LOAD_TIMEOUT_S)
            if start["facts"] != facts:
                diff = {k: (v, facts.get(k)) for k, v in start["facts"].items() if facts.get(k) != v}
                self.fail(f"rank {self.rank} is set up unlike rank 0 (rank 0's vs this rank's): {diff}")
            scheduler.memory.limit = start["kv_limit"]
            self.channel.state = "serving"
        # Unseeded sampling draws from MLX's global random state: the same on every rank.
        mx.random.seed(start["seed"])
        log.info("rank %d/%d: in step with the group", self.rank, self.size)

    # -- health and failure ---------------------------------------------------------------

    def health(self) -> dict:
        out = {"size": self.size, "rank": self.rank, "backend": getattr(self, "backend", None),
               "status": "failed" if self.failed else "ok"}
        if self.failed:
            out["error"] = self.failed
        if self.leader:
            out["followers"] = self.channel.status()
        return out

    def fail(self, reason: str) -> None:
        """The group cannot go on: say why, end every request (rank 0), end the process.
        A rank stuck in a collective cannot be freed, so the process exits rather than
        waits for it; the launcher then stops the other ranks."""
        with self._fatal_lock:
            if self.failed:
                return
            self.failed = reason
        log.critical("tensor-parallel group failed: %s; ending this rank", reason)
        if self.leader and self.on_failure is not None:
            try:
                self.on_failure(f"tensor-parallel group failed: {reason}")
            except Exception:  # noqa: BLE001 - exiting matters more
                log.exception("could not end the requests in flight")
            # A moment for those error events to reach their clients (and /health to
            # say why), then go.
            threading.Timer(1.0, os._exit, args=(1,)).start()
        else:
            os._exit(1)

    def close(self) -> None:
        self.channel.close()


def _facts(scheduler, loaded) -> dict:
    """What must be equal on every rank for their turns to match."""
    return {
        "model_type": loaded.model_type,
        "vocab_size": loaded.vocab_size,
        "scheduler": asdict(scheduler.config) | {"stats_interval_s": None},
        "family": scheduler.family.describe(),
        "vision_cache": _vision_cache_bounds(scheduler.family),
        "eos": sorted(loaded.eos_token_ids),
    }


def _vision_cache_bounds(family) -> tuple[int, int] | None:
    cache = getattr(family, "vision_cache", None)
    return None if cache is None else (cache.size, cache.max_bytes)


def join(backend: str | None = None, timeout: float = 120.0, expected_size: int | None = None) -> Rank:
    """Join the group this process was launched into and open the control channel."""
    import mlx.core as mx

    backend = backend if backend and backend != "auto" else backend_from_env()
    group = mx.distributed.init(strict=True, backend=backend)
    rank, size = group.rank(), group.size()
    if size < 2:
        raise RuntimeError(f"the {backend} backend formed a group of {size}: check the launcher")
    if expected_size and size != expected_size:
        raise RuntimeError(f"--tensor-parallel {expected_size}, but the launcher started {size} ranks")
    ref: list[Rank] = []

    def fatal(reason: str) -> None:
        if ref:
            ref[0].fail(reason)
        else:
            log.critical("tensor-parallel group failed while forming: %s", reason)
            os._exit(1)

    host = leader_host()
    listener = None
    # The port, then a 16-byte token, one number per byte: small integers are exact in
    # float32, which every backend sums.
    words = np.zeros(17, np.float32)
    if rank == 0:
        listener = socket.create_server((host, int(os.environ.get("VLM_SERVE_TP_CONTROL_PORT", 0))))
        words[0] = listener.getsockname()[1]
        words[1:] = np.frombuffer(secrets.token_bytes(16), np.uint8)
    # Rank 0's word to the others, as MLX carries it: everyone else adds zeros.
    shared = np.array(mx.distributed.all_sum(mx.array(words), group=group)).astype(np.int64)
    port, token = int(shared[0]), bytes(shared[1:].astype(np.uint8))
    if rank == 0:
        sockets = control.accept_followers(listener, size, token, timeout)
        channel = control.LeaderChannel(sockets, timeout, fatal)
    else:
        sock = control.connect_leader(host, port, rank, token, timeout)
        channel = control.FollowerChannel(sock, rank, timeout, fatal)
    member = Rank(group, timeout, channel)
    member.backend = backend
    ref.append(member)
    log.info("rank %d/%d joined the group (%s backend); control channel on %s:%d",
             rank, size, backend, host, port)
    return member
