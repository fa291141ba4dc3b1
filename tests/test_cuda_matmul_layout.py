"""How the row-exact matmul (``engine/cuda_matmul.py``) lays a call out over the card.
Only the warps per block change a row's bits, so they must follow the weight's shape
alone; the rest may follow the row count. Plain Python: runs everywhere (the kernel
itself runs only on CUDA: ``tests/test_cuda_matmul.py``, ``tests/test_cuda_emulated.py``)."""

from __future__ import annotations

from vlm_serve.engine import cuda_matmul

GEMMA3_4B_WIDTHS = (2560, 2048, 10240)  # the inputs of qkv / gate-up, o, down
ROW_COUNTS = (1, 7, 16, 33, 64, 65, 130, 2048)


def test_the_warps_follow_the_weights_shape_alone():
    for width in GEMMA3_4B_WIDTHS:
        assert {cuda_matmul.layout(rows, width)[2] for rows in ROW_COUNTS} == {cuda_matmul.warps_for(width)}


def test_a_decode_steps_batch_takes_blocks_of_at_most_32_rows():
    for rows in (1, 16, 17, 32, 33, 64):
        assert cuda_matmul.layout(rows, 2560)[0] <= 2
    assert cuda_matmul.layout(65, 2560)[0] == 8
    assert cuda_matmul.layout(2048, 2560)[0] == 8
