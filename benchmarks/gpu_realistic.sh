#!/usr/bin/env bash
# The GPU rows of issue 24 in one device call: benchmarks/realistic.py's headline fits run side
# by side on one GPU (each process takes a quarter of its memory), each under a time limit so
# that the run directories come back even when a fit is cut short. On the device machine:
#   bash benchmarks/gpu_wheels.sh                                    # here, once
#   run (carry .whl): source .whl/gpu_setup.sh && OUT=$OUT LIMIT=500 bash benchmarks/gpu_realistic.sh
#   OUT          where the results go (the device call's $OUT)
#   LIMIT        seconds each fit may run (default 500)
#   BOCF_GRIDS   BOCF grids (default "128 512"); AP_GRIDS the Aliev–Panfilov ones (default 128)
#   EXTRA        extra realistic.py arguments placed before "--" (e.g. "--forecast 10")
#   OVERRIDES    Hydra overrides given to every fit
# Each fit writes $OUT/<experiment>-<n>.json/.md/.log; the run directories, without
# checkpoints and datasets, are packed into $OUT/runs.tgz.
set -u
OUT=${OUT:?set OUT}; LIMIT=${LIMIT:-500}
BOCF_GRIDS=${BOCF_GRIDS-"128 512"}; AP_GRIDS=${AP_GRIDS-128}
EXTRA=${EXTRA:-}; OVERRIDES=${OVERRIDES:-}
RUNS=${RUNS:-$(mktemp -d)}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.24}
python3 -c "import jax; print(jax.devices())"
start=$(date +%s)
launch() {  # experiment grid
  local name=$1-$2
  timeout --signal=INT --kill-after=20 "$LIMIT" python3 benchmarks/realistic.py \
    --experiment "$1" --grid "$2" --sigmas 0.02 --seeds 0 $EXTRA \
    --runs "$RUNS/$name" --output "$OUT/$name.json" -- run.progress=false $OVERRIDES \
    > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/exits.txt"
}
for n in $BOCF_GRIDS; do launch bocf_from_voltage "$n" & done
for n in $AP_GRIDS; do launch ap_from_voltage "$n" & done
wait
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
tar -czf "$OUT/runs.tgz" -C "$RUNS" --exclude=checkpoints --exclude='*.zarr' . 2>/dev/null
ls -la "$OUT"
