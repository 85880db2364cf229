#!/usr/bin/env bash
# One device call's worth of checks of ffn_long.cu (the FFN's long rows, see its header):
#   1. its GPU tests, plain (one launch, tickets, down work waiting for up work);
#   2. racecheck, initcheck and synccheck on them with TWELLPY_FFN_LONG_LAUNCHES=3 (scan,
#      up work and down work as three launches, no waiting between blocks), float32 only:
#      racecheck dies in cuBLAS's bfloat16 GEMM before any twellpy kernel ("Internal
#      Sanitizer Error ... hardware exception", benchmarks/racecheck_cublas_probe.py; seen
#      again on 2026-12-06, H100, at the first bfloat16 test) and initcheck does not see that GEMM's writes (it reported every
#      read of g in twellpy_ffn_rowpack<bf16> as uninitialised). On 2026-12-06 racecheck and
#      initcheck also stalled on the one-launch form, after such a bfloat16 test;
#   3. memcheck on them, with three launches, and with one launch under a time limit (to tell
#      whether memcheck runs the ticket wait; a timeout is reported, not hidden).
# Usage (device, repo root): bash benchmarks/long_rows_sanitize.sh; logs in $OUT/long_rows_sanitize.tgz.
# LONG_K narrows the tests (pytest -k); *_TIMEOUT limit each step (seconds).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh" > /dev/null
OUT=${OUT:-./device_out}; mkdir -p "$OUT"; R=$(mktemp -d)
files="tests/test_gpu_ffn_infer.py"
k=${LONG_K:-"long_rows"}
# the sanitizers run the smaller parametrisations (no two-stream pipeline); memcheck both
# 16- and 32-bit types, the others float32 (see 2. above). The comparison of the two forms
# (test_long_rows_in_three_launches_...) stays out: it runs the one-launch form whatever
# TWELLPY_FFN_LONG_LAUNCHES says (under its old name, "two" kept it out)
ks="$k and not two and not three_launches and (bfloat16 or float32)"
ks32="$k and not two and not three_launches and float32"
pack() { tar czf "$OUT/long_rows_sanitize.tgz" -C "$R" .; }
summary() {  # summary NAME RC: the pytest line and the sanitizer's summary of one log
  echo "[$1] exit $2 (124: time limit): $(grep -E '[0-9]+ (passed|failed)' "$R/$1.log" | tail -1);" \
       "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$R/$1.log" | sort | uniq -c | tr '\n' ' ')" | tee -a "$R/summary.txt"
}
python -m pytest -q -m gpu -n 8 $XDIST_DIST $files -k "$k" -p no:cacheprovider > "$R/plain.log" 2>&1
summary plain $?; pack
for tool in racecheck initcheck synccheck memcheck; do
  sel=$ks32; [[ $tool == memcheck ]] && sel=$ks
  TWELLPY_FFN_LONG_LAUNCHES=3 TWELLPY_SANITIZE=1 timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool \
    --print-limit 20 --kernel-name kns=twellpy_ffn_long --show-backtrace device \
    python -m pytest -q -m gpu $files -k "$sel" -p no:cacheprovider > "$R/${tool}_three_launches.log" 2>&1
  summary ${tool}_three_launches $?; pack
done
TWELLPY_SANITIZE=1 timeout ${ONE_LAUNCH_TIMEOUT:-120} compute-sanitizer --tool memcheck --print-limit 20 \
  --kernel-name kns=twellpy_ffn_long --show-backtrace device python -m pytest -q -m gpu $files -k "$ks" -p no:cacheprovider \
  > "$R/memcheck_one_launch.log" 2>&1
summary memcheck_one_launch $?; pack
cat "$R/summary.txt"
