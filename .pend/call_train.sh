#!/usr/bin/env bash
# Session 35, a short device call: every GPU test of the training code (the only code
# this session and the last changed), then W1-16k's A/B of the new switches.
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD > $OUT/commit.txt 2>/dev/null
t0=$SECONDS
timeout ${TEST_LIMIT:-230} python -m pytest -q -m gpu -n 16 $XDIST_DIST -p no:cacheprovider --durations=5 \
  tests/test_gpu_train.py tests/test_concurrency.py tests/test_determinism.py tests/test_interop.py > $OUT/pytest_train.log 2>&1
echo "tests exit $? after $((SECONDS - t0)) s"; tail -3 $OUT/pytest_train.log; grep -E "^FAILED|^ERROR" $OUT/pytest_train.log | head -20
left=$(( ${CALL_LIMIT:-400} - (SECONDS - t0) ))
t1=$SECONDS
(( left > 40 )) && timeout $(( left - 10 )) python benchmarks/train.py --quick --workloads W1-16k --reps 15 > $OUT/train.log 2>&1
echo "train.py exit $? after $((SECONDS - t1)) s"; grep -v '^{' $OUT/train.log | grep -v "phases\|host clock" | tail -12
