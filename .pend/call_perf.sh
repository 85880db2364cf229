#!/usr/bin/env bash
# One device call for the training work: the GPU tests of what changed, the training table
# (`train.py --quick`: each switch in alternating rounds, the device's lead over the host at
# each mark of a step), the count-and-pack probe, then Nsight Compute counters of a W1-16k
# step with whatever time is left (PROFILE=0 skips them).
# TEST_K: the tests' -k selection (default: the thirty-sixth session's host-path changes and the
# thirty-seventh's pattern kernels); MC_K: a selection run under memcheck after them (MC_K= skips);
# INFER_K: inference tests (test_gpu_ffn_infer.py) to run too (INFER_K= skips);
# TEST_LIMIT, TRAIN_LIMIT, CALL_LIMIT (s) and WORKLOADS as below.
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
t0=$SECONDS
timeout ${TEST_LIMIT:-150} python -m pytest -q -m gpu -n 16 $XDIST_DIST -p no:cacheprovider tests/test_gpu_train.py \
  -k "${TEST_K:-side_work or side_stream or transpose or speculative or chunked_batch or l1 or stats or count_pack or relu}" > $OUT/pytest_new.log 2>&1
echo "tests exit $? after $((SECONDS - t0)) s"; tail -2 $OUT/pytest_new.log; grep -E "^FAILED|Error" $OUT/pytest_new.log | head -20
if [[ -n ${INFER_K-rowpack or float64_reference or sigma_03 or token_firing} ]]; then  # INFER_K= skips
  t1=$SECONDS
  timeout ${TEST_LIMIT:-150} python -m pytest -q -m gpu -n 16 $XDIST_DIST -p no:cacheprovider tests/test_gpu_ffn_infer.py \
    -k "${INFER_K-rowpack or float64_reference or sigma_03 or token_firing}" > $OUT/pytest_infer.log 2>&1
  echo "inference tests exit $? after $((SECONDS - t1)) s"; tail -2 $OUT/pytest_infer.log; grep -E "^FAILED|Error" $OUT/pytest_infer.log | head -20
fi
if [[ -n ${MC_K-relu_pattern_kernels} ]]; then  # memcheck (twellpy's kernels) of a small selection; MC_K= skips it
  t1=$SECONDS
  timeout ${MC_LIMIT:-100} compute-sanitizer --tool memcheck --print-limit 20 --kernel-name kns=twellpy_ --show-backtrace device \
    python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gpu_train.py -k "${MC_K-relu_pattern_kernels}" > $OUT/memcheck.log 2>&1
  echo "memcheck exit $? after $((SECONDS - t1)) s"; grep -E "passed|failed|ERROR SUMMARY" $OUT/memcheck.log | sort | uniq -c | tail -5
fi
t1=$SECONDS
timeout ${TRAIN_LIMIT:-220} python benchmarks/train.py --quick --workloads ${WORKLOADS:-W1-16k W1-64k W2} --reps 20 > $OUT/train.log 2>&1
echo "train.py exit $? after $((SECONDS - t1)) s"; grep -v '^{' $OUT/train.log | grep -v "phases\|host clock" | tail -20
t1=$SECONDS
timeout 90 python benchmarks/count_pack_probe.py > $OUT/count_pack_probe.log 2>&1
echo "count_pack_probe exit $? after $((SECONDS - t1)) s"; tail -14 $OUT/count_pack_probe.log
left=$(( ${CALL_LIMIT:-370} - (SECONDS - t0) ))
if [[ ${PROFILE:-1} == 1 ]] && (( left > 60 )); then
  t1=$SECONDS
  timeout $left python benchmarks/profile_kernels.py --set train > $OUT/profile.log 2>&1
  echo "profile exit $? after $((SECONDS - t1)) s"; tail -30 $OUT/profile.log
fi
