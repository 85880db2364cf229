#!/usr/bin/env bash
# A short device call for the pattern kernels' word test (thirty-seventh session): their GPU
# tests (training and inference, both settings), then count_pack_probe.py (both settings of
# both packs in alternating rounds). For a call with little device time left.
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
t0=$SECONDS
timeout ${TEST_LIMIT:-150} python -m pytest -q -m gpu -n 16 $XDIST_DIST -p no:cacheprovider tests/test_gpu_train.py \
  tests/test_gpu_ffn_infer.py -k "relu_pattern_kernels or rowpack_word_test or speculative_count_pack" > $OUT/pytest_pattern.log 2>&1
echo "tests exit $? after $((SECONDS - t0)) s"; tail -2 $OUT/pytest_pattern.log; grep -E "^FAILED|Error" $OUT/pytest_pattern.log | head -20
t1=$SECONDS
timeout ${PROBE_LIMIT:-120} python benchmarks/count_pack_probe.py --rounds ${ROUNDS:-3} > $OUT/count_pack_probe.log 2>&1
echo "count_pack_probe exit $? after $((SECONDS - t1)) s"; grep -v "^{" $OUT/count_pack_probe.log | tail -24
