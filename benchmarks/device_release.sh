#!/usr/bin/env bash
# One device call that checks a release tree: the whole GPU suite (Dask's GPU tests too when
# .whl/ is carried), benchmarks/kernels.py, benchmarks/ffn.py --quick and Nsight Compute counters,
# each under its own time limit so the call fits the 600 s cap. All logs and JSON go into
# $OUT/results.tgz (the device returns at most 8 files), packed again after every step; each
# step's summary prints as it ends, and the steps' exit codes and times print last.
# Usage on the H200 (repo root, carry=[".whl"] for Dask):  bash benchmarks/device_release.sh
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
R=$(mktemp -d); OUT=${OUT:-./device_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/gpu.txt"
step() {  # step NAME LIMIT_S COMMAND...: run under a limit, log to $R/NAME.log, say how long it took (LIMIT_S 0: skip)
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  [[ $limit -gt 0 ]] || return 0
  OUT=$R timeout "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "[$name] exit $rc in $((SECONDS - t0)) s" | tee -a "$R/steps.txt"
  # pack after every step: a call cut short by the device's time limit still returns what ran
  tar czf "$OUT/results.tgz" -C "$R" . 2>/dev/null
  echo "== $name"
  if [[ $name == gpu_tests ]]; then
    grep -E "passed|failed" "$R/$name.log" | tail -2; grep -E "^(FAILED|ERROR) " "$R/$name.log" | head -10
  else
    tail -${TAIL_LINES:-24} "$R/$name.log"
  fi
}
gpu_memory_log "$R/gpu_memory.csv"; watcher=$!
mkdir -p "$R/pools"  # per-worker CuPy pool sizes after each test (benchmarks/gpu_memory_hygiene.py)
step gpu_tests ${TESTS_LIMIT:-200} env TWELLPY_MEMORY_LOG="$R/pools" python -m pytest -q -m gpu -n ${GPU_WORKERS:-16} $XDIST_DIST tests -p no:cacheprovider -p benchmarks.gpu_memory_hygiene --durations=20
kill $watcher 2>/dev/null
step kernels ${KERNELS_LIMIT:-150} python benchmarks/kernels.py
[[ ${PROFILE_LIMIT:-120} -gt 0 ]] && step profile ${PROFILE_LIMIT:-120} python benchmarks/profile_kernels.py
step ffn ${FFN_LIMIT:-90} python benchmarks/ffn.py --quick
# every FFN workload of issue 4 and the nnz/token crossover plot (docs/ffn_crossover.png, also
# in results.tgz), only with FFN_FULL_LIMIT > 0: alone it needs most of a call
[[ ${FFN_FULL_LIMIT:-0} -gt 0 ]] && step ffn_full $FFN_FULL_LIMIT python benchmarks/ffn.py --reps ${FFN_FULL_REPS:-20}
# training step (issue 5): phases with the host clock beside them (only with TRAIN_LIMIT > 0)
[[ ${TRAIN_LIMIT:-0} -gt 0 ]] && step train $TRAIN_LIMIT python benchmarks/train.py --workloads ${TRAIN_WORKLOADS:-W1-16k} --reps 20
# per-kernel GPU timeline of the training step and the inference call (torch.profiler / CUPTI)
[[ ${TIMELINE_LIMIT:-0} -gt 0 ]] && step timeline $TIMELINE_LIMIT python benchmarks/step_timeline.py
# issue 4 experiment: SM-capped gate GEMM overlapped with the sparse step (only with OVERLAP_LIMIT > 0)
[[ ${OVERLAP_LIMIT:-0} -gt 0 ]] && step overlap $OVERLAP_LIMIT python benchmarks/overlap_probe.py
# Dask overhead (issue 8): only with the wheels carried and DASK_LIMIT > 0
if [[ ${DASK_LIMIT:-0} -gt 0 ]] && python -c "import dask_cuda" 2>/dev/null; then
  step dask $DASK_LIMIT python benchmarks/dask_scaling.py --workers 1 --reps ${DASK_REPS:-10} --submit eager ${DASK_ARGS:-}
fi
# issue 8: the five Dask sync variants (benchmarks/dask_variants.sh), only with DASK_VARIANTS_LIMIT > 0
if [[ ${DASK_VARIANTS_LIMIT:-0} -gt 0 ]] && python -c "import dask_cuda" 2>/dev/null; then
  step dask_variants $DASK_VARIANTS_LIMIT bash benchmarks/dask_variants.sh
fi
tar czf "$OUT/results.tgz" -C "$R" .  # once more: the memory watcher was still writing at the first step's pack
cat "$R/steps.txt"
