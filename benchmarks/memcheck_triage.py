"""Decide which passed tests a memcheck pass vouches for.

Usage::

    python3 benchmarks/memcheck_triage.py TIMED_LOG TIMES_DIR LEDGER [--slack S]

- ``TIMED_LOG``: the pass's output as written by ``timestamp_lines.py`` (``time\\tline``);
- ``TIMES_DIR``: the files of ``run_times.py`` (``times_*.tsv``: ``node id\\tstart\\tstop``;
  ``started_*.tsv`` and ``phases_*.tsv``, for tests that never finished and start-up phases);
- ``LEDGER``: the pass's ledger (``# code <hash>`` then ``ok <node id>\\t<seconds>`` lines).

Every sanitizer report found anywhere in a line (reports often follow pytest's progress dots
on the same line) is an error event at the time its line appeared. A passed test is suspect
when it was running at most ``S`` seconds (default 30) before some event. The ledger keeps the
other tests; the suspect ones move to ``LEDGER.rejected``. Before this script the whole ledger
was rejected on any report: on 2026-12-05 one out-of-memory cascade late in a call threw away
904 passes.

The whole ledger is still rejected when an error cannot be placed in time: a line without a
timestamp, an ``ERROR SUMMARY`` counting more errors than were printed (``--print-limit``
hides the rest), or a report printed while no test ran.

Exit status: 0 no error, 1 some tests rejected, 2 the whole ledger rejected, 3 bad input.
"""

import argparse
import glob
import os
import re
import sys

# the headers compute-sanitizer prints for a finding, and for its own failures; "Internal
# Sanitizer Error ... didn't track the launch" means a launch went unchecked, so it counts
REPORT = re.compile(
    r"========= (Invalid |Program hit |Error|Internal Sanitizer Error|Uninitialized |Misaligned |"
    r"Out-of-range |Malloc|Free |Leaked |Race |Barrier |Warning|Unused memory|Potential )"
)
# numba's CUDA driver setup (entered by distributed's cupy deserialiser in the Dask tests)
# probes driver entry points and handles CUDA_ERROR_INVALID_VALUE; memcheck reports each probe
PROBE = re.compile(r"Program hit CUDA_ERROR_INVALID_VALUE .*cuGetProcAddress")
# cuda.core's Device() without an id asks cuCtxGetDevice for the current device and, on
# CUDA_ERROR_INVALID_CONTEXT (a fresh process), falls back to device 0 as cudart does; dask-cuda's
# worker preload calls Device().set_current() in every new worker (one report per worker in the
# Dask tests, 2026-12-06, H100). A handled return code, not a memory access
CONTEXT_PROBE = re.compile(r"Program hit CUDA_ERROR_INVALID_CONTEXT .*cuCtxGetDevice")
# the sanitizer's note that the target exited non-zero: pytest's exit status, which the caller reads
EXIT_NOTE = re.compile(r"process didn't terminate successfully|Target application returned an error")
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")


def _stamped(raw):
    """``(time or None, line)`` of one line of a timed log (``time\tline``)."""
    stamp, sep, line = raw.rstrip("\n").partition("\t")
    try:
        return (float(stamp), line) if sep else (None, raw.rstrip("\n"))
    except ValueError:
        return None, raw.rstrip("\n")


def _rows(times_dir, kind, width):
    """``(file, fields)`` of every line with ``width`` tab-separated fields in ``kind_*.tsv``."""
    for name in glob.glob(os.path.join(times_dir, f"{kind}_*.tsv")):
        with open(name) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == width:
                    yield name, parts


def read_events(timed_log):
    """(times of error reports, number of probes, errors counted by ERROR SUMMARY lines, untimed lines,
    number of context probes)."""
    events, probes, summarised, untimed, context_probes = [], 0, 0, 0, 0
    with open(timed_log, errors="replace") as f:
        for raw in f:
            t, line = _stamped(raw)
            for match in REPORT.finditer(line):
                rest = line[match.start():]
                if EXIT_NOTE.search(rest):
                    continue
                if PROBE.search(rest):
                    probes += 1
                elif CONTEXT_PROBE.search(rest):
                    context_probes += 1
                elif t is None:
                    untimed += 1
                else:
                    events.append(t)
            for match in SUMMARY.finditer(line):
                summarised += int(match.group(1))
    return events, probes, summarised, untimed, context_probes


def read_times(times_dir, by="test"):
    """``{node id: [(start, stop), ...]}``, or with ``by="worker"`` ``{file: [...]}``."""
    spans = {}
    for name, (node, start, stop) in _rows(times_dir, "times", 3):
        spans.setdefault(node if by == "test" else name, []).append((float(start), float(stop)))
    return spans


def read_unfinished(times_dir):
    """``{node id: start}`` of the tests that started (``started_*.tsv``) but never finished."""
    started = {}
    for _, (node, start) in _rows(times_dir, "started", 2):
        started.setdefault(node, []).append(float(start))
    finished = {node: len(spans) for node, spans in read_times(times_dir).items()}
    return {node: max(starts) for node, starts in started.items() if len(starts) > finished.get(node, 0)}


def _log_span(timed_log):
    """(first, last) time stamps of the timed log, or (None, None)."""
    first = last = None
    try:
        with open(timed_log, errors="replace") as f:
            for ln in f:
                t = _stamped(ln)[0]
                if t is not None:
                    first = t if first is None else first
                    last = t
    except OSError:
        pass
    return first, last


def where_time_went(timed_log, times_dir, shown=8):
    """Lines on a pass's start-up phases, the tests it never finished and the tests running
    at its first sanitizer report (names the out-of-memory culprit, and the tests that eat a
    call's time under memcheck without ever finishing)."""
    first, last = _log_span(timed_log)
    if first is None:
        return ["start-up: no timed log"]
    lines = []
    phases = {}
    for _, (phase, t) in _rows(times_dir, "phases", 2):
        phases.setdefault(phase, []).append(float(t) - first)
    worker_first = {}  # each worker's first test start (started_ records also cover unfinished tests)
    for name, (_, start) in _rows(times_dir, "started", 2):
        worker_first[name] = min(float(start), worker_first.get(name, float("inf")))
    firsts = [t - first for t in worker_first.values()]
    if not firsts:
        firsts = [min(a for a, _ in spans) - first for spans in read_times(times_dir, by="worker").values()]
    if phases or firsts:
        def rng(v):
            return f"+{min(v):.0f}-{max(v):.0f} s" if v else "-"
        lines.append("start-up: processes up " + rng(phases.get("imported", [])) + ", configured "
                     + rng(phases.get("configured", [])) + ", collected " + rng(phases.get("collected", []))
                     + ", first test " + rng(firsts))
    unfinished = sorted(read_unfinished(times_dir).items(), key=lambda kv: kv[1])
    if unfinished:
        lines.append(f"never finished: {len(unfinished)} tests (the pass ended at +{last - first:.0f} s)")
        lines += [f"  {node} (started +{t - first:.0f} s, ran >= {last - t:.0f} s)" for node, t in unfinished[:shown]]
    events = read_events(timed_log)[0]
    if events:
        t0 = min(events)
        spans = [(node, a, b) for node, ss in read_times(times_dir).items() for a, b in ss]
        spans += [(node, a, float("inf")) for node, a in unfinished]
        running = sorted((a, node, b) for node, a, b in spans if a <= t0 <= b)
        lines.append(f"running at the first report (+{t0 - first:.0f} s): {len(running)} tests")
        lines += [f"  {node} (started +{a - first:.0f} s" + (", never finished)" if b == float("inf")
                                                            else f", took {b - a:.0f} s)")
                  for a, node, b in running[:shown]]
    return lines


def time_budget(timed_log, times_dir):
    """One line on where a pass's time went: per worker process, the start-up before its
    first test, the time inside tests and the gaps between them (from the test times and
    the first timestamped line of the log)."""
    first = _log_span(timed_log)[0]
    workers = []
    for spans in read_times(times_dir, by="worker").values():
        spans.sort()
        busy = sum(b - a for a, b in spans)
        workers.append((spans[0][0], spans[-1][1], busy, len(spans)))
    if not workers or first is None:
        return "time budget: no test times"
    start_up = sorted(w[0] - first for w in workers)
    busy = sum(w[2] for w in workers)
    span = sum(w[1] - w[0] for w in workers)
    return (f"time budget: {len(workers)} workers; start-up before the first test "
            f"{start_up[0]:.0f}-{start_up[-1]:.0f} s; inside tests {busy:.0f} s, between tests "
            f"{span - busy:.0f} s (worker-seconds); {sum(w[3] for w in workers)} tests run")


def triage(timed_log, times_dir, ledger, slack=30.0):
    """Split ``ledger`` in place; return (exit status, one-line verdict)."""
    events, probes, summarised, untimed, context_probes = read_events(timed_log)
    spans = read_times(times_dir)
    with open(ledger) as f:
        lines = f.read().splitlines()
    header = [ln for ln in lines if not ln.startswith("ok ")]
    passed = [ln for ln in lines if ln.startswith("ok ")]
    node_of = {ln: ln[3:].split("\t", 1)[0] for ln in passed}
    note = f"{len(events)} sanitizer reports, {probes} numba driver probes (not counted)"
    if context_probes:
        note += f", {context_probes} cuda.core context probes (not counted)"
    probes += context_probes

    def write(keep, reject):
        with open(ledger, "w") as f:
            f.write("\n".join(header + keep) + "\n")
        if reject:
            with open(ledger + ".rejected", "w") as f:
                f.write("\n".join(header + reject) + "\n")

    whole = None
    if untimed:
        whole = f"{untimed} reports without a time"
    elif summarised > len(events) + probes:
        whole = f"ERROR SUMMARY counts {summarised} errors, {len(events) + probes} were printed"
    elif events and not spans:
        whole = "no test times were recorded"
    else:
        # a test killed by the time limit, or hung, never wrote its span: it ran until the end
        live = dict(spans)
        for node, start in read_unfinished(times_dir).items():
            live.setdefault(node, []).append((start, float("inf")))
        running = [t for t in events
                   if any(start <= t and stop >= t - slack for ss in live.values() for start, stop in ss)]
        if len(running) < len(events):
            whole = f"{len(events) - len(running)} reports while no test ran"
    if whole:
        write([], passed)
        return 2, f"{note}; whole ledger rejected: {whole}"
    if not events:
        return 0, f"{note}; all {len(passed)} passes kept"

    def suspect(node):
        return any(start <= t and stop >= t - slack for start, stop in spans.get(node, [(0.0, float("inf"))])
                   for t in events)

    keep = [ln for ln in passed if not suspect(node_of[ln])]
    reject = [ln for ln in passed if suspect(node_of[ln])]
    write(keep, reject)
    first, last = min(events), max(events)
    return 1, (f"{note}, between t={first:.0f} and t={last:.0f}; {len(keep)} passes kept, "
               f"{len(reject)} rejected (running within {slack:g} s before a report)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timed_log")
    parser.add_argument("times_dir")
    parser.add_argument("ledger")
    parser.add_argument("--slack", type=float, default=30.0)
    args = parser.parse_args(argv)
    if not os.path.isfile(args.timed_log) or not os.path.isfile(args.ledger):
        print(f"memcheck_triage: missing {args.timed_log if not os.path.isfile(args.timed_log) else args.ledger}")
        return 3
    status, verdict = triage(args.timed_log, args.times_dir, args.ledger, args.slack)
    print(f"memcheck triage: {verdict}")
    print(f"memcheck {time_budget(args.timed_log, args.times_dir)}")
    for line in where_time_went(args.timed_log, args.times_dir):
        print(f"memcheck {line}")
    return status


if __name__ == "__main__":
    sys.exit(main())
