#!/usr/bin/env bash
# Session 39, call 2: the decode/graph tests with decode_rows = 4, decode_probe again (pending 4),
# memcheck of the side-stream/chunked/gate-chunk bf16+f64 tests and the dh-by-neuron tests (pending 3)
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
t0=$SECONDS
timeout 100 python -m pytest -q -m gpu -n 8 $XDIST_DIST -p no:cacheprovider tests/test_gpu_ffn_infer.py tests/test_gpu_train.py \
  -k "decode or graph or deferred or rowpack_word or relu_pattern_kernels" > $OUT/pytest_decode.log 2>&1
echo "decode tests exit $? after $((SECONDS - t0)) s"; tail -1 $OUT/pytest_decode.log; grep -E "^FAILED|^E " $OUT/pytest_decode.log | head -10
t1=$SECONDS
timeout 60 python benchmarks/decode_probe.py > $OUT/decode_probe.log 2>&1
echo "decode_probe exit $? after $((SECONDS - t1)) s"; grep -E "^ *(1|4|8|16) +(graph checked|checked decode|checked general|hot row|hot row general|torch dense) " $OUT/decode_probe.log
mc() {  # mc NAME LIMIT -k EXPR
  local name=$1 limit=$2; shift 2; local t=$SECONDS
  TWELLPY_SANITIZE=1 timeout $limit compute-sanitizer --tool memcheck --print-limit 20 --kernel-name kns=twellpy_ \
    --show-backtrace device python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_train.py "$@" > $OUT/memcheck_$name.log 2>&1
  echo "memcheck $name exit $? after $((SECONDS - t)) s"; grep -E "passed|failed|ERROR SUMMARY" $OUT/memcheck_$name.log | sort | uniq -c | tail -4
}
mc side 130 -k "((side_stream or chunked or gate_chunks) and (bfloat16 or float64)) and not wide_D"
mc dh $((360 - (SECONDS - t0))) -k "dh_by_neuron and not wide_D"
echo "total $((SECONDS - t0)) s"
