"""Where each thread of a process spent its time, from a py-spy raw profile.

``py-spy record --pid PID --threads --idle --format raw -o FILE`` writes one line per
distinct stack ("thread (id): name;frame;frame... count"). This sums, per thread, the
samples each function appears in (inclusive) and prints the top functions with their
share of that thread's samples: e.g. how much of the MLX worker went to prefill,
launching decode steps, reading them back, or a native frame under them (``--native``).

    python bench/pyspy_summary.py FILE [--top 20] [--thread mlx-worker] [--within NAME] [--without NAME]
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict


def summarize(path: str, within: str | None = None, without: str | None = None) -> tuple[Counter, dict[str, Counter]]:
    """Samples per thread, and per thread the samples each function appears in; only
    stacks with a frame named ``within``, and none named ``without``, where given."""
    samples: Counter = Counter()
    inclusive: dict[str, Counter] = defaultdict(Counter)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            thread, *frames = stack.split(";")
            names = {frame.split(" (")[0] for frame in frames}
            if (within and within not in names) or (without and without in names):
                continue
            n = int(count)
            samples[thread] += n
            for name in names:
                inclusive[thread][name] += n
    return samples, inclusive


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--thread", default=None, help="only threads whose name contains this")
    p.add_argument("--within", help="only samples under a frame of this name (e.g. Scheduler.run)")
    p.add_argument("--without", help="no samples under a frame of this name (e.g. Scheduler.run_to_completion)")
    args = p.parse_args()
    samples, inclusive = summarize(args.profile, args.within, args.without)
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
