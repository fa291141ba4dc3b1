#!/usr/bin/env bash
# Where the MLX worker's host time goes in a burst of image requests, the engine alone
# (every request's inputs ready before the clock: bench/burst.py --preprocessed). Three
# runs: the worker's marks in order (timeline.json, burst-parts.json), the same under
# py-spy with native frames (spy.raw.gz; spy-worker.txt sums the worker thread's samples
# in the served turns, not the warm-up's), and the pixels' host-to-device cost
# (host_to_device.txt). Needs py-spy (EXTRA_WHEELS="py-spy" in the device setup).
#   OUT=DIR [RATE=50] bash bench/gpu/burst_profile.sh [preset]
# (RATE: py-spy samples a second; native frames make each sample slow, and at 200 the
# burst ran 5x slower)
set -uo pipefail
PRESET=${1:-gemma3-4b}
ARCH=${ARCH:-${PRESET%%-*}}
OUT=${OUT:-bench/results/gpu-burst-profile}
MODEL=${MODEL:-/tmp/vlm-bench-$PRESET}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch "$ARCH" --preset "$PRESET" --out "$MODEL"
python3 bench/host_to_device.py > "$OUT/host_to_device.txt" 2>&1
cat "$OUT/host_to_device.txt"
burst=(python3 bench/burst.py --model "$MODEL" --engine vlm-serve --preprocessed)
"${burst[@]}" --worker-parts --timeline "$OUT/timeline.json" --result-json "$OUT/burst-parts.json" \
    > "$OUT/burst-parts.log" 2>&1
grep -E '"(wall_s|ttft_max_s)"' "$OUT/burst-parts.log"
py-spy record --native --idle --threads --format raw -r "${RATE:-50}" -o "$OUT/spy.raw" -- \
    "${burst[@]}" --result-json "$OUT/burst-spy.json" > "$OUT/burst-spy.log" 2>&1
python3 bench/pyspy_summary.py "$OUT/spy.raw" --thread mlx-worker --within Scheduler.run \
    --without Scheduler.run_to_completion --top 60 > "$OUT/spy-worker.txt"
head -40 "$OUT/spy-worker.txt"
gzip -f "$OUT/spy.raw"
