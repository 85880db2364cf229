"""benchmarks/memcheck_triage.py: which passes a memcheck pass with reports still vouches for."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import memcheck_triage as mt  # noqa: E402

CODE = "# code 0123456789abcdef"
OOM = ('..F..========= Internal Sanitizer Error: The Sanitizer encountered an error while launching '
       "_Z22twellpy_slots_to_denseIfEvPKT_PKiPS0_xii and didn't track the launch.")
INVALID = "========= Invalid __global__ write of size 4 bytes"
PROBE = ('....========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" '
         "on CUDA API call to cuGetProcAddress_v2.")
CONTEXT_PROBE = ('..========= Program hit CUDA_ERROR_INVALID_CONTEXT (error 201) due to "invalid device context" '
                 "on CUDA API call to cuCtxGetDevice.")


def make(tmp_path, log_lines, spans, passed):
    log = tmp_path / "timed.tsv"
    log.write_text("".join(f"{t}\t{line}\n" if t is not None else f"{line}\n" for t, line in log_lines))
    times = tmp_path / "times"
    times.mkdir()
    (times / "times_11.tsv").write_text("".join(f"{n}\t{a}\t{b}\n" for n, (a, b) in spans.items()))
    ledger = tmp_path / "ledger.txt"
    ledger.write_text(CODE + "\n" + "".join(f"ok {n}\t0.10\n" for n in passed))
    return str(log), str(times), str(ledger)


def oks(path):
    p = Path(path)
    return [ln[3:].split("\t")[0] for ln in p.read_text().splitlines() if ln.startswith("ok ")] if p.exists() else []


SPANS = {"t::early": (100.0, 101.0), "t::during": (150.0, 210.0), "t::just_before": (185.0, 190.0),
         "t::late": (400.0, 401.0)}


def test_clean_log_keeps_every_pass(tmp_path):
    log, times, ledger = make(tmp_path, [(100.0, "....."), (150.0, PROBE), (200.0, "....")], SPANS, list(SPANS))
    status, verdict = mt.triage(log, times, ledger)
    assert status == 0, verdict
    assert oks(ledger) == list(SPANS)
    assert "1 numba driver probes" in verdict


def test_cuda_core_context_probe_is_counted_apart(tmp_path):
    # cuda.core's Device() in a fresh process (dask-cuda's worker preload): a handled return code
    lines = [(150.0, PROBE), (160.0, CONTEXT_PROBE), (300.0, "========= ERROR SUMMARY: 2 errors")]
    log, times, ledger = make(tmp_path, lines, SPANS, list(SPANS))
    status, verdict = mt.triage(log, times, ledger)
    assert status == 0, verdict
    assert oks(ledger) == list(SPANS)
    assert "1 cuda.core context probes" in verdict


def test_invalid_context_elsewhere_is_a_report(tmp_path):
    launch = CONTEXT_PROBE.replace("cuCtxGetDevice", "cuLaunchKernel")
    log, times, ledger = make(tmp_path, [(200.0, launch)], SPANS, list(SPANS))
    status, verdict = mt.triage(log, times, ledger, slack=30.0)
    assert status == 1, verdict
    assert oks(ledger + ".rejected") == ["t::during", "t::just_before"]


def test_a_report_after_progress_dots_rejects_the_tests_running_then(tmp_path):
    log, times, ledger = make(tmp_path, [(100.0, "..."), (200.0, OOM), (201.0, INVALID)], SPANS, list(SPANS))
    status, verdict = mt.triage(log, times, ledger, slack=30.0)
    assert status == 1, verdict
    assert oks(ledger) == ["t::early", "t::late"]
    assert oks(ledger + ".rejected") == ["t::during", "t::just_before"]
    assert Path(ledger).read_text().startswith(CODE)  # the header survives: the ledger still counts


@pytest.mark.parametrize("why, log_lines", [
    ("untimed", [(None, INVALID)]),
    ("no test ran", [(300.0, INVALID)]),
    ("summary exceeds printed", [(200.0, INVALID), (402.0, "========= ERROR SUMMARY: 25 errors")]),
])
def test_unplaceable_reports_reject_the_whole_ledger(tmp_path, why, log_lines):
    log, times, ledger = make(tmp_path, log_lines, SPANS, list(SPANS))
    status, verdict = mt.triage(log, times, ledger)
    assert status == 2, (why, verdict)
    assert oks(ledger) == []
    assert oks(ledger + ".rejected") == list(SPANS)


def test_a_pass_without_recorded_times_is_suspect(tmp_path):
    log, times, ledger = make(tmp_path, [(200.0, INVALID)], SPANS, list(SPANS) + ["t::untimed"])
    status, _ = mt.triage(log, times, ledger)
    assert status == 1
    assert "t::untimed" in oks(ledger + ".rejected")


def test_exit_note_is_not_a_finding(tmp_path):
    note = "========= Error: process didn't terminate successfully"
    log, times, ledger = make(tmp_path, [(500.0, note)], SPANS, list(SPANS))
    assert mt.triage(log, times, ledger)[0] == 0


def test_follower_and_cli_end_to_end(tmp_path):
    log = tmp_path / "pass.log"
    tsv = tmp_path / "pass.tsv"
    follower = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "timestamp_lines.py"), str(log), str(tsv)])
    import time

    t0 = time.time()
    with open(log, "w") as f:
        f.write("....")
        f.flush()
        time.sleep(0.5)
        f.write(INVALID + "\n...partial")
        f.flush()
        time.sleep(0.5)
    follower.terminate()
    follower.wait(timeout=10)
    rows = [ln.split("\t", 1) for ln in tsv.read_text().splitlines()]
    assert [r[1] for r in rows] == ["...." + INVALID, "...partial"]
    assert all(t0 <= float(r[0]) <= time.time() for r in rows)
    times = tmp_path / "times"
    times.mkdir()
    (times / "times_1.tsv").write_text(f"t::a\t{t0 - 1:.3f}\t{time.time():.3f}\nt::b\t{t0 - 100:.3f}\t{t0 - 90:.3f}\n")
    ledger = tmp_path / "ledger.txt"
    ledger.write_text(CODE + "\nok t::a\t1.0\nok t::b\t1.0\n")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memcheck_triage.py"), str(tsv), str(times),
                          str(ledger), "--slack", "5"], capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert oks(ledger) == ["t::b"] and oks(str(ledger) + ".rejected") == ["t::a"]


def test_time_budget_splits_worker_time(tmp_path):
    log = tmp_path / "timed.tsv"
    log.write_text("100.0\t[all] pass starts\n160.0\t....\n")
    times = tmp_path / "times"
    times.mkdir()
    (times / "times_1.tsv").write_text("a\t130.0\t131.0\nb\t135.0\t137.0\n")
    (times / "times_2.tsv").write_text("c\t150.0\t160.0\n")
    line = mt.time_budget(str(log), str(times))
    assert line == ("time budget: 2 workers; start-up before the first test 30-50 s; inside tests 13 s, "
                    "between tests 4 s (worker-seconds); 3 tests run")
    assert mt.time_budget(str(log), str(tmp_path / "none")) == "time budget: no test times"


def test_a_test_that_never_finished_counts_as_running(tmp_path):
    # the report comes while only a test killed by the time limit runs: before the started_
    # records this threw the whole ledger away ("reports while no test ran")
    log, times, ledger = make(tmp_path, [(100.0, "..."), (300.0, OOM), (320.0, "[all] exit 124")], SPANS, list(SPANS))
    (Path(times) / "started_11.tsv").write_text("".join(f"{n}\t{a}\n" for n, (a, _) in SPANS.items())
                                                + "t::killed\t290.0\n")
    status, verdict = mt.triage(log, times, ledger)
    assert status == 0 or status == 1, verdict
    assert "whole ledger" not in verdict
    assert oks(ledger) == list(SPANS)  # no finished test ran within 30 s before t = 300
    assert mt.read_unfinished(times) == {"t::killed": 290.0}


def test_where_time_went_names_phases_unfinished_and_running_tests(tmp_path):
    log, times, ledger = make(tmp_path, [(90.0, "[all] pass starts"), (195.0, OOM), (420.0, "[all] exit 124")],
                              SPANS, list(SPANS))
    t = Path(times)
    (t / "started_11.tsv").write_text("".join(f"{n}\t{a}\n" for n, (a, _) in SPANS.items()) + "t::huge\t180.0\n")
    (t / "phases_11.tsv").write_text("imported\t92.0\nconfigured\t95.0\ncollected\t98.0\n")
    (t / "phases_12.tsv").write_text("imported\t93.0\nconfigured\t97.0\ncollected\t99.5\n")
    lines = mt.where_time_went(log, times)
    assert lines[0] == "start-up: processes up +2-3 s, configured +5-7 s, collected +8-10 s, first test +10-10 s"
    assert lines[1] == "never finished: 1 tests (the pass ended at +330 s)"
    assert lines[2] == "  t::huge (started +90 s, ran >= 240 s)"
    assert lines[3] == "running at the first report (+105 s): 2 tests"
    assert lines[4:] == ["  t::during (started +60 s, took 60 s)", "  t::huge (started +90 s, never finished)"]
    assert mt.where_time_went(str(tmp_path / "missing.tsv"), times) == ["start-up: no timed log"]


def test_run_times_plugin_records_phases_starts_and_spans(tmp_path):
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_x.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    times = tmp_path / "times"
    times.mkdir()
    env = dict(__import__("os").environ, TWELLPY_TEST_TIMES=str(times), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.run_times",
                          str(tests)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(mt.read_times(str(times))) == ["t/test_x.py::test_a", "t/test_x.py::test_b"]
    assert mt.read_unfinished(str(times)) == {}
    phases = [ln.split("\t")[0] for f in times.glob("phases_*.tsv") for ln in f.read_text().splitlines()]
    assert phases == ["imported", "configured", "collected"]


# --- benchmarks/memcheck_groups.py: the passes of MEMCHECK_GROUPS=auto ------------------------

def test_memcheck_groups_pack_files_and_split_large_ones(tmp_path):
    from benchmarks import memcheck_groups as mg

    ids = ([f"tests/test_a.py::test_x[{i}]" for i in range(90)] + [f"tests/test_b.py::test_y[{i}]" for i in range(50)]
           + [f"tests/test_c.py::test_z[{i}]" for i in range(30)]
           + [f"tests/test_big.py::test_p[{i}]" for i in range(120)] + [f"tests/test_big.py::test_q[{i}]" for i in range(80)]
           + ["tests/test_examples.py::test_example_runs_on_gpu[01]", "tests/test_dask.py::test_cluster"])
    collected = tmp_path / "collected.txt"
    collected.write_text("\n".join(ids) + "\n\n170/9000 tests collected (8830 deselected) in 5.0s\n")
    with open(collected) as f:
        groups = mg.plan_groups(mg.read_node_ids(f), per_group=150)
    # first fit, largest first: p 120, a 90, q 80, b 50 (joins a), c 30 (joins p)
    assert groups == ["tests/test_big.py::test_p tests/test_c.py", "tests/test_a.py tests/test_b.py",
                      "tests/test_big.py::test_q", "tests/test_examples.py tests/test_dask.py"]
    units = [u for g in groups for u in g.split()]
    assert sorted(units) == sorted(["tests/test_a.py", "tests/test_b.py", "tests/test_c.py", "tests/test_big.py::test_p",
                                    "tests/test_big.py::test_q", "tests/test_examples.py", "tests/test_dask.py"])
    assert groups[-1] == "tests/test_examples.py tests/test_dask.py"  # the subprocess tests run last
    sizes = {"tests/test_a.py": 90, "tests/test_b.py": 50, "tests/test_c.py": 30, "tests/test_big.py::test_p": 120,
             "tests/test_big.py::test_q": 80}
    assert all(sum(sizes[u] for u in g.split()) <= 150 for g in groups[:-1])
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memcheck_groups.py"), str(collected), "150"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == ";".join(groups)


def test_memcheck_groups_refuse_a_collection_that_failed(tmp_path):
    """A test file that fails to import was dropped from the plan without a word, and when
    nothing else was left device_suite.sh reported "nothing left to run at this code hash";
    stderr noise merged into the output ("std::bad_alloc") was taken for a node id."""
    from benchmarks import memcheck_groups as mg

    ok = ["tests/test_a.py::test_x[1]", "tests/test_a.py::test_x[p::q]", "tests/test_b.py::TestK::test_m"]
    noise = ["terminate called after throwing an instance of 'std::bad_alloc'",
             "[W socket.cpp:464] c10::Error while probing", ""]
    assert mg.read_node_ids(ok + noise + ["3 tests collected in 0.1s"]) == ok
    assert mg.plan_groups(mg.read_node_ids(["no tests ran in 0.01s", "no tests collected (5 deselected) in 0.1s"])) == []
    failed = ok + ["", "=== ERRORS ===", "___ ERROR collecting tests/test_bad.py ___", "E   ModuleNotFoundError: x",
                   "=== short test summary info ===", "ERROR tests/test_bad.py",
                   "!!!!! Interrupted: 1 error during collection !!!!!", "3 tests collected, 1 error in 0.89s"]
    assert mg.collection_errors(failed) == ["ERROR tests/test_bad.py"]
    assert mg.collection_errors(ok + ["3 tests collected in 0.1s"]) == []
    collected = tmp_path / "collected.txt"
    collected.write_text("\n".join(failed) + "\n")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memcheck_groups.py"), str(collected)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and run.stdout == "" and "ERROR tests/test_bad.py" in run.stderr
