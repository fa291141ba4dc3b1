"""Python's cyclic garbage collections of any process started with this folder on its
path (``PYTHONPATH=bench/gc_probe``): how many of each generation ran and how long they
held the interpreter, written to ``$GC_LOG`` (default ``gc-pauses.txt``) as the process
exits. A full (generation 2) collection stops every thread of a server, the MLX worker
included, for as long as it walks the heap.

    GC_LOG=/tmp/gc.txt PYTHONPATH=bench/gc_probe MODEL=DIR bash bench/loop_cpu.sh
"""

import atexit
import gc
import os
import threading
import time

_pauses: dict[int, list[float]] = {}
_started: dict[int, float] = {}
_full: list[tuple[float, float]] = []  # (seconds since start, pause) of each full collection
_t0 = time.perf_counter()


def _timed(phase: str, info: dict) -> None:
    thread = threading.get_ident()
    if phase == "start":
        _started[thread] = time.perf_counter()
    elif thread in _started:
        now = time.perf_counter()
        pause = now - _started.pop(thread)
        _pauses.setdefault(info["generation"], []).append(pause)
        if info["generation"] == 2:
            _full.append((now - _t0, pause))


def _write() -> None:
    with open(os.environ.get("GC_LOG", "gc-pauses.txt"), "w") as f:
        for generation, pauses in sorted(_pauses.items()):
            pauses.sort()
            f.write(f"generation {generation}: {len(pauses)} collections, {1000 * sum(pauses):.0f} ms in all, "
                    f"median {1000 * pauses[len(pauses) // 2]:.2f} ms, longest {1000 * pauses[-1]:.1f} ms\n")
        f.write("full collections (s since start: ms): "
                + ", ".join(f"{at:.1f}: {1000 * pause:.1f}" for at, pause in _full) + "\n")
        f.write(f"objects tracked at exit: {len(gc.get_objects())}, frozen: {gc.get_freeze_count()}\n")


gc.callbacks.append(_timed)
atexit.register(_write)
