#!/usr/bin/env bash
# The field solves' preconditioner on 20 ms of voltage, old against new, on a GPU:
# bocf_from_voltage's dataset (64², σ = 0.02, data at dt/10), the hidden fields alone fitted at
# start seed 0's parameters through the 2-…-41-frame windows, then from that one state two
# benchmarks/block_steps.py --mode schur runs side by side on the 41-frame window, one with
# the shipped probed diagonal (every PROBE_SPACING-th cell, floored at the fields' prior
# curvature), one with the earlier one (every 4th cell, not floored). With AP_GRID, beside
# them ap_from_voltage (σ = 0.02, seed 0) with its fields kept in their range and without.
# Measured on one H200 (2026-12-04, docs/benchmarks.md, "The probed diagonal at a fitted
# state"): with two 32² Aliev–Panfilov fits beside it the preparation had not reached the
# 41-frame window after 555 s. Prepare in one call and run the Schur steps in another: the
# prep state (RUNS/states/prep) kept in the checkout, carried, and named by START.
#   bash benchmarks/gpu_wheels.sh                                    # here, once
#   run (carry .whl): source .whl/gpu_setup.sh && OUT=$OUT LIMIT=560 PREP_ONLY=1 bash benchmarks/gpu_schur.sh
#   here: tar -xzf <files_at>/prep.tgz -C prep/  (prep/ in .git/info/exclude)
#   run (carry .whl, prep): source .whl/gpu_setup.sh && OUT=$OUT LIMIT=560 START=prep/states/prep \
#     bash benchmarks/gpu_schur.sh
#   OUT          where the logs go (the device call's $OUT)
#   LIMIT        seconds for the whole script (default 560)
#   GRID (64), FRAMES (41), PREP_STEPS (20), FIELD_STEPS (10), ITERATIONS (100), DAMPING (0.1),
#   ROUNDS (3), START (a saved prep state and the folder above it holding data.zarr: no
#   preparation), PREP_ONLY (1: the preparation alone), AP_GRID (empty: no Aliev–Panfilov
#   fits; e.g. 32), AP_EXTRA (realistic.py arguments),
#   AP_OVERRIDES (Hydra overrides of both Aliev–Panfilov fits)
# Writes $OUT/prep.log, $OUT/schur-shipped.log, $OUT/schur-spacing4.log (one line per part:
# the loss on the window, every parameter's error; per Schur step the columns whose solves
# stopped at their cap and the cosines with the way to the truth), $OUT/ap-*.json/.log.
set -u
OUT=${OUT:?set OUT}; LIMIT=${LIMIT:-560}; GRID=${GRID:-64}; FRAMES=${FRAMES:-41}
PREP_STEPS=${PREP_STEPS:-20}; FIELD_STEPS=${FIELD_STEPS:-10}; ITERATIONS=${ITERATIONS:-100}
DAMPING=${DAMPING:-0.1}; ROUNDS=${ROUNDS:-3}; AP_GRID=${AP_GRID:-}
START=${START:-}; PREP_ONLY=${PREP_ONLY:-}
AP_EXTRA=${AP_EXTRA:-}; AP_OVERRIDES=${AP_OVERRIDES:-}
RUNS=${RUNS:-$(mktemp -d)}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.2}
start=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - start) )); }
ap() {  # name, extra overrides
  timeout --signal=INT --kill-after=20 "$(left)" python3 benchmarks/realistic.py \
    --experiment ap_from_voltage --grid "$AP_GRID" --sigmas 0.02 --seeds 0 $AP_EXTRA \
    --runs "$RUNS/ap-$1" --output "$OUT/ap-$1.json" -- run.progress=false $AP_OVERRIDES "${@:2}" \
    > "$OUT/ap-$1.log" 2>&1
  echo "ap-$1: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/exits.txt"
}
if [ -n "$AP_GRID" ]; then ap bounded & ap unbounded fit.bound_fields=false & fi
windows=()
for n in 2 3 6 11 21 41 101; do [ "$n" -le "$FRAMES" ] && windows+=("$n"); done
if [ -z "$START" ]; then
timeout --signal=INT --kill-after=20 "$(left)" python3 benchmarks/block_steps.py \
  --grid "$GRID" --simulate --data "$RUNS/data.zarr" --frames "$FRAMES" \
  --fields-first "${windows[@]}" --prep-steps "$PREP_STEPS" --mode schur --rounds 0 \
  --save "$RUNS/states" --output "$OUT/block_steps.jsonl" > "$OUT/prep.log" 2>&1
echo "prep: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/exits.txt"
START=$RUNS/states/prep
[ -n "$PREP_ONLY" ] && [ -d "$START" ] && tar -czf "$OUT/prep.tgz" -C "$RUNS" data.zarr states/prep
fi
DATA=$(dirname "$(dirname "$START")")/data.zarr
schur() {  # name, extra arguments
  timeout --signal=INT --kill-after=20 "$(left)" python3 benchmarks/block_steps.py \
    --grid "$GRID" --start "$START" --data "$DATA" --frames "$FRAMES" --mode schur \
    --schur-iterations "$ITERATIONS" --schur-damping "$DAMPING" --rounds "$ROUNDS" \
    --field-steps "$FIELD_STEPS" --budget-s $(( $(left) - 20 )) "${@:2}" \
    --output "$OUT/block_steps.jsonl" > "$OUT/schur-$1.log" 2>&1
  echo "schur-$1: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/exits.txt"
}
[ -z "$PREP_ONLY" ] && [ -d "$START" ] && { schur shipped & schur spacing4 --probe-spacing 4 --no-prior-floor & }
wait
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
ls -la "$OUT"
