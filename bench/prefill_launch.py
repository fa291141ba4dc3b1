"""Host time to launch one last prefill pass: a prompt going on from a cached prefix
(as turn 2 of a chat does) against one on fresh caches, with the same shapes every
time and with new shapes every time (another cached length, another number of new
tokens). On MLX a pass is launched node by node on the host; where the device finishes
right after ``mx.async_eval`` returns, the pass is bound by that launch.

    python bench/prefill_launch.py --model DIR
    python bench/prefill_launch.py --model DIR --only new-length --passes 10 [--bucketed]
    python bench/prefill_launch.py --model DIR --only same --cached 1000 --new 32

Per pass: building the graph, then ``mx.async_eval``'s wall and CPU time, the wait for
the device after it, and the graph's nodes (first pass of each series).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from count_nodes import count  # noqa: E402 - run from bench/ or with it on the path
from mlx_vlm import load
from step_breakdown import id_limit  # noqa: E402

from vlm_serve.engine.families import family_for
from vlm_serve.engine.decode.store import round_up_coarsely
from vlm_serve.engine.prefill import PASS_STEP, pad_tokens, prefill_pass
from vlm_serve.engine.prefix_cache import PrefixCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--only", choices=["same", "new", "new-offset", "new-length"], default=None,
                        help="only continuing passes: repeating shapes, new ones, or a new cached "
                             "length or a new number of new tokens alone")
    parser.add_argument("--passes", type=int, default=6, help="passes per series")
    parser.add_argument("--cached", type=int, default=288, help="cached tokens of the repeating series")
    parser.add_argument("--new", type=int, default=64, help="new tokens of the repeating series")
    parser.add_argument("--bucketed", action="store_true",
                        help="pad each pass to its coarse length, as bucketed last passes are")
    args = parser.parse_args()
    model, _ = load(args.model)
    lm = model.language_model
    family = family_for(model)
    limit = id_limit(model)

    def tokens(n: int, seed: int) -> mx.array:
        return mx.random.randint(10, limit, (1, n), key=mx.random.key(seed))

    def continuing(offset: int) -> list:
        """A cache of ``offset`` tokens as the prefix cache hands it out."""
        ids = tokens(offset, offset)
        cache = lm.make_cache()
        prefill_pass(model, family, ids, lm.model.embed_tokens(ids), cache, {}, n_to_process=offset)
        mx.eval([c.state for c in cache])
        prefixes = PrefixCache(8, 1 << 40)
        prefixes.store(ids[0].tolist(), cache)
        return prefixes.lookup(ids[0].tolist() + [5])[0]

    def series(label: str, cases: list[tuple[int, int]]) -> None:
        for i, (offset, n) in enumerate(cases):
            cache = continuing(offset) if offset else lm.make_cache()
            ids = tokens(n, n)
            embeds, ends, padded = lm.model.embed_tokens(ids), None, n
            if args.bucketed:
                padded = round_up_coarsely(n, PASS_STEP)
                ids, embeds, ends = pad_tokens(ids, padded), pad_tokens(embeds, padded), mx.array([n - 1])
            mx.synchronize()
            start = time.perf_counter()
            logits, _ = prefill_pass(model, family, ids, embeds, cache, {}, last_positions=ends)
            built = time.perf_counter()
            nodes = sum(count(logits).values()) if i == 0 else None
            wall, cpu = time.perf_counter(), time.thread_time()
            mx.async_eval(logits)
            launched, cpu_used = time.perf_counter(), time.thread_time() - cpu
            mx.eval(logits)
            done = time.perf_counter()
            print(f"{label:20s} cached {offset:4d} new {n:3d} (pass {padded:3d}): build {1000 * (built - start):5.2f} ms, "
                  f"async_eval {1000 * (launched - wall):6.2f} ms (cpu {1000 * cpu_used:6.2f}), "
                  f"device after it {1000 * (done - launched):5.2f} ms"
                  + (f", {nodes} nodes" if nodes else ""))

    passes = args.passes
    series("warm-up", [(args.cached, args.new)] * 2)
    if args.only in (None, "same"):
        series("continuing, same", [(args.cached, args.new)] * passes)
    if args.only in (None, "new"):
        series("continuing, new", [(288 + 7 * i, 60 + 3 * i) for i in range(1, passes + 1)])
    if args.only == "new-offset":
        series("new cached length", [(288 + 7 * i, 64) for i in range(1, passes + 1)])
    if args.only == "new-length":
        series("new token count", [(288, 60 + 3 * i) for i in range(1, passes + 1)])
    if args.only is None:
        series("fresh, same", [(0, 64)] * passes)
        series("fresh, new", [(0, 61 + 3 * i) for i in range(1, passes + 1)])


if __name__ == "__main__":
    main()
