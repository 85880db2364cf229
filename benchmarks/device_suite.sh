#!/usr/bin/env bash
# One device call: GPU test suite, sanitizers, and every benchmark.
# Usage on the H200 (from the repo root):  bash benchmarks/device_suite.sh [tests|sanitize|memcheck K/N|bench|all]
#   memcheck K/N: shard K of N of the whole GPU suite under memcheck (8 xdist workers); the whole
#   suite under memcheck takes ~13 minutes on an H200, so run it as 0/3, 1/3, 2/3 (one call each).
#   Keep 8 workers: 14 made no progress in 570 s (instrumentation does not scale with processes).
# Logs and JSON go to $OUT (or ./device_out); the short tables print last.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"
status=0
if [[ $what == tests || $what == all ]]; then
  python -m pytest -q -m gpu -n ${GPU_WORKERS:-16} tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 || status=1
fi
if [[ $what == memcheck ]]; then
  shard=${2:?usage: device_suite.sh memcheck K/N}
  tag=${shard/\//of}
  TWELLPY_SANITIZE=1 TWELLPY_SHARD=$shard compute-sanitizer --tool memcheck --print-limit 20 \
    python -m pytest -q -m gpu -n ${MEMCHECK_WORKERS:-8} tests -p no:cacheprovider > "$OUT/memcheck_$tag.log" 2>&1
  rc=$?
  echo "memcheck shard $shard exit $rc: $(grep -c 'Invalid' "$OUT/memcheck_$tag.log") 'Invalid' lines;" \
       "$(grep 'ERROR SUMMARY' "$OUT/memcheck_$tag.log" | sort | uniq -c | tr '\n' ' ')"
  grep -E '[0-9]+ (passed|failed)' "$OUT/memcheck_$tag.log" | tail -1
  [[ $rc == 0 || $rc == 5 ]] || status=1  # 5: this shard selected no test
fi
if [[ $what == sanitize || $what == all ]]; then
  # memcheck on the GPU suite (small cases only: TWELLPY_SANITIZE=1 lets tests shrink sizes)
  TWELLPY_SANITIZE=1 compute-sanitizer --tool memcheck --print-limit 20 \
    python -m pytest -q -m gpu -x tests -k "not slow" -p no:cacheprovider > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?: $(grep -c 'Invalid\|ERROR SUMMARY' "$OUT/memcheck.log") lines; $(grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
  for tool in racecheck initcheck synccheck; do
    TWELLPY_SANITIZE=1 compute-sanitizer --tool $tool --print-limit 20 \
      python -m pytest -q -m gpu -x tests/test_gpu_containers.py -k "construct or transpose or spmm_misaligned or spmm_w1" -p no:cacheprovider > "$OUT/$tool.log" 2>&1
    echo "$tool exit $?: $(grep 'ERROR SUMMARY' "$OUT/$tool.log" | tail -1)"
  done
fi
if [[ $what == bench || $what == all ]]; then
  for b in kernels ffn train; do
    [[ -f benchmarks/$b.py ]] && python benchmarks/$b.py > "$OUT/bench_$b.log" 2>&1 || echo "benchmark $b exit $?"
  done
  for b in kernels ffn train; do echo "== $b"; tail -22 "$OUT/bench_$b.log" 2>/dev/null; done
fi
exit $status
