#!/usr/bin/env bash
# One device call: the Dask overhead of issue 8 (W1-64k, one LocalCUDACluster worker) under the FFN
# options and worker settings that decide whether a task synchronises the host, each variant under
# its own time limit; one summary line per variant prints last.
#   default        check_finite=True, mode="auto": two host syncs per task (the check, the density probe)
#   nosync         check_finite=False, mode="sparse": no host sync inside a task, so Dask's bookkeeping
#                  for one task can overlap the GPU work of the one before
#   ptds2          default options, 2 threads per worker on per-thread default streams
#   nosync-ptds2   both
#   switch         default options, the workers' GIL switch interval at 0.1 ms instead of 5 ms (a task
#                  thread waking from a host sync may otherwise wait for the event loop thread's GIL)
# Usage on the H200 (repo root, carry=[".whl"]):  bash benchmarks/dask_variants.sh
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
OUT=${OUT:-./device_out}; mkdir -p "$OUT"; R=$(mktemp -d)  # the device returns at most 8 files: one tarball
common="--workers 1 --reps ${DASK_REPS:-10} --submit eager --direct-keeps-outputs"
declare -A variants=(
  [default]=""
  [nosync]="--no-check-finite --ffn-mode sparse"
  [ptds2]="--threads 2 --ptds"
  [nosync-ptds2]="--no-check-finite --ffn-mode sparse --threads 2 --ptds"
  [switch]="--switch-interval-ms 0.1"
)
order=(default nosync ptds2 nosync-ptds2 switch)  # run and report order (bash maps keep none)
for name in "${order[@]}"; do
  mkdir -p "$R/$name"
  OUT="$R/$name" timeout ${VARIANT_LIMIT:-60} python benchmarks/dask_scaling.py $common ${variants[$name]} \
    > "$R/dask_$name.log" 2>&1
  echo "[$name] exit $?" >> "$R/dask_steps.txt"
done
tar czf "$OUT/dask_variants.tgz" -C "$R" .
cat "$R/dask_steps.txt"
for name in "${order[@]}"; do
  echo "== $name: ${variants[$name]:-(library defaults)}"
  grep -E "^(Dask overhead|streams of)" "$R/dask_$name.log" || tail -3 "$R/dask_$name.log"
done
