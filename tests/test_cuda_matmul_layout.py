"""How the row-exact matmul (``engine/cuda_matmul.py``) lays a call out over the card.
Only the warps per block change a row's bits, and they follow the weight's shape alone;
the rest may follow the row count. Plain Python: runs everywhere (the kernel itself
runs only on CUDA: ``tests/test_cuda_matmul.py``, ``tests/test_cuda_emulated.py``)."""

from __future__ import annotations

import pytest

from vlm_serve.engine import cuda_matmul

GEMMA3_4B = [(2560, 4096), (2048, 2560), (2560, 20480), (10240, 2560), (2560, 262144)]  # (in, out)


@pytest.mark.parametrize("min_blocks", [0, 264, 10_000])
def test_the_warps_follow_the_weights_shape_alone(monkeypatch, min_blocks):
    monkeypatch.setattr(cuda_matmul, "MIN_BLOCKS", min_blocks)
    for width, out in GEMMA3_4B:
        warps = {cuda_matmul.layout(rows, width, out)[2] for rows in (1, 7, 16, 33, 64, 65, 130, 2048)}
        assert warps == {cuda_matmul.warps_for(width)}


def test_blocks_take_32_columns_unless_the_grid_would_be_small(monkeypatch):
    monkeypatch.setattr(cuda_matmul, "MIN_BLOCKS", 0)
    assert {cuda_matmul.layout(rows, 2048, 2560)[1] for rows in (1, 64, 2048)} == {4}
    monkeypatch.setattr(cuda_matmul, "MIN_BLOCKS", 264)
    # o projection, one row block: 80 blocks of 32 columns, 160 of 16, 320 of 8
    assert cuda_matmul.layout(1, 2048, 2560)[1] == 1
    # qkv: 128 of 32 columns, 256 of 16, then 512 of 8
    assert cuda_matmul.layout(16, 2560, 4096)[1] == 1
    # two row blocks of 32 rows: 2 x 128 of 32 columns, 2 x 256 of 16
    assert cuda_matmul.layout(64, 2560, 4096)[1] == 2
    # gate/up and the output layer have blocks enough at 32 columns
    assert cuda_matmul.layout(1, 2560, 20480)[1] == 4
    assert cuda_matmul.layout(64, 2560, 262144)[1] == 4
    # down, at 1,024 rows in blocks of 128: 8 x 80 = 640 blocks
    assert cuda_matmul.layout(1024, 10240, 2560)[1] == 4
    # never narrower than one tile of 8 columns
    monkeypatch.setattr(cuda_matmul, "MIN_BLOCKS", 10**9)
    assert cuda_matmul.layout(1, 64, 8)[1] == 1


def test_a_decode_steps_batch_takes_blocks_of_at_most_32_rows():
    for rows in (1, 16, 17, 32, 33, 64):
        assert cuda_matmul.layout(rows, 2560, 4096)[0] <= 2
    assert cuda_matmul.layout(65, 2560, 4096)[0] == 8
    assert cuda_matmul.layout(2048, 2560, 4096)[0] == 8
