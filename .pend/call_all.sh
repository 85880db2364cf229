#!/usr/bin/env bash
# Session 35, one device call: the whole plain GPU suite at this hash, then W1-16k's
# training A/B of the new switches and the count-and-pack probe with the time left.
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD > $OUT/commit.txt 2>/dev/null
t0=$SECONDS
SUITE_T=$(mktemp -d)
timeout ${SUITE_LIMIT:-370} python -m pytest -q -m gpu -n 16 $XDIST_DIST tests -p no:cacheprovider --durations=10 \
  > $OUT/suite.log 2>&1
echo "suite exit $? after $((SECONDS - t0)) s"; tail -4 $OUT/suite.log; grep -E "^FAILED|^ERROR" $OUT/suite.log | head -20
left=$(( ${CALL_LIMIT:-555} - (SECONDS - t0) ))
t1=$SECONDS
(( left > 40 )) && timeout $(( left - 35 )) python benchmarks/train.py --quick --workloads W1-16k --reps 15 > $OUT/train.log 2>&1
echo "train.py exit $? after $((SECONDS - t1)) s"; grep -v '^{' $OUT/train.log | grep -v "phases\|host clock" | tail -12
left=$(( ${CALL_LIMIT:-555} - (SECONDS - t0) ))
t1=$SECONDS
(( left > 15 )) && timeout $(( left - 5 )) python benchmarks/count_pack_probe.py --reps 30 > $OUT/count_pack_probe.log 2>&1
echo "probe exit $? after $((SECONDS - t1)) s"; tail -16 $OUT/count_pack_probe.log
