#!/usr/bin/env bash
# One device call: GPU test suite, sanitizers, and every benchmark.
# Usage on the H200 (from the repo root):  bash benchmarks/device_suite.sh [tests|sanitize|race|memcheck K/N|memcheck-resume|profile|bench|all]
#   memcheck K/N: shard K of N of the whole GPU suite under memcheck (8 xdist workers). Measured
#   2026-12-02: a third of the suite takes > 560 s with every kernel checked and 300-450 s with
#   MEMCHECK_KERNELS=kns=twellpy_ (twellpy's kernels only), so the whole suite needs ~4-5 calls.
#   memcheck-resume: the whole suite, resumable through a ledger of passed tests (see below);
#   MEMCHECK_TESTS (space-separated node ids) narrows a call to those tests (the slowest ones);
#   MEMCHECK_MARK="gpu and gpu_exclusive" with MEMCHECK_WORKERS=1 runs the exclusive-lock tests alone
#   (behind shared-lock tests they can wait for the whole call).
#   repeat the call (copying $OUT's ledger into docs/bench_logs/memcheck_ledger/) until it says
#   nothing is left.
#   Keep 8 workers: 14 made no progress in 570 s (instrumentation does not scale with processes).
# Logs and JSON go to $OUT (or ./device_out); the short tables print last.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"
status=0
if [[ $what == tests || $what == all ]]; then
  gpu_memory_log "$OUT/gpu_memory.csv"; watcher=$!
  python -m pytest -q -m gpu -n ${GPU_WORKERS:-16} $XDIST_DIST tests -p no:cacheprovider --durations=20 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 || status=1
  kill $watcher 2>/dev/null
fi
if [[ $what == memcheck ]]; then
  shard=${2:?usage: device_suite.sh memcheck K/N}
  tag=${shard/\//of}
  # MEMCHECK_KERNELS=kns=twellpy_ checks only twellpy's own kernels (every raw_kernels/ entry point starts
  # with twellpy_); library kernels (cuBLAS, CuPy, torch) then run unpatched, which is what makes a shard fit.
  OUT= TWELLPY_SANITIZE=1 TWELLPY_SHARD=$shard timeout ${SHARD_TIMEOUT:-580} compute-sanitizer --tool memcheck --print-limit 20 \
    ${MEMCHECK_KERNELS:+--kernel-name $MEMCHECK_KERNELS} \
    python -m pytest -q -m gpu -n ${MEMCHECK_WORKERS:-8} tests -p no:cacheprovider --durations=8 > "$OUT/memcheck_$tag.txt" 2>&1
  rc=$?
  echo "memcheck shard $shard exit $rc: $(grep -c 'Invalid' "$OUT/memcheck_$tag.txt") 'Invalid' lines;" \
       "$(grep 'ERROR SUMMARY' "$OUT/memcheck_$tag.txt" | sort | uniq -c | tr '\n' ' ')"
  grep -E '[0-9]+ (passed|failed)' "$OUT/memcheck_$tag.txt" | tail -1
  [[ $rc == 0 || $rc == 5 ]] || status=1  # 5: this shard selected no test
fi
if [[ $what == memcheck-resume ]]; then
  # The whole GPU suite under memcheck, resumable across calls: tests already passed under
  # memcheck at this code hash (ledgers in docs/bench_logs/memcheck_ledger/, copied there from
  # $OUT after each call) are skipped; this call's passes go to a new ledger in $OUT. A ledger
  # from a run that reported any memcheck error is renamed *.rejected and vouches for nothing.
  # positive control first: a planted overrun in a kernel named like ours must be reported
  compute-sanitizer --tool memcheck --kernel-name ${MEMCHECK_KERNELS:-kns=twellpy_} \
    python benchmarks/sanitizer_probe.py > "$OUT/sanitizer_probe.txt" 2>&1
  if ! grep -q 'Invalid __global__ write' "$OUT/sanitizer_probe.txt"; then
    echo "memcheck did NOT report the planted overrun: the tool or the kernel filter checks nothing"
    cat "$OUT/sanitizer_probe.txt"; exit 1
  fi
  echo "positive control: memcheck reported the planted overrun in twellpy_sanitizer_probe<float>"
  ledger="$OUT/memcheck_ledger_$(date +%H%M%S).txt"
  echo "xdist scheduling: ${XDIST_DIST:-load (default)}"
  OUT= TWELLPY_SANITIZE=1 TWELLPY_LEDGER="$ledger" TWELLPY_LEDGER_DONE='docs/bench_logs/memcheck_ledger/*.txt' \
    timeout ${SHARD_TIMEOUT:-560} compute-sanitizer --tool memcheck --print-limit 20 \
    --kernel-name ${MEMCHECK_KERNELS:-kns=twellpy_} \
    python -m pytest -q -m "${MEMCHECK_MARK:-gpu}" -n ${MEMCHECK_WORKERS:-8} $XDIST_DIST ${MEMCHECK_TESTS:-tests} -p no:cacheprovider --durations=25 > "$OUT/memcheck_resume.txt" 2>&1
  rc=$?
  # numba's CUDA driver setup (entered by distributed's cupy deserialiser in the Dask tests) probes
  # driver entry points with cuGetProcAddress and handles INVALID_VALUE; memcheck reports each probe
  # as an API error. Those probes are counted apart; every other report rejects the ledger.
  probes=$(grep -c '^========= Program hit CUDA_ERROR_INVALID_VALUE .* cuGetProcAddress' "$OUT/memcheck_resume.txt")
  errors=$(grep '^========= \(Invalid\|Program hit\|Error\)' "$OUT/memcheck_resume.txt" | grep -vc 'CUDA_ERROR_INVALID_VALUE .* cuGetProcAddress')
  echo "driver entry-point probes reported as API errors (numba, not counted): $probes"
  nonzero=$(grep 'ERROR SUMMARY' "$OUT/memcheck_resume.txt" | grep -vc 'ERROR SUMMARY: 0 errors')
  echo "memcheck-resume exit $rc (124: time limit, resume next call; 5: nothing left): $errors error lines," \
       "$nonzero non-zero ERROR SUMMARY lines; $(grep -c '^ok ' "$ledger" 2>/dev/null || echo 0) tests passed this call"
  grep -E '[0-9]+ (passed|failed|deselected)' "$OUT/memcheck_resume.txt" | tail -1
  grep -E '^(FAILED|ERROR) ' "$OUT/memcheck_resume.txt" | head -20
  if [[ $errors != 0 || $nonzero != 0 ]]; then mv "$ledger" "$ledger.rejected"; status=1; fi
  [[ $rc == 0 || $rc == 5 || $rc == 124 ]] || status=1
fi
if [[ $what == profile ]]; then
  # Nsight Compute counters for the construction, TwELL @ W, cuBLAS, copy and fused-FFN kernels
  python benchmarks/profile_kernels.py 2>&1 | tee "$OUT/profile.txt" | tail -30 || status=1
fi
if [[ $what == sanitize || $what == all ]]; then
  # memcheck on the GPU suite (small cases only: TWELLPY_SANITIZE=1 lets tests shrink sizes)
  TWELLPY_SANITIZE=1 compute-sanitizer --tool memcheck --print-limit 20 \
    python -m pytest -q -m gpu -x tests -k "not slow" -p no:cacheprovider > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?: $(grep -c 'Invalid\|ERROR SUMMARY' "$OUT/memcheck.log") lines; $(grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
fi
if [[ $what == race || $what == sanitize || $what == all ]]; then
  # racecheck (shared-memory hazards), initcheck and synccheck on the construction, transpose and
  # SpMM kernels (the row-block SpMM shares its entry list through shared memory). Measured
  # 2026-12-02: racecheck 37 s, initcheck 5 s for these 356 tests.
  for tool in racecheck initcheck synccheck; do
    TWELLPY_SANITIZE=1 timeout ${RACE_TIMEOUT:-150} compute-sanitizer --tool $tool --print-limit 20 \
      python -m pytest -q -m gpu -x tests/test_gpu_containers.py -p no:cacheprovider \
      -k "construct or transpose or spmm_misaligned or spmm_w1 or row_block" > "$OUT/$tool.log" 2>&1
    rc=$?
    echo "$tool exit $rc: $(grep -E '[0-9]+ passed' "$OUT/$tool.log" | tail -1); $(grep 'SUMMARY' "$OUT/$tool.log" | tail -1)"
    [[ $rc == 0 ]] || status=1
  done
fi
if [[ $what == bench || $what == all ]]; then
  for b in kernels ffn train; do
    [[ -f benchmarks/$b.py ]] && python benchmarks/$b.py > "$OUT/bench_$b.log" 2>&1 || echo "benchmark $b exit $?"
  done
  for b in kernels ffn train; do echo "== $b"; tail -22 "$OUT/bench_$b.log" 2>/dev/null; done
fi
exit $status
