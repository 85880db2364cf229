#!/usr/bin/env bash
# Session 35, device call: the training table with the side stream A/B, then Nsight Compute
# counters of the W1-16k inference call's and training step's kernels.
source benchmarks/_device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD > $OUT/commit.txt 2>/dev/null
t0=$SECONDS
python benchmarks/train.py --quick --workloads W1-16k W1-64k W2 --reps 20 > $OUT/train.log 2>&1
echo "train.py exit $? after $((SECONDS - t0)) s"; grep -v '^{' $OUT/train.log | grep -v "phases\|host clock" | tail -16
t1=$SECONDS
timeout 120 python benchmarks/count_pack_probe.py > $OUT/count_pack_probe.log 2>&1
echo "count_pack_probe exit $? after $((SECONDS - t1)) s"; cat $OUT/count_pack_probe.log | tail -20
t1=$SECONDS
timeout ${PROFILE_LIMIT:-200} python benchmarks/profile_kernels.py --set all > $OUT/profile.log 2>&1
echo "profile exit $? after $((SECONDS - t1)) s"; tail -40 $OUT/profile.log
