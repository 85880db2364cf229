#!/usr/bin/env bash
# A short device call for the NaN/Inf ledger of graph replays: its GPU tests, then
# decode_probe.py (checked against unchecked graph calls, back to back, same run).
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
t0=$SECONDS
timeout ${TEST_LIMIT:-150} python -m pytest -q -m gpu -n 16 $XDIST_DIST -p no:cacheprovider tests/test_gpu_ffn_infer.py \
  -k "${LEDGER_K:-graph or deferred or decode_calls or checked_call}" > $OUT/pytest_ledger.log 2>&1
echo "tests exit $? after $((SECONDS - t0)) s"; tail -2 $OUT/pytest_ledger.log; grep -E "^FAILED|Error" $OUT/pytest_ledger.log | head -20
t1=$SECONDS
timeout ${PROBE_LIMIT:-200} python benchmarks/decode_probe.py > $OUT/decode_probe.log 2>&1
echo "decode_probe exit $? after $((SECONDS - t1)) s"; grep -v "^ \+[0-9]\+ \+[0-9.]\+ " $OUT/decode_probe.log | head -60
