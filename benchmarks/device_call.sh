#!/usr/bin/env bash
# device_call.sh LIMIT_S COMMAND [ARGS...]: run one device call's work so that its results always
# come back, even when the work runs long.
#
# Why: the device returns at most 8 files from $OUT, and nothing at all that a command killed at the
# call's limit had not yet packed. On 2026-12-06 a memcheck call ran into its 600 s limit and lost
# every ledger in $OUT (docs/bench_logs/session27_2026-12-06/README.md).
#
# How: COMMAND writes into a private folder (exported to it as $OUT); every SNAPSHOT_S seconds
# (default 45) and once at the end, that folder goes into the device's $OUT as one tarball,
# results.tgz, replaced atomically. The ledgers the device tree keeps between calls
# (docs/bench_logs/memcheck_ledger/_device_*) go into the tarball too. COMMAND runs under
# `timeout` with LIMIT_S less MARGIN_S (default 40) seconds, so the last snapshot is taken
# before the call's own limit. Pass the device call's limit as LIMIT_S.
#
# Example (device, repo root):
#   bash benchmarks/device_call.sh 600 bash benchmarks/device_suite.sh memcheck-resume
set -uo pipefail
if (( $# < 2 )); then
  echo "usage: $0 LIMIT_S COMMAND [ARGS...]" >&2; exit 2
fi
limit=$1; shift
margin=${MARGIN_S:-40}; every=${SNAPSHOT_S:-45}
(( limit > margin + 10 )) || { echo "LIMIT_S must exceed MARGIN_S ($margin) by 10 s or more" >&2; exit 2; }
dest=${OUT:-./device_out}; mkdir -p "$dest"
work=$(mktemp -d)
ledgers=docs/bench_logs/memcheck_ledger

snapshot() {  # pack the private folder (and the device tree's ledgers) into $dest/results.tgz
  local extra=()
  compgen -G "$ledgers/_device_*" > /dev/null && extra=(-C "$PWD" $(cd "$PWD" && ls $ledgers/_device_*))
  tar czf "$dest/results.tgz.part" -C "$work" . "${extra[@]}" 2>/dev/null \
    && mv -f "$dest/results.tgz.part" "$dest/results.tgz"
}

( while sleep "$every"; do snapshot; done ) & packer=$!
t0=$SECONDS
OUT=$work timeout -k 5 $((limit - margin)) "$@"
rc=$?
kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
snapshot
echo "[device_call] exit $rc after $((SECONDS - t0)) s (124: cut at $((limit - margin)) s);" \
     "results in \$OUT/results.tgz ($(du -h "$dest/results.tgz" 2>/dev/null | cut -f1))"
rm -rf "$work"
exit $rc
