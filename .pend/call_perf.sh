#!/usr/bin/env bash
# Session 35, device call: the new code's GPU tests, the training table with the side
# stream / gate chunks / chunked speculation A/B, the count-and-pack probe, then Nsight
# Compute counters with whatever time is left.
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD > $OUT/commit.txt 2>/dev/null
t0=$SECONDS
timeout ${TEST_LIMIT:-150} python -m pytest -q -m gpu -n 16 $XDIST_DIST -p no:cacheprovider tests/test_gpu_train.py \
  -k "side_stream or transpose_copy or gate_chunks or chunked_batch or count_pack or speculative" > $OUT/pytest_new.log 2>&1
echo "new tests exit $? after $((SECONDS - t0)) s"; tail -3 $OUT/pytest_new.log; grep -E "^FAILED|Error" $OUT/pytest_new.log | head -20
t1=$SECONDS
timeout ${TRAIN_LIMIT:-220} python benchmarks/train.py --quick --workloads ${WORKLOADS:-W1-16k W1-64k W2} --reps 20 > $OUT/train.log 2>&1
echo "train.py exit $? after $((SECONDS - t1)) s"; grep -v '^{' $OUT/train.log | grep -v "phases\|host clock" | tail -16
t1=$SECONDS
timeout 90 python benchmarks/count_pack_probe.py > $OUT/count_pack_probe.log 2>&1
echo "count_pack_probe exit $? after $((SECONDS - t1)) s"; cat $OUT/count_pack_probe.log | tail -20
left=$(( ${CALL_LIMIT:-540} - (SECONDS - t0) ))
if (( left > 60 )); then
  t1=$SECONDS
  timeout $left python benchmarks/profile_kernels.py --set train > $OUT/profile.log 2>&1
  echo "profile exit $? after $((SECONDS - t1)) s"; tail -30 $OUT/profile.log
fi
