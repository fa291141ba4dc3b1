"""Prefill launches held back for a turn (``engine/prefill_launches.py``) are that
thread's only: each engine's worker thread does all of its MLX operations, and an array
queued from another thread fails ("There is no Stream(...) in current thread"). The
parity suite checks what deferring does to a burst's tokens (nothing)."""

from __future__ import annotations

import threading

import mlx.core as mx

from vlm_serve.engine import prefill_launches


def test_a_turn_holds_only_its_own_threads_prefill_work(monkeypatch):
    monkeypatch.setattr(prefill_launches, "DEFER", True)
    prefill_launches.defer()
    try:
        seen_elsewhere = []

        def another_worker():
            x = mx.array([1.0]) + 1
            prefill_launches.launch(x)  # queued at once: this thread's turn holds nothing
            seen_elsewhere.append(prefill_launches.held())
            seen_elsewhere.append(x.item())

        thread = threading.Thread(target=another_worker)
        thread.start()
        thread.join()
        assert seen_elsewhere == [None, 2.0]
        y = mx.array([2.0]) * 3
        prefill_launches.launch(y)
        held = prefill_launches.held()
        assert len(held) == 1 and held[0] is y
    finally:
        prefill_launches.flush()
    assert prefill_launches.held() is None
    assert y.item() == 6.0


def test_nothing_is_held_unless_deferring(monkeypatch):
    monkeypatch.setattr(prefill_launches, "DEFER", False)
    prefill_launches.defer()
    x = mx.array([1.0]) + 1
    prefill_launches.launch(x)
    assert prefill_launches.held() is None
    prefill_launches.flush()
    assert x.item() == 2.0
