"""The control channel of a tensor-parallel group: rank 0's plans out, heartbeats back.

One TCP connection from each follower to rank 0, beside MLX's own links (which carry
only the model's collectives). Rank 0 writes one frame per scheduler turn, its plan (the
turn's inputs: new requests, cancellations, expired deadlines); a follower reads it and
runs the same turn. Followers write a heartbeat every second.

Why not send plans through ``mx.distributed``: a collective is evaluated on the device
stream, in order with the decode step still in flight, so sending a plan would wait for
that step (no more overlap of host work with the device) and, on NCCL, go through GPU
memory. A socket write costs microseconds and never waits for the device, and a
socket gives what MLX's collectives do not: timeouts, and an end-of-file the moment a
peer dies.

Every failure is fatal to the group (``on_fatal``): a lost or silent follower, a turn
that runs past the timeout (a rank stuck in a collective), a leader gone quiet, and a
follower that sampled other tokens than rank 0 (heartbeats carry a digest of the tokens
sampled before a turn, which rank 0 checks against its own for that turn: a rank that
went its own way is caught within a second, before its shapes part from rank 0's).

Frames are length-prefixed pickles. The connection is opened with a random token that
rank 0 broadcast over the MLX group, so only the group's own ranks can join, and frames
unpickle only the plain types a plan holds.
"""

from __future__ import annotations

import hmac
import io
import logging
import os
import pickle
import socket
import struct
import queue
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

log = logging.getLogger("vlm_serve.distributed")

HEARTBEAT_S = 1.0
DIGESTS_KEPT = 1 << 16  # turns whose digest rank 0 keeps for the followers' heartbeats
_HEADER = struct.Struct("!Q")


class GroupFailed(RuntimeError):
    """The group cannot go on: a rank died, hung or went silent."""


# -- frames -----------------------------------------------------------------------------

# What a frame may contain: plain Python, numpy arrays and vlm-serve's plan types.
_ALLOWED_MODULES = ("vlm_serve.engine.types", "vlm_serve.engine.scheduler", "vlm_serve.distributed.")
_NUMPY_NAMES = {"_reconstruct", "ndarray", "dtype", "scalar", "_frombuffer"}
_BUILTINS = {"set", "frozenset", "complex", "bytearray", "slice", "range"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (
            module.startswith(_ALLOWED_MODULES)
            or (module.startswith("numpy") and name in _NUMPY_NAMES)
            or (module == "builtins" and name in _BUILTINS)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"frame holds a {module}.{name}: not part of a plan")


def encode(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def send(sock: socket.socket, obj: Any) -> None:
    sock.sendall(encode(obj))


def recv(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    return _Unpickler(io.BytesIO(_exactly(sock, size))).load()


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return bytes(buf)


# -- the two ends -------------------------------------------------------------------------

Fatal = Callable[[str], None]


class LeaderChannel:
    """Rank 0's end: a socket per follower, with a reader thread (heartbeats) and a
    writer thread (plans: a plan with an image's pixels is megabytes, and the worker
    goes on with its turn while it is written), and a watchdog over the turn in progress."""

    def __init__(self, sockets: dict[int, socket.socket], timeout: float, on_fatal: Fatal):
        self.sockets = sockets
        self.timeout = timeout
        self.on_fatal = on_fatal
        self.closing = False  # set once a Shutdown went out: followers leave, not fail
        now = time.monotonic()
        self.seen = {rank: {"at": now, "turn": 0, "state": "connected"} for rank in sockets}
        self.turn = 0
        self.turn_started: float | None = None
        self.digests: OrderedDict[int, int] = OrderedDict()  # turn -> tokens digest at its start
        for sock in sockets.values():
            sock.settimeout(timeout)  # a follower silent this long is lost
        self.outboxes = {rank: queue.SimpleQueue() for rank in sockets}
        self.writers = []
        for rank, sock in sockets.items():
            threading.Thread(target=self._read, args=(rank, sock), daemon=True,
                             name=f"tp-heartbeat-{rank}").start()
            writer = threading.Thread(target=self._write, args=(rank, sock), daemon=True,
                                      name=f"tp-plans-{rank}")
            writer.start()
            self.writers.append(writer)
        threading.Thread(target=self._watch, daemon=True, name="tp-watchdog").start()

    def _read(self, rank: int, sock: socket.socket) -> None:
        try:
            while True:
                beat = recv(sock)
                self.seen[rank] = {"at": time.monotonic(), **beat}
                mine = self.digests.get(beat.get("turn"))
                if mine is not None and beat.get("digest") != mine and not self.closing:
                    self.on_fatal(f"rank {rank} sampled other tokens than rank 0 before turn "
                                  f"{beat['turn']}: the ranks no longer compute the same model")
                    return
        except Exception as exc:  # noqa: BLE001 - any failure to hear from it is fatal
            if not self.closing:
                what = "sent nothing" if isinstance(exc, TimeoutError) else "disconnected"
                self.on_fatal(f"rank {rank} {what} ({type(exc).__name__}: {exc}); "
                              f"last heartbeat {time.monotonic() - self.seen[rank]['at']:.1f} s ago")

    def _write(self, rank: int, sock: socket.socket) -> None:
        outbox = self.outboxes[rank]
        while (frame := outbox.get()) is not None:
            try:
                sock.sendall(frame)
            except Exception as exc:  # noqa: BLE001
                if not self.closing:
                    self.on_fatal(f"cannot send to rank {rank}: {type(exc).__name__}: {exc}")
                return

    def _watch(self) -> None:
        while not self.closing:
            started = self.turn_started
            if started is not None and time.monotonic() - started > self.timeout:
                turns = {rank: s.get("turn") for rank, s in self.seen.items()}
                self.on_fatal(
                    f"scheduler turn {self.turn} has run for more than {self.timeout:g} s: a "
                    f"rank is stuck in a collective (turns the followers reached: {turns})")
                return
            time.sleep(min(1.0, self.timeout / 4))

    def wait_ready(self, timeout: float) -> None:
        """Until every follower has loaded its shard (a lost one is reported by its reader)."""
        deadline = time.monotonic() + timeout
        while any(s.get("state") != "ready" for s in self.seen.values()):
            if time.monotonic() > deadline:
                late = [r for r, s in self.seen.items() if s.get("state") != "ready"]
                self.on_fatal(f"ranks {late} did not load the model within {timeout:g} s")
                raise GroupFailed("followers did not load")
            time.sleep(0.05)

    def broadcast(self, obj: Any) -> None:
        """Queue ``obj`` for every follower, in order (written by the writer threads)."""
        frame = encode(obj)
        for outbox in self.outboxes.values():
            outbox.put(frame)

    def begin_turn(self, digest: int) -> None:
        """A turn starts; ``digest`` covers every token sampled before it."""
        self.turn += 1
        self.turn_started = time.monotonic()
        self.digests[self.turn] = digest
        if len(self.digests) > DIGESTS_KEPT:
            self.digests.popitem(last=False)

    def status(self) -> list[dict]:
        now = time.monotonic()
        return [
            {"rank": rank, "state": s.get("state"), "turn": s.get("turn"), "pid": s.get("pid"),
             "last_heartbeat_s": round(now - s["at"], 3)}
            for rank, s in sorted(self.seen.items())
        ]

    def close(self) -> None:
        """Write what is queued (the last plan says Shutdown), then close."""
        self.closing = True
        for outbox in self.outboxes.values():
            outbox.put(None)
        for writer in self.writers:
            writer.join(self.timeout)
        for sock in self.sockets.values():
            try:
                sock.close()
            except OSError:
                pass


class FollowerChannel:
    """A follower's end: plans in (read by the worker thread), heartbeats out."""

    def __init__(self, sock: socket.socket, rank: int, timeout: float, on_fatal: Fatal):
        self.sock = sock
        self.rank = rank
        self.timeout = timeout
        self.on_fatal = on_fatal
        self.closing = False
        self.state = "loading"
        self.mark = (0, 0)  # (turn started last, digest of the tokens sampled before it)
        threading.Thread(target=self._beat, daemon=True, name="tp-heartbeat").start()

    def _beat(self) -> None:
        while not self.closing:
            try:
                turn, digest = self.mark
                send(self.sock, {"turn": turn, "digest": digest, "state": self.state, "pid": os.getpid()})
            except Exception as exc:  # noqa: BLE001
                if not self.closing:
                    self.on_fatal(f"rank {self.rank}: lost rank 0 ({type(exc).__name__}: {exc})")
                return
            time.sleep(HEARTBEAT_S)

    def receive(self, timeout: float | None) -> Any:
        """The next frame from rank 0; a silence longer than ``timeout`` is fatal."""
        self.sock.settimeout(timeout)
        try:
            return recv(self.sock)
        except Exception as exc:  # noqa: BLE001
            what = (f"no word from rank 0 in {timeout:g} s" if isinstance(exc, TimeoutError)
                    else f"lost rank 0 ({type(exc).__name__}: {exc})")
            if not self.closing:
                self.on_fatal(f"rank {self.rank}: {what}")
            raise GroupFailed(what) from exc

    def wait_closed(self, timeout: float) -> None:
        """Until rank 0 closes the channel: it has released its own MLX work, and a
        follower leaving earlier would break rank 0's links to it mid-release."""
        self.closing = True
        self.sock.settimeout(timeout)
        try:
            while True:
                recv(self.sock)
        except Exception:  # noqa: BLE001 - closed, or gone: either way, done
            pass

    def close(self) -> None:
        self.closing = True
        try:
            self.sock.close()
        except OSError:
            pass


# -- opening the connections ----------------------------------------------------------------

def accept_followers(listener: socket.socket, ranks: int, token: bytes, timeout: float) -> dict[int, socket.socket]:
    """Rank 0: one connection from each of ranks 1..ranks-1, each proving the token."""
    listener.settimeout(timeout)
    sockets: dict[int, socket.socket] = {}
    while len(sockets) < ranks - 1:
        try:
            sock, addr = listener.accept()
        except TimeoutError:
            missing = sorted(set(range(1, ranks)) - set(sockets))
            raise GroupFailed(f"ranks {missing} did not connect within {timeout:g} s") from None
        sock.settimeout(timeout)
        try:
            hello = recv(sock)
            ok = (isinstance(hello, dict) and hmac.compare_digest(hello.get("token", b""), token)
                  and hello.get("rank") in range(1, ranks) and hello["rank"] not in sockets)
        except Exception:  # noqa: BLE001 - a stray connection: drop it
            ok = False
        if not ok:
            log.warning("control channel: refused a connection from %s", addr[0])
            sock.close()
            continue
        send(sock, {"token": token})
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sockets[hello["rank"]] = sock
    listener.close()
    return sockets


def connect_leader(host: str, port: int, rank: int, token: bytes, timeout: float) -> socket.socket:
    """A follower: connect to rank 0 (retrying while it starts listening), prove the token
    and check rank 0's answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise GroupFailed(f"rank {rank}: cannot reach rank 0 at {host}:{port}") from None
            time.sleep(0.1)
    try:
        send(sock, {"rank": rank, "token": token})
        answer = recv(sock)
    except (OSError, pickle.UnpicklingError) as exc:
        raise GroupFailed(f"rank {rank}: {host}:{port} refused this rank ({exc})") from None
    if not (isinstance(answer, dict) and hmac.compare_digest(answer.get("token", b""), token)):
        raise GroupFailed(f"rank {rank}: {host}:{port} is not this group's rank 0")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
