"""Host time to launch single ops at repeating shapes and at new ones (Gemma-3-4B
sizes, bf16): matmuls, attention with a mask or causal, elementwise chains, RMSNorm.
Each call prints ``shape:launch/device``: the time ``mx.async_eval`` took on the host
and the wait for the device after it. A series' first call pays first-use costs.

    MLX_USE_CUDA_GRAPHS=0 python bench/shape_costs.py
"""

from __future__ import annotations

import time

import mlx.core as mx

BF16 = mx.bfloat16
HIDDEN = 2560


def series(label: str, make_inputs, op, shapes: list) -> None:
    timings = []
    for shape in shapes:
        inputs = make_inputs(shape)
        mx.eval(inputs)
        mx.synchronize()
        y = op(*inputs)
        start = time.perf_counter()
        mx.async_eval(y)
        launched = time.perf_counter()
        mx.eval(y)
        done = time.perf_counter()
        timings.append(f"{shape}:{1e3 * (launched - start):.2f}/{1e3 * (done - launched):.2f}")
    print(f"{label:26s} launch/device ms: " + " ".join(timings), flush=True)


def tokens(m: int) -> list[mx.array]:
    return [mx.random.normal((m, HIDDEN)).astype(BF16)]


def attention_inputs(shape: tuple[int, int]) -> list[mx.array]:
    """Queries of ``L`` new tokens over ``kL`` keys (8 query heads, 4 key/value heads,
    head dim 256), and the causal mask of the new tokens as an array."""
    L, kL = shape
    q = mx.random.normal((1, 8, L, 256)).astype(BF16)
    k = mx.random.normal((1, 4, kL, 256)).astype(BF16)
    v = mx.random.normal((1, 4, kL, 256)).astype(BF16)
    mask = mx.arange(kL)[None] <= (mx.arange(L)[:, None] + kL - L)
    return [q, k, v, mask]


def main() -> None:
    gate_up = mx.random.normal((HIDDEN, 20480)).astype(BF16)
    qkv = mx.random.normal((HIDDEN, 4096)).astype(BF16)
    mx.eval(gate_up, qkv)

    def matmul(x):
        return x @ gate_up

    def ten_matmuls(x):
        return [x @ qkv for _ in range(10)]

    def masked(q, k, v, mask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.06, mask=mask)

    def causal(q, k, v, mask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.06, mask="causal")

    def elementwise(x):
        for _ in range(100):
            x = x * 1.001 + 0.5
        return x

    weight = mx.ones((HIDDEN,), BF16)

    def rms_norms(x):
        return [mx.fast.rms_norm(x + i, weight, 1e-6) for i in range(50)]

    series("matmul, same M", tokens, matmul, [64] * 8)
    series("matmul, new M", tokens, matmul, list(range(65, 73)))
    series("10 matmuls, same M", tokens, ten_matmuls, [64] * 6)
    series("10 matmuls, new M", tokens, ten_matmuls, list(range(80, 86)))
    series("attention, same", attention_inputs, masked, [(64, 352)] * 6)
    series("attention, new L and kL", attention_inputs, masked, [(64 + i, 352 + 7 * i) for i in range(1, 7)])
    series("attention, new kL", attention_inputs, masked, [(64, 352 + 7 * i) for i in range(1, 7)])
    series("attention, new L", attention_inputs, masked, [(64 + i, 352) for i in range(1, 7)])
    series("causal, same", attention_inputs, causal, [(64, 352)] * 6)
    series("causal, new L and kL", attention_inputs, causal, [(64 + i, 352 + 7 * i) for i in range(11, 17)])
    series("200 elementwise, same", tokens, elementwise, [64] * 6)
    series("200 elementwise, new", tokens, elementwise, list(range(100, 106)))
    series("50 rms_norm, same", tokens, rms_norms, [64] * 6)
    series("50 rms_norm, new", tokens, rms_norms, list(range(120, 126)))


if __name__ == "__main__":
    main()
