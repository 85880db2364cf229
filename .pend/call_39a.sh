#!/usr/bin/env bash
# Session 39, call 1: the mask probe (pending 5), decode_probe (pending 4), the freed-warning diagnosis (pending 2)
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
t0=$SECONDS
TEST_LIMIT=100 PROBE_LIMIT=170 bash .pend/call_mask.sh
t1=$SECONDS
timeout 150 python benchmarks/decode_probe.py > $OUT/decode_probe.log 2>&1
echo "decode_probe exit $? after $((SECONDS - t1)) s"; grep -v "^ " $OUT/decode_probe.log | tail -40
t2=$SECONDS
python .pend/diag_freed.py > $OUT/diag_plain.log 2>&1; echo "diag plain exit $?"; cat $OUT/diag_plain.log | tail -12
TWELLPY_SANITIZE=1 timeout 120 compute-sanitizer --tool memcheck --kernel-name kns=twellpy_ python .pend/diag_freed.py > $OUT/diag_sanitize.log 2>&1
echo "diag sanitize exit $? after $((SECONDS - t2)) s"; tail -16 $OUT/diag_sanitize.log
echo "total $((SECONDS - t0)) s"
