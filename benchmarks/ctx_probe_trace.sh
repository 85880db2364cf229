#!/usr/bin/env bash
# Where a memcheck "Program hit CUDA_ERROR_INVALID_CONTEXT ... cuCtxGetDevice" comes from: runs
# TESTS (default: the Dask example test, where memcheck_triage.py met one such report on
# 2026-12-06) under memcheck with host backtraces, and keeps each such report with its host frames
# in $OUT/ctx_probe_trace.txt. device_suite.sh drops host frames (they keep Python frames alive),
# so this runs apart from it. Usage (device, repo root): bash benchmarks/ctx_probe_trace.sh
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh" > /dev/null
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
log=$(mktemp)
timeout ${CTX_PROBE_LIMIT:-170} compute-sanitizer --tool memcheck --print-limit 200 \
  --kernel-name kns=twellpy_ --show-backtrace host \
  python -m pytest -q -m gpu ${TESTS:-tests/test_dask.py::test_example_runs_on_gpu} -p no:cacheprovider > "$log" 2>&1
rc=$?
{
  echo "exit $rc; $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1)"
  grep -E 'ERROR SUMMARY' "$log"
  echo "reports by kind:"
  grep -oE 'Program hit [A-Z_]+ .* call to [A-Za-z_0-9]+|Invalid [^ ]+ [a-z]+ of size [0-9]+' "$log" | sort | uniq -c
  echo "--- each cuCtxGetDevice report with its host frames"
  awk '/Program hit .*cuCtxGetDevice/{p=1} p{print} p&&/^========= $/{p=0}' "$log" | cut -c1-220 | head -200
} > "$OUT/ctx_probe_trace.txt"
head -12 "$OUT/ctx_probe_trace.txt"
