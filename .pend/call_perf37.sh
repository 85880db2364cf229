#!/usr/bin/env bash
# Session 37, device call: the thirty-sixth session's host-path changes (count summary, the
# backward's ELL kernel launched before the transpose, the deferred L1 sum): their GPU tests,
# then the training table (with the device's lead over the host at each mark of one step)
# and the count-and-pack probe (its tunings now in alternating rounds).
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
t0=$SECONDS
timeout ${TEST_LIMIT:-150} python -m pytest -q -m gpu -n 16 $XDIST_DIST -p no:cacheprovider tests/test_gpu_train.py \
  -k "side_work or side_stream or transpose or speculative or chunked_batch or l1 or stats" > $OUT/pytest_new.log 2>&1
echo "new tests exit $? after $((SECONDS - t0)) s"; tail -2 $OUT/pytest_new.log; grep -E "^FAILED|Error" $OUT/pytest_new.log | head -20
t1=$SECONDS
timeout ${TRAIN_LIMIT:-220} python benchmarks/train.py --quick --workloads ${WORKLOADS:-W1-16k W1-64k W2} --reps 20 > $OUT/train.log 2>&1
echo "train.py exit $? after $((SECONDS - t1)) s"; grep -v '^{' $OUT/train.log | grep -v "phases\|host clock" | tail -16
t1=$SECONDS
timeout 90 python benchmarks/count_pack_probe.py > $OUT/count_pack_probe.log 2>&1
echo "count_pack_probe exit $? after $((SECONDS - t1)) s"; tail -14 $OUT/count_pack_probe.log
