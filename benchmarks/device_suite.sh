#!/usr/bin/env bash
# One device call: GPU test suite, sanitizers, and every benchmark.
# Usage on the H200 (from the repo root):  bash benchmarks/device_suite.sh [tests|warm|sanitize|race|memcheck K/N|memcheck-resume|memcheck-finish|profile|bench|all]
#   memcheck K/N: shard K of N of the whole GPU suite under memcheck (8 xdist workers). Measured
#   2026-12-02: a third of the suite takes > 560 s with every kernel checked and 300-450 s with
#   MEMCHECK_KERNELS=kns=twellpy_ (twellpy's kernels only), so the whole suite needs ~4-5 calls.
#   memcheck-finish: memcheck-resume in three passes: short shared-lock tests, exclusive ones alone, long ones.
#   memcheck-resume: the whole suite, resumable through a ledger of passed tests (see below);
#   MEMCHECK_TESTS (space-separated node ids) narrows a call to those tests (the slowest ones);
#   MEMCHECK_GROUPS ("files;files;...", or "auto": benchmarks/memcheck_groups.py packs the tests still
#   to pass) runs one pass per group, with fresh processes each (memcheck does
#   not give cudaFree'd memory back, so one process running many tests runs the GPU out of memory);
#   MEMCHECK_MARK="gpu and gpu_exclusive" with MEMCHECK_WORKERS=1 runs the exclusive-lock tests alone
#   (behind shared-lock tests they can wait for the whole call).
#   repeat the call (copying $OUT's ledger into docs/bench_logs/memcheck_ledger/) until it says
#   nothing is left. SHARD_TIMEOUT (default 560) is the seconds memcheck-resume/finish may use,
#   counted from this script's start, less MEMCHECK_END_MARGIN_S (30) for the last triage; leave the
#   caller's packing of $OUT another ~20 s before the device call's own limit.
#   Workers: 4 by default in memcheck-resume (8 in memcheck K/N and memcheck-finish). Under the
#   sanitizer the workers' start-up grows much faster than their number (H100, 2026-12-06, last
#   worker ready after: 4 workers 17-24 s, 6 workers 66-75 s, 8 workers 130-243 s; 14 made no
#   progress in 570 s), while 4 workers pass about 300 short tests in 60 s.
# Logs and JSON go to $OUT (or ./device_out); the short tables print last.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
OUT=${OUT:-./device_out}; mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"
status=0
if [[ $what == tests || $what == all ]]; then
  # everything this step writes (log, memory log, pool logs, fuzz counts) goes back as one tarball:
  # the device returns at most 8 files, and loose fuzz_counts_*.json files once crowded the log out
  T=$(mktemp -d); mkdir -p "$T/pools"
  gpu_memory_log "$T/gpu_memory.csv"; watcher=$!
  OUT=$T TWELLPY_MEMORY_LOG=$T/pools python -m pytest -q -m gpu -n ${GPU_WORKERS:-16} $XDIST_DIST tests -p no:cacheprovider \
    -p benchmarks.gpu_memory_hygiene --durations=20 2>&1 | tee "$T/gpu_tests.log" | tail -25
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  kill $watcher 2>/dev/null
  tar czf "$OUT/gpu_tests.tgz" -C "$T" .
fi
if [[ $what == warm ]]; then
  # compile every declared kernel instantiation into CuPy's cache and return the cache
  # (see _device_env.sh), so that later fresh machines, and sanitizer workers, skip compiling
  python -m twellpy info --compile 2>&1 | tail -3
  tar czf "$OUT/cupy_cache.tgz" -C "$CUPY_CACHE_DIR" . && ls -l "$OUT/cupy_cache.tgz" | awk '{print "cupy cache:", $5, "bytes"}'
fi
if [[ $what == memcheck ]]; then
  shard=${2:?usage: device_suite.sh memcheck K/N}
  tag=${shard/\//of}
  # MEMCHECK_KERNELS=kns=twellpy_ checks only twellpy's own kernels (every raw_kernels/ entry point starts
  # with twellpy_); library kernels (cuBLAS, CuPy, torch) then run unpatched, which is what makes a shard fit.
  OUT= TWELLPY_SANITIZE=1 TWELLPY_SHARD=$shard timeout ${SHARD_TIMEOUT:-580} compute-sanitizer --tool memcheck --print-limit 20 \
    ${MEMCHECK_KERNELS:+--kernel-name $MEMCHECK_KERNELS} --show-backtrace ${MEMCHECK_BACKTRACE:-device} \
    python -m pytest -q -m gpu -n ${MEMCHECK_WORKERS:-8} tests -p no:cacheprovider --durations=8 > "$OUT/memcheck_$tag.txt" 2>&1
  rc=$?
  echo "memcheck shard $shard exit $rc: $(grep -c 'Invalid' "$OUT/memcheck_$tag.txt") 'Invalid' lines;" \
       "$(grep 'ERROR SUMMARY' "$OUT/memcheck_$tag.txt" | sort | uniq -c | tr '\n' ' ')"
  grep -E '[0-9]+ (passed|failed)' "$OUT/memcheck_$tag.txt" | tail -1
  [[ $rc == 0 || $rc == 5 ]] || status=1  # 5: this shard selected no test
fi
kill_leftovers() {  # kill_leftovers WHEN: pytest workers or sanitizers still alive from a cut pass or call
  # A pass cut by its time limit can leave xdist workers behind on the warm machine; one of them waiting
  # for the exclusive GPU lock holds the writer gate, and every later shared-lock test then waits
  # (suspected in session 13, call 3: two passes, 0 tests in 487 s). List them, then kill them.
  # Every ancestor of this shell is spared: the device runs a call's command line in nested
  # shells, and on 2026-12-06 a command line that itself said "python -m pytest" was matched
  # and killed (twice) when only this shell and its parent were spared.
  local pids ancestors="" p=$BASHPID
  while [[ -n $p && $p != 0 && $p != 1 ]]; do
    ancestors+=" -e $p"
    p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null)
  done
  pids=$(pgrep -f 'python -m pytest|compute-sanitizer|execnet|xdist' | grep -vx $ancestors | tr '\n' ' ')
  echo "[$1] GPU processes: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
  if [[ -n ${pids// } ]]; then
    echo "[$1] killing leftover processes: $(ps -o pid=,etimes=,args= -p $(echo $pids | tr " " ",") 2>/dev/null | cut -c1-120 | tr '\n' ';')"
    kill -9 $pids 2>/dev/null; sleep 2
  fi
}
memcheck_resume_pass() {  # memcheck_resume_pass MARK WORKERS TIMEOUT_S TAG [-k EXPRESSION]
  local mark=$1 workers=$2 limit=$3 tag=$4; shift 4
  (( limit >= 30 )) || limit=30  # timeout 0 would mean no limit at all
  local ledger="$OUT/memcheck_ledger_${tag}_$(date +%H%M%S).txt" log="$OUT/memcheck_resume_$tag.txt"
  local times; times=$(mktemp -d)
  kill_leftovers "$tag, before"
  echo "[$tag] -m \"$mark\", $workers workers, ${limit} s, xdist scheduling: ${XDIST_DIST:-load (default)}"
  # every line of the pass's output gets the time it appeared, and every test its start and stop,
  # so that a sanitizer report rejects only the tests running near it (memcheck_triage.py)
  echo "[$tag] pass starts" > "$log"  # its time stamp is the pass's start (memcheck_triage.py's time budget)
  python3 benchmarks/timestamp_lines.py "$log" "$times/timed.tsv" & local follower=$!
  # each process's GPU memory (gpu_memory_log): on 2026-12-06 (H100) 8 workers hit 149
  # out-of-memory errors in a pass that had run clean the day before; this shows who held it
  gpu_memory_log "$OUT/gpu_memory_$tag.csv"; local smi=$!
  # gpu_memory_hygiene: every worker gives its cached GPU memory back after each test; without it
  # (2026-12-05, H100) idle workers' pools held 10-15 GiB while an exclusive large-shape test ran,
  # and the sanitizer itself then failed to allocate ("Internal Sanitizer Error ... didn't track")
  # MEMCHECK_HYGIENE=0 leaves the plugin out, to tell its part in a pass's memory (2026-12-06,
  # H100: one worker climbed to 47.7 GB with and without it; under TWELLPY_SANITIZE=1 CuPy has
  # no pool to release, see docs/bench_logs/session22_2026-12-06/)
  local hygiene="-p benchmarks.gpu_memory_hygiene"; [[ ${MEMCHECK_HYGIENE:-1} == 0 ]] && hygiene=
  # MEMCHECK_BACKTRACE (default device): compute-sanitizer 2025.3's host backtraces keep the Python
  # frame of every launch and allocation alive, with their locals: on 2026-12-06 (H100) a dropped
  # FFN plan was never finalised under memcheck (13 tests of its finaliser failed) and held its
  # workspaces; with --show-backtrace device the frames go and the plan is freed at its del.
  # Reports still name the kernel and the device frame.
  # MEMCHECK_PRINT_LIMIT: reports printed per process (default 20). The triage rejects a pass whose
  # ERROR SUMMARY counts more errors than were printed; on 2026-12-06 (H100) the examples and Dask
  # tests passed with 118 errors counted and 20 printed, every printed one numba's driver probing
  # (cuGetProcAddress), so those tests need a higher limit for the triage to see all of them
  OUT= TWELLPY_SANITIZE=1 TWELLPY_LEDGER="$ledger" TWELLPY_LEDGER_DONE='docs/bench_logs/memcheck_ledger/*.txt' \
    TWELLPY_TEST_TIMES="$times" timeout $limit compute-sanitizer --tool memcheck --print-limit ${MEMCHECK_PRINT_LIMIT:-20} \
    --kernel-name ${MEMCHECK_KERNELS:-kns=twellpy_} --show-backtrace ${MEMCHECK_BACKTRACE:-device} \
    python -m pytest -q -m "$mark" "$@" -n $workers $XDIST_DIST ${MEMCHECK_TESTS:-tests} -p no:cacheprovider \
    $hygiene -p benchmarks.run_times --durations=25 >> "$log" 2>&1
  local rc=$?
  kill_leftovers "$tag, after"
  kill $follower $smi 2>/dev/null; wait $follower $smi 2>/dev/null
  echo "[$tag] exit $rc (124: time limit, resume next call; 5: nothing left); $(awk '/^ok /{n++} END{print n+0}' "$ledger" 2>/dev/null || echo 0) tests passed"
  grep -E '[0-9]+ (passed|failed|deselected)' "$log" | tail -1
  grep -E '^(FAILED|ERROR)[ -]' "$log" | sort -u | head -30
  local verdict=0
  if [[ -f $ledger ]]; then
    # keeps the passes no sanitizer report came near; moves the others to $ledger.rejected
    python3 benchmarks/memcheck_triage.py "$times/timed.tsv" "$times" "$ledger" | tee -a "$log"
    verdict=${PIPESTATUS[0]}
  elif grep -q '=========.*\(Invalid\|Internal Sanitizer Error\|Program hit\)' "$log"; then
    verdict=2; echo "[$tag] sanitizer reports and no ledger"
  fi
  # every sanitizer report line, kept whole: the log below is cut to its last 400 kB, and on
  # 2026-12-06 that cut lost all 20 reports of a pass behind 149 out-of-memory tracebacks
  grep -E '^=========' "$log" | grep -v 'Host Frame' | head -3000 > "$OUT/memcheck_reports_$tag.txt"
  # the host-side stack frames are most of a sanitizer log and say nothing about device memory
  grep -v 'Host Frame' "$log" | tail -c 400000 > "$log.tmp" && mv "$log.tmp" "$log"
  rm -rf "$times"
  (( verdict == 0 )) || status=1
  if [[ -f $ledger ]] && (( verdict <= 1 )); then
    # later passes of this call, and later calls on the same warm machine, skip what this one passed:
    # _device_* ledgers are git-ignored, so the device's tree keeps them between calls (copy $OUT's
    # ledgers into docs/bench_logs/memcheck_ledger/ too: a fresh machine starts without them)
    cp "$ledger" "docs/bench_logs/memcheck_ledger/_device_$(basename "$ledger")"
  fi
  [[ $rc == 0 || $rc == 5 || $rc == 124 ]] || status=1
}
if [[ $what == memcheck-resume || $what == memcheck-finish ]]; then
  # The whole GPU suite under memcheck, resumable across calls: tests already passed under
  # memcheck at this code hash (ledgers in docs/bench_logs/memcheck_ledger/, copied there from
  # $OUT after each call) are skipped; this call's passes go to a new ledger in $OUT. A ledger
  # from a run that reported any memcheck error is renamed *.rejected and vouches for nothing.
  # every worker's start-up reads the bytecode this one collection writes (see _device_env.sh)
  warm_bytecode -m gpu ${MEMCHECK_TESTS:-tests}
  # positive control first: a planted overrun in a kernel named like ours must be reported
  compute-sanitizer --tool memcheck --kernel-name ${MEMCHECK_KERNELS:-kns=twellpy_} \
    python benchmarks/sanitizer_probe.py > "$OUT/sanitizer_probe.txt" 2>&1
  if ! grep -q 'Invalid __global__ write' "$OUT/sanitizer_probe.txt"; then
    echo "memcheck did NOT report the planted overrun: the tool or the kernel filter checks nothing"
    cat "$OUT/sanitizer_probe.txt"; exit 1
  fi
  # ... and the triage that decides which passes count must see that report too
  if ! python3 -c 'import sys; sys.path.insert(0, "."); from benchmarks.memcheck_triage import REPORT
sys.exit(not any(REPORT.search(line) for line in open(sys.argv[1], errors="replace")))' "$OUT/sanitizer_probe.txt"; then
    echo "memcheck_triage.py does NOT recognise the planted overrun's report"; exit 1
  fi
  echo "positive control: memcheck reported the planted overrun in twellpy_sanitizer_probe<float>"
  resume_workers=${MEMCHECK_WORKERS:-4}  # see "Workers" at the top
  if [[ $what == memcheck-resume && -n ${MEMCHECK_GROUPS:-} ]]; then
    # MEMCHECK_GROUPS="a.py b.py;c.py": one pass per group, each with fresh worker processes, so
    # that what one process accumulates under the sanitizer ends with its group (2026-12-06, H100:
    # one worker reached 47.7 GB and the GPU ran out within 45 s of the first test). Each group
    # gets an equal share of the time still left.
    if [[ $MEMCHECK_GROUPS == auto ]]; then
      # the tests still to pass (ledger filter, sanitizer sizes), packed into groups of whole files
      # of at most MEMCHECK_GROUP_TESTS tests (large files split by test function), subprocess tests last
      collected=$(mktemp)
      TWELLPY_SANITIZE=1 TWELLPY_LEDGER_DONE='docs/bench_logs/memcheck_ledger/*.txt' python -m pytest --collect-only -q \
        -m "${MEMCHECK_MARK:-gpu}" ${MEMCHECK_TESTS:-tests} -p no:cacheprovider > "$collected" 2>&1
      if MEMCHECK_GROUPS=$(python3 benchmarks/memcheck_groups.py "$collected" ${MEMCHECK_GROUP_TESTS:-300}); then
        echo "memcheck groups (auto, $(grep -c '\.py::' "$collected") tests): $MEMCHECK_GROUPS"
        [[ -n $MEMCHECK_GROUPS ]] || echo "memcheck: nothing left to run at this code hash"
      else
        # a file that failed to import is missing from the collection: no plan, and no "nothing left"
        echo "memcheck: the collection failed, no groups planned"; tail -40 "$collected"; MEMCHECK_GROUPS=; status=1
      fi
      rm -f "$collected"
    fi
    # SHARD_TIMEOUT counts from this script's start (bash's SECONDS), not from here: the bytecode
    # warm-up and the positive control take 30-40 s, and a budget counted from here overran a
    # 600 s device call on 2026-12-06 (the call was killed before $OUT was packed, and its
    # ledgers were saved only because the device's tree keeps the _device_ copies).
    # MEMCHECK_END_MARGIN_S is kept free for the last triage and the caller's packing of $OUT.
    end_margin=${MEMCHECK_END_MARGIN_S:-30}
    IFS=';' read -ra groups <<< "$MEMCHECK_GROUPS"; left=${#groups[@]}; g=0
    # MEMCHECK_GROUP_MIN_S: a pass spends a minute or two starting its workers under the sanitizer
    # (2026-12-06, H100: five groups of 111 s, then three of 150 s, all at 8 workers, and not one
    # test started in any; see the worker note at the top), so a group gets at least this long and
    # the groups that no longer fit wait for the next call
    min_s=${MEMCHECK_GROUP_MIN_S:-300}
    for group in "${groups[@]}"; do
      remaining=$(( ${SHARD_TIMEOUT:-560} - SECONDS - end_margin ))
      if (( remaining < min_s && g > 0 )); then
        echo "memcheck: $left group(s) left for the next call (${remaining} s left, a group needs ${min_s} s)"; break
      fi
      share=$(( remaining / left )); (( share < min_s )) && share=$min_s; (( share > remaining )) && share=$remaining
      left=$((left - 1)); g=$((g + 1))
      MEMCHECK_TESTS="$group" memcheck_resume_pass "${MEMCHECK_MARK:-gpu}" $resume_workers $share group$g
    done
  elif [[ $what == memcheck-resume ]]; then
    memcheck_resume_pass "${MEMCHECK_MARK:-gpu}" $resume_workers $(( ${SHARD_TIMEOUT:-560} - SECONDS - ${MEMCHECK_END_MARGIN_S:-30} )) all
  else
    # memcheck-finish: what a plain resume left behind on 2026-12-03 (14 tests passed in 540 s): every
    # worker sat in one of the tests that start subprocesses or many threads (the GPU examples, the
    # Dask cluster tests, the concurrency tests), while the short tests queued behind them waited, and
    # an exclusive large-shape test behind the writer-priority gate held the rest. So, in this order:
    #   short   shared-lock tests without subprocesses or thread pools (8 workers)
    #   exclusive  the exclusive-lock tests, one worker
    #   long    the subprocess / cluster / many-thread tests (8 workers), with whatever time is left
    long_k="test_example_runs_on_gpu or local_cuda_cluster or test_gpu_container_ops_from_many_threads"
    memcheck_resume_pass "gpu and not gpu_exclusive" ${MEMCHECK_WORKERS:-8} ${SHORT_TIMEOUT:-200} short -k "not ($long_k)"
    memcheck_resume_pass "gpu and gpu_exclusive" 1 ${EXCLUSIVE_TIMEOUT:-120} exclusive
    memcheck_resume_pass "gpu and not gpu_exclusive" ${MEMCHECK_WORKERS:-8} $(( ${SHARD_TIMEOUT:-560} - SECONDS - ${MEMCHECK_END_MARGIN_S:-30} )) long -k "$long_k"
  fi
fi
if [[ $what == profile ]]; then
  # Nsight Compute counters for the construction, TwELL @ W, cuBLAS, copy and fused-FFN kernels
  python benchmarks/profile_kernels.py 2>&1 | tee "$OUT/profile.txt" | tail -30 || status=1
fi
if [[ $what == sanitize || $what == all ]]; then
  # memcheck on the GPU suite (small cases only: TWELLPY_SANITIZE=1 lets tests shrink sizes)
  TWELLPY_SANITIZE=1 compute-sanitizer --tool memcheck --print-limit 20 --show-backtrace ${MEMCHECK_BACKTRACE:-device} \
    python -m pytest -q -m gpu -x tests -k "not slow" -p no:cacheprovider > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?: $(grep -c 'Invalid\|ERROR SUMMARY' "$OUT/memcheck.log") lines; $(grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
fi
if [[ $what == race || $what == sanitize || $what == all ]]; then
  # racecheck (shared-memory hazards), initcheck and synccheck on the construction, transpose and
  # SpMM kernels (the row-block SpMM shares its entry list through shared memory). Measured
  # 2026-12-02: racecheck 37 s, initcheck 5 s for these 356 tests. RACE_TESTS / RACE_K choose others.
  for tool in racecheck initcheck synccheck; do
    TWELLPY_SANITIZE=1 timeout ${RACE_TIMEOUT:-150} compute-sanitizer --tool $tool --print-limit 20 \
      python -m pytest -q -m gpu -x ${RACE_TESTS:-tests/test_gpu_containers.py} -p no:cacheprovider \
      -k "${RACE_K:-construct or transpose or spmm_misaligned or spmm_w1 or row_block}" > "$OUT/$tool.log" 2>&1
    rc=$?
    echo "$tool exit $rc: $(grep -E '[0-9]+ passed' "$OUT/$tool.log" | tail -1); $(grep 'SUMMARY' "$OUT/$tool.log" | tail -1)"
    [[ $rc == 0 ]] || status=1
  done
fi
if [[ $what == bench || $what == all ]]; then
  for b in kernels ffn train; do
    [[ -f benchmarks/$b.py ]] && python benchmarks/$b.py > "$OUT/bench_$b.log" 2>&1 || echo "benchmark $b exit $?"
  done
  for b in kernels ffn train; do echo "== $b"; tail -22 "$OUT/bench_$b.log" 2>/dev/null; done
fi
exit $status
