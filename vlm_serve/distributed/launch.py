"""``vlm-serve --tensor-parallel N`` on one machine: start N ranks and watch them.

Each rank is this same command in a child process, told its rank the way ``mlx.launch``
tells it (so a rank cannot tell the two launchers apart): the ring backend over
loopback (``MLX_RANK`` and a hostfile of free local ports), or NCCL with one GPU per
rank (``CUDA_VISIBLE_DEVICES``). Across machines, use ``mlx.launch`` itself.

This process serves nothing. SIGINT and SIGTERM go to rank 0, which drains its
requests and then stops the followers; when any rank ends, the others get a few
seconds to follow before they are killed, and the exit status is the first failure's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

# After one rank ends, how long the others may take to end on their own.
GRACE_S = 3.0


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_environments(size: int, backend: str, environ=os.environ) -> tuple[list[dict], str | None]:
    """The environment of each rank, and the hostfile written for them (if any)."""
    base = dict(environ)
    if backend == "nccl":
        port = _free_ports(1)[0]
        envs = [base | {"MLX_RANK": str(r), "MLX_WORLD_SIZE": str(size), "NCCL_HOST_IP": "127.0.0.1",
                        "NCCL_PORT": str(port), "CUDA_VISIBLE_DEVICES": str(r)} for r in range(size)]
        return envs, None
    if backend not in ("ring", "auto"):
        raise ValueError(f"--tensor-parallel on one machine launches the ring or nccl backend, not "
                         f"{backend!r}; start other backends with mlx.launch")
    hosts = [[f"127.0.0.1:{port}"] for port in _free_ports(size)]
    fd, hostfile = tempfile.mkstemp(prefix="vlm-serve-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(hosts, f)
    if not any(k in environ for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        # The ranks share this machine's cores: a BLAS pool per rank as wide as the
        # machine spins on cores the other ranks' all-reduces wait for (on 2 cores, a
        # step measured several times slower).
        threads = str(max(1, (os.cpu_count() or 1) // size))
        base |= {"OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}
    return [base | {"MLX_RANK": str(r), "MLX_HOSTFILE": hostfile} for r in range(size)], hostfile


def default_backend() -> str:
    """NCCL where MLX's CUDA build is installed, else the ring backend (asked of the
    installed packages: this process must not take a GPU context of its own)."""
    from importlib.metadata import distributions

    names = {(d.metadata["Name"] or "").lower() for d in distributions()}
    return "nccl" if any(n.startswith("mlx-cuda") for n in names) else "ring"


def launch(argv: list[str], size: int, backend: str) -> int:
    backend = default_backend() if backend == "auto" else backend
    envs, hostfile = rank_environments(size, backend)
    command = [sys.executable, "-m", "vlm_serve.cli", *argv]
    procs = [subprocess.Popen(command, env=env) for env in envs]
    leader = procs[0]

    def forward(signum, frame):  # noqa: ARG001 - signal handler signature
        if leader.poll() is None:
            leader.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.2)
        first = next(p for p in procs if p.poll() is not None)
        deadline = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()  # stuck (in a collective, or stopped): nothing else ends it
                p.wait()
        codes = [first.returncode] + [p.returncode for p in procs if p is not first]
        code = next((c for c in codes if c), 0)
        return code if code >= 0 else 128 - code  # killed by a signal: the shell's number
    finally:
        if hostfile:
            os.unlink(hostfile)
