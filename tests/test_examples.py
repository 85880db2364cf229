"""Run every script of the examples ladder (``examples/0N_*.py``) on the CPU.

Each script checks its own results (assertions against float64 references)
and prints ``0N OK`` last; here they run with ``--small`` so the suite stays
fast. On a GPU machine the ``gpu``-marked variant runs them on the device.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("[0-9][0-9]_*.py"))


def _run(script, tmp_path, *extra):
    env = dict(os.environ, MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    argv = [sys.executable, str(script), "--small", *extra]
    if script.name.startswith("05_"):
        argv += ["--out", str(tmp_path / "figures")]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def test_the_ladder_is_complete():
    numbers = [int(p.name[:2]) for p in EXAMPLES]
    assert numbers == list(range(1, 6)), [p.name for p in EXAMPLES]


def test_readme_has_one_line_per_example():
    text = (REPO / "examples" / "README.md").read_text()
    for script in EXAMPLES:
        lines = [ln for ln in text.splitlines() if ln.startswith(f"- `{script.name}`")]
        assert len(lines) == 1, f"examples/README.md needs exactly one line for {script.name}"
    listed = re.findall(r"`(\d\d_[a-z0-9_]+\.py)`", text)
    assert listed == [p.name for p in EXAMPLES]


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_on_cpu(script, tmp_path):
    r = _run(script, tmp_path, "--device", "cpu")
    assert r.returncode == 0, f"{script.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.strip().splitlines()[-1] == f"{script.name[:2]} OK"
    if script.name.startswith("05_"):
        figures = sorted(p.name for p in (tmp_path / "figures").glob("*.png"))
        assert figures == ["before_after.png", "nnz_histogram.png", "tile_heatmap.png", "tile_occupancy.png"]
        for f in figures:
            assert (tmp_path / "figures" / f).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.gpu
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_on_gpu(script, tmp_path):
    r = _run(script, tmp_path, "--device", "cuda")
    assert r.returncode == 0, f"{script.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.strip().splitlines()[-1] == f"{script.name[:2]} OK"
