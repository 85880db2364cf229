#!/usr/bin/env bash
# One device call that checks a tree with pending/ patches applied (see pending/README.md):
# the GPU tests of the files the patches touch, then the FFN tables that decide whether each
# patch lands (ffn.py's full table and its decode-size table with CUDA graphs, hot_rows_probe.py,
# decode_probe.py, graph rows included; train.py at W1-16k, exact and speculative). Every log goes into
# $OUT/pending_check.tgz (the device returns at most 8 files); the tables print as they end.
# Usage (device, repo root of the patched tree; carry=[".whl"] is not needed):
#   bash benchmarks/pending_check.sh
# PENDING_TESTS overrides the test files; each step has its own time limit (*_LIMIT, seconds).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh" > /dev/null
R=$(mktemp -d); OUT=${OUT:-./device_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/gpu.txt"
python -c "import sys; sys.path.insert(0, 'tests'); import conftest; print('code hash', conftest._code_hash())" | tee "$R/hash.txt"
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  OUT=$R timeout "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "[$name] exit $rc in $((SECONDS - t0)) s" | tee -a "$R/steps.txt"
  tar czf "$OUT/pending_check.tgz" -C "$R" . 2>/dev/null
}
# the files pending 0091-0104 touch (FFN graphs and long rows, the speculative training layout)
tests=${PENDING_TESTS:-"tests/test_gpu_ffn_infer.py tests/test_ffn_infer.py tests/test_gpu_train.py tests/test_ffn_train.py tests/test_determinism.py tests/test_gpu_reliability.py tests/test_bad_input.py"}
step gpu_tests ${TESTS_LIMIT:-240} python -m pytest -q -m gpu -n ${GPU_WORKERS:-12} $XDIST_DIST $tests -p no:cacheprovider
grep -E "passed|failed" "$R/gpu_tests.log" | tail -1; grep -E "^(FAILED|ERROR) " "$R/gpu_tests.log" | head -10
step ffn ${FFN_LIMIT:-120} python benchmarks/ffn.py --reps 20
tail -30 "$R/ffn.log"
step hot_rows ${HOT_LIMIT:-120} python benchmarks/hot_rows_probe.py
cat "$R/hot_rows.log"
step decode ${DECODE_LIMIT:-90} python benchmarks/decode_probe.py
head -90 "$R/decode.log" | tail -88
# PENDING_TRAIN=0 leaves out the training step (exact and speculative layout against torch dense)
if [[ ${PENDING_TRAIN:-1} == 1 ]]; then
  step train ${TRAIN_LIMIT:-150} python benchmarks/train.py --workloads W1-16k
  tail -25 "$R/train.log"
fi
tar czf "$OUT/pending_check.tgz" -C "$R" .
cat "$R/steps.txt"
