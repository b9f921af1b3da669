#!/usr/bin/env bash
# benchmarks/sweep_cost.py on the lent GPU under the variants that decide where a 512² fit's
# time goes: float64 as the experiments run (unrolled loops or not), the same with XLA's
# while loops and conditionals kept on the device (CUDA-graph command buffers), float32, and
# float64 at 256² (a per-step time that does not fall with the grid is latency, not traffic).
#   bash benchmarks/gpu_wheels.sh                                     # here, once
#   run (carry .whl): source .whl/gpu_setup.sh && OUT=$OUT bash benchmarks/gpu_sweeps.sh
#   OUT  where the tables go; GRID (512), FRAMES (11), SMALL (256), LIMIT s per variant (150),
#   SCHEDULES the adjoint schedules timed (sweep_cost.py --schedules; default: configured)
set -u
OUT=${OUT:?set OUT}; GRID=${GRID:-512}; SMALL=${SMALL:-256}; FRAMES=${FRAMES:-11}; LIMIT=${LIMIT:-150}
SCHEDULES=${SCHEDULES:-configured}
ONDEVICE="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
variant() {  # label, XLA_FLAGS, grid, unroll list, overrides...
  local label=$1 flags=$2 grid=$3 unroll=$4; shift 4
  XLA_FLAGS="$flags" timeout --kill-after=10 "$LIMIT" python3 benchmarks/sweep_cost.py \
    --grid "$grid" --frames "$FRAMES" --unroll $unroll --schedules $SCHEDULES --label "$label" \
    --output "$OUT/sweep_cost-$label.json" -- run.progress=false "$@" \
    > "$OUT/sweep_cost-$label.log" 2>&1
  echo "$label: exit $?"; grep -E '^\||model steps' "$OUT/sweep_cost-$label.log"
}
python3 -c "import jax; print(jax.devices())"
variant f64 "" "$GRID" "1 7"
variant f64-ondevice "$ONDEVICE" "$GRID" "1"
variant f32 "" "$GRID" "1" precision=float32
variant "f64-$SMALL" "" "$SMALL" "1"
# FIT_UNTIL (seconds since the start, unset: no fit): then the 512² bocf_from_voltage fit of
# benchmarks/gpu_realistic.sh under whichever float64 flags gave the cheaper G·v above, cut at
# that time, so that its stages' times compare with docs/benchmarks.md's.
if [ -n "${FIT_UNTIL:-}" ]; then
  flags=$(python3 - "$OUT" "$ONDEVICE" <<'PY'
import json, sys
def cost(label):
    try:
        return json.load(open(f"{sys.argv[1]}/sweep_cost-{label}.json"))["records"]["gn_product"]["median_s"]
    except (OSError, KeyError, ValueError):
        return float("inf")
print(sys.argv[2] if cost("f64-ondevice") < cost("f64") else "")
PY
)
  left=$(( FIT_UNTIL - SECONDS ))
  echo "fit with XLA_FLAGS='$flags' for ${left} s"
  XLA_FLAGS="$flags" OUT=$OUT LIMIT=$left BOCF_GRIDS=$GRID AP_GRIDS="" \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 bash benchmarks/gpu_realistic.sh
fi
