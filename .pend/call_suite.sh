#!/usr/bin/env bash
# Session 35, device call 1: the whole plain GPU suite at this hash, then memcheck of the
# training tests whose kernels changed in session 34 (wgrad_dh, ell_dx's skip, two passes).
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD > $OUT/commit.txt 2>/dev/null
t0=$SECONDS
bash benchmarks/device_suite.sh tests > $OUT/suite.log 2>&1
echo "suite: $((SECONDS - t0)) s"; tail -4 $OUT/suite.log
t1=$SECONDS
timeout $((${MEMCHECK_BUDGET:-560} - (SECONDS - t0))) compute-sanitizer --tool memcheck --print-limit 20 --kernel-name kns=twellpy_ --show-backtrace device \
  python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gpu_train.py \
  -k "dh_by_neuron or two_pass or row_loops" > $OUT/memcheck.log 2>&1
echo "memcheck exit $? after $((SECONDS - t1)) s"; grep -E "passed|failed|ERROR SUMMARY" $OUT/memcheck.log | sort | uniq -c | tail -5
