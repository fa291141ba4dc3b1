"""Where each thread of a process spent its time, from a py-spy raw profile.

``py-spy record --pid PID --threads --idle --format raw -o FILE`` writes one line per
distinct stack ("thread (id): name;frame;frame... count"). This sums, per thread, the
samples each function appears in (inclusive) and prints the top functions with their
share of that thread's samples: e.g. how much of the MLX worker went to prefill,
launching decode steps, reading them back, or a native frame under them (``--native``).

    python bench/pyspy_summary.py FILE [--top 20] [--thread mlx-worker]
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict


def summarize(path: str) -> tuple[Counter, dict[str, Counter]]:
    samples: Counter = Counter()
    inclusive: dict[str, Counter] = defaultdict(Counter)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            thread, *frames = stack.split(";")
            n = int(count)
            samples[thread] += n
            for name in {frame.split(" (")[0] for frame in frames}:
                inclusive[thread][name] += n
    return samples, inclusive


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--thread", default=None, help="only threads whose name contains this")
    args = p.parse_args()
    samples, inclusive = summarize(args.profile)
    for thread, total in samples.most_common():
        if args.thread and args.thread not in thread:
            continue
        print(f"{thread}: {total} samples")
        # Frames in every sample (thread start-up, the run loop) say nothing: skip them.
        shown = [(name, n) for name, n in inclusive[thread].most_common() if n < total]
        for name, n in shown[:args.top]:
            print(f"  {100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
