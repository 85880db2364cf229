"""The test ledger that makes long device runs (memcheck) resumable (tests/conftest.py)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "tests/test_io.py::test_save_load_roundtrip"


def _pytest(env_extra, *args):
    env = dict(os.environ, **env_extra)
    env.pop("TWELLPY_SHARD", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", TARGET, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_ledger_records_passes_and_a_rerun_skips_them(tmp_path):
    ledger = tmp_path / "ledger_a.txt"
    first = _pytest({"TWELLPY_LEDGER": str(ledger)}, "-k", "cpu")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    lines = ledger.read_text().splitlines()
    assert lines[0].startswith("# code ") and len(lines[0]) == len("# code ") + 16
    passed = [line[3:] for line in lines[1:]]
    assert passed and all(line.startswith("ok ") for line in lines[1:])
    assert all(p.startswith(TARGET) and "cpu" in p for p in passed)
    n_passed = int(first.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert len(passed) == n_passed  # every pass written, nothing else (skips vouch for nothing)

    again = _pytest({"TWELLPY_LEDGER_DONE": str(tmp_path / "ledger_*.txt")}, "-k", "cpu")
    assert again.returncode == 5, again.stdout[-2000:]  # everything deselected: nothing left to run
    assert "passed" not in again.stdout


def test_a_ledger_of_other_code_counts_for_nothing(tmp_path):
    ledger = tmp_path / "ledger_old.txt"
    ledger.write_text("# code 0000000000000000\nok " + TARGET + "[cpu-empty-twell-float32]\n")
    run = _pytest({"TWELLPY_LEDGER_DONE": str(ledger)}, "-k", "cpu-empty-twell-float32")
    assert run.returncode == 0, run.stdout[-2000:]
    assert "1 passed" in run.stdout  # run again: the old ledger vouches for other code
