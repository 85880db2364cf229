#!/usr/bin/env bash
# A short device call for the cuBLASLt ReLU-mask idea: the mask row pack's GPU test, then
# relu_mask_probe.py (what the epilogue's bits mean; its cost against the plain GEMM and
# the row pack, alternating rounds). The probe runs in its own process: a wrong ctypes
# signature would take only it down.
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
t0=$SECONDS
timeout ${TEST_LIMIT:-100} python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_ffn_infer.py \
  tests/test_gpu_train.py -k "rowpack_word or relu_pattern_kernels" > $OUT/pytest_mask.log 2>&1
echo "tests exit $? after $((SECONDS - t0)) s"; tail -2 $OUT/pytest_mask.log; grep -E "^FAILED|^E " $OUT/pytest_mask.log | head -10
t1=$SECONDS
timeout ${PROBE_LIMIT:-150} python benchmarks/relu_mask_probe.py > $OUT/relu_mask_probe.log 2>&1
echo "relu_mask_probe exit $? after $((SECONDS - t1)) s"; tail -24 $OUT/relu_mask_probe.log
