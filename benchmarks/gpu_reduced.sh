#!/usr/bin/env bash
# The outer optimiser over BOCF's ten parameters on the reduced misfit φ(p) = min over the
# hidden fields of the loss (benchmarks/block_steps.py --mode reduced), in one GPU call: the
# voltage-only dataset (bocf_from_voltage, 64², σ = 0.02, data at dt/10), the fields alone
# fitted at start seed 0's parameters through the staged windows up to FRAMES frames, then
# L-BFGS-B over the parameters, each evaluation refitting the fields FIELD_STEPS
# Levenberg–Marquardt steps from the best fields so far.
#   bash benchmarks/gpu_wheels.sh                                    # here, once
#   run (carry .whl): source .whl/gpu_setup.sh && OUT=$OUT LIMIT=540 bash benchmarks/gpu_reduced.sh
#   OUT          where the log goes (the device call's $OUT)
#   LIMIT        seconds for the whole script (default 540; the search stops 90 s before)
#   GRID (64), FRAMES (21: the fields alone on 2 3 6 11 21 frames first), PREP_STEPS (30),
#   FIELD_STEPS (20), EVALUATIONS (40), OVERRIDES (Hydra overrides for every fit)
# Writes $OUT/reduced.log (one line per window and per evaluation: the loss on the FRAMES
# window, every parameter's error against the truth) and $OUT/reduced.jsonl.
set -u
OUT=${OUT:?set OUT}; LIMIT=${LIMIT:-540}; GRID=${GRID:-64}; FRAMES=${FRAMES:-21}
PREP_STEPS=${PREP_STEPS:-30}; FIELD_STEPS=${FIELD_STEPS:-20}; EVALUATIONS=${EVALUATIONS:-40}
OVERRIDES=${OVERRIDES:-}
RUNS=${RUNS:-$(mktemp -d)}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
start=$(date +%s)
windows=()
for n in 2 3 6 11 21 41 101; do [ "$n" -le "$FRAMES" ] && windows+=("$n"); done
timeout --signal=INT --kill-after=20 "$LIMIT" python3 benchmarks/block_steps.py \
  --grid "$GRID" --simulate --data "$RUNS/data.zarr" --frames "$FRAMES" \
  --fields-first "${windows[@]}" --prep-steps "$PREP_STEPS" \
  --mode reduced --rounds "$EVALUATIONS" --field-steps "$FIELD_STEPS" \
  --budget-s $(( LIMIT - 90 )) --output "$OUT/reduced.jsonl" -- $OVERRIDES \
  > "$OUT/reduced.log" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/exits.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
ls -la "$OUT"
