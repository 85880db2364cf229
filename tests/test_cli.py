"""The ``twellpy`` command line: every sub-command, its output and its errors."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import twellpy as tw
from twellpy import cli
from twellpy._array import gpu_available

REPO = Path(__file__).resolve().parent.parent


def run(capsys, *argv):
    """main(argv) in-process; returns (exit status, stdout, stderr)."""
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _sparse_matrix(m=60, n=300, density=0.05, seed=0):
    rng = np.random.default_rng(seed)
    return sp.random_array((m, n), density=density, format="csr", rng=rng, dtype=np.float32)


# ------------------------------------------------------------------ entry points
def test_module_entry_point_and_version():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "twellpy", "--version"], capture_output=True, text=True,
                       env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"twellpy {tw.__version__}"


def test_console_script_is_declared():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["twellpy"] == "twellpy.cli:main"


def test_no_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["info", "demo", "bench", "convert", "stats"])
def test_every_subcommand_has_help(capsys, sub):
    with pytest.raises(SystemExit) as e:
        cli.main([sub, "--help"])
    assert e.value.code == 0
    assert f"usage: twellpy {sub}" in capsys.readouterr().out


# -------------------------------------------------------------------------- info
def test_info_text(capsys):
    rc, out, _ = run(capsys, "info")
    assert rc == 0
    assert f"twellpy {tw.__version__}" in out
    assert "numpy " + np.__version__ in out
    assert "kernels:" in out and "common" not in out.split("kernels:")[1].splitlines()[0]


def test_info_json_lists_every_kernel_source(capsys):
    rc, out, _ = run(capsys, "info", "--json")
    assert rc == 0
    report = json.loads(out)
    k = report["kernels"]
    assert k["sources"] == sorted(p.name for p in (REPO / "raw_kernels").glob("*.cu"))
    assert "common.cuh" in k["headers"]
    assert k["declared_instantiations"] == sum(k["declared_by_file"].values())
    assert report["packages"]["numpy"] == np.__version__
    if gpu_available():
        assert report["gpu"]["devices"], report["gpu"]
        assert all("." in d["compute_capability"] for d in report["gpu"]["devices"])
    else:
        assert report["gpu"]["devices"] == []


@pytest.mark.skipif(gpu_available(), reason="checks the message shown without a GPU")
def test_info_compile_without_gpu_is_a_clear_error(capsys):
    rc, _, err = run(capsys, "info", "--compile")
    assert rc == 2
    assert "needs a usable CUDA GPU" in err and "tools/check_kernels.py" in err


@pytest.mark.gpu
def test_info_compile_on_gpu(capsys):
    rc, out, _ = run(capsys, "info", "--compile", "--json")
    assert rc == 0
    k = json.loads(out)["kernels"]
    assert k["compiled_now"]["kernels"] == k["declared_instantiations"]


# -------------------------------------------------------------------------- demo
SMALL_DEMO = ("--rows", 64, "--cols", 300, "--features", 16, "--nnz", 6, "--repeat", 1)


def test_demo_on_cpu(capsys):
    rc, out, err = run(capsys, "demo", "--device", "cpu", *SMALL_DEMO)
    assert rc == 0, out + err
    assert "demo on cpu" in out
    for fmt in ("TwELL", "ELL", "Hybrid", "CSR (scipy)"):
        assert fmt in out
    assert "twellpy.ffn.GatedFFN" in out and "active neurons per token" in out
    assert "FAIL" not in out
    assert out.strip().splitlines()[-1].startswith("demo OK")


def test_demo_bfloat16_without_ffn(capsys):
    rc, out, err = run(capsys, "demo", "--device", "cpu", "--dtype", "bfloat16", "--skip-ffn", *SMALL_DEMO)
    assert rc == 0, out + err
    assert "dtype bfloat16" in out and "fused FFN skipped" in out


@pytest.mark.parametrize("argv, message", [
    (("--rows", 0), "--rows must be >= 1, got 0"),
    (("--nnz", 500, "--cols", 100), "--nnz (500) cannot exceed --cols (100)"),
    (("--repeat", -1), "--repeat must be >= 1, got -1"),
])
def test_demo_bad_arguments(capsys, argv, message):
    rc, _, err = run(capsys, "demo", "--device", "cpu", *argv)
    assert rc == 2
    assert message in err


def test_demo_unknown_device_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--device", "tpu"])
    assert e.value.code == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


@pytest.mark.skipif(gpu_available(), reason="checks the message shown without a GPU")
def test_demo_cuda_without_gpu(capsys):
    rc, _, err = run(capsys, "demo", "--device", "cuda")
    assert rc == 2
    assert "no usable CUDA GPU" in err


@pytest.mark.gpu
def test_demo_on_gpu(capsys):
    rc, out, err = run(capsys, "demo", "--device", "cuda", *SMALL_DEMO)
    assert rc == 0, out + err
    assert "demo on cuda:" in out and "CSR (cupyx)" in out
    assert out.strip().splitlines()[-1].startswith("demo OK")


# ----------------------------------------------------------------------- convert
def test_convert_scipy_to_every_format_and_back(capsys, tmp_path):
    m = _sparse_matrix()
    src = tmp_path / "m.npz"
    sp.save_npz(src, m)
    for fmt in ("twell", "ell", "hybrid"):
        dst = tmp_path / f"m_{fmt}.npz"
        rc, out, err = run(capsys, "convert", src, dst, "--format", fmt, "--tile", 64, "--slots", 4)
        assert rc == 0, err
        assert "scipy csr" in out and f"wrote   {dst}" in out
        A = tw.load(dst)
        assert A.format == fmt
        np.testing.assert_array_equal(A.toarray(), m.toarray())
        if fmt == "twell":
            assert (A.tile, A.slots) == (64, 4)
        back = tmp_path / f"back_{fmt}.npz"
        rc, out, err = run(capsys, "convert", dst, back, "--format", "csc")
        assert rc == 0, err
        assert f"twellpy {fmt}" in out
        again = sp.load_npz(back)
        assert again.format == "csc"
        np.testing.assert_array_equal(again.toarray(), m.toarray())


def test_convert_dense_npy_with_dtype_and_width(capsys, tmp_path):
    x = _sparse_matrix(seed=1).toarray()
    src = tmp_path / "x.npy"
    np.save(src, x)
    dst = tmp_path / "x.npz"
    rc, out, err = run(capsys, "convert", src, dst, "--format", "hybrid", "--width", "quantile:0.5",
                       "--dtype", "float64")
    assert rc == 0, err
    H = tw.load(dst)
    assert H.format == "hybrid" and H.dtype == np.float64
    np.testing.assert_array_equal(H.toarray(), x)


def test_convert_overflow_raise_reports_library_error(capsys, tmp_path):
    x = np.zeros((4, 64), np.float32)
    x[2, :40] = 1.0  # 40 non-zeros in one tile
    src, dst = tmp_path / "x.npy", tmp_path / "x.npz"
    np.save(src, x)
    rc, _, err = run(capsys, "convert", src, dst, "--format", "twell", "--slots", 8, "--overflow", "raise")
    assert rc == 1
    assert "TileOverflowError" in err and "40" in err
    assert not dst.exists()


@pytest.mark.parametrize("setup, argv_tail, message", [
    ("missing", ("--format", "twell"), "does not exist"),
    ("text", ("--format", "twell"), "is not a readable .npz file"),
    ("foreign", ("--format", "twell"), "neither a twellpy.save file nor a scipy.sparse.save_npz"),
    ("dense3d", ("--format", "ell"), "expected 2-D"),
])
def test_convert_bad_inputs(capsys, tmp_path, setup, argv_tail, message):
    dst = tmp_path / "out.npz"
    if setup == "missing":
        src = tmp_path / "nope.npz"
    elif setup == "text":
        src = tmp_path / "t.npz"
        src.write_text("not a zip file")
    elif setup == "foreign":
        src = tmp_path / "f.npz"
        np.savez(src, a=np.arange(3))
    else:
        src = tmp_path / "d.npy"
        np.save(src, np.zeros((2, 2, 2), np.float32))
    rc, _, err = run(capsys, "convert", src, dst, *argv_tail)
    assert rc == 2
    assert message in err


def test_convert_output_must_be_npz_and_differ_from_input(capsys, tmp_path):
    src = tmp_path / "m.npz"
    sp.save_npz(src, _sparse_matrix())
    rc, _, err = run(capsys, "convert", src, tmp_path / "out.txt", "--format", "ell")
    assert rc == 2 and "must end in .npz" in err
    rc, _, err = run(capsys, "convert", src, src, "--format", "ell")
    assert rc == 2 and "is the input file" in err


def test_convert_requires_format(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")])
    assert e.value.code == 2
    assert "--format" in capsys.readouterr().err


# ------------------------------------------------------------------------- stats
def _acts(shape, seed=0, shift=2.0):
    rng = np.random.default_rng(seed)
    return np.maximum(rng.standard_normal(shape).astype(np.float32) - shift, 0)


def test_stats_json_matches_twellpy_stats(capsys, tmp_path):
    from twellpy import stats

    a = _acts((200, 600))
    src = tmp_path / "a.npy"
    np.save(src, a)
    rc, out, err = run(capsys, "stats", src, "--tile", 128, "--slots", 12, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    (layer,) = rep["layers"]
    nnz = stats.nnz_per_token(a)
    assert layer["nnz_per_token"]["mean"] == pytest.approx(nnz.mean())
    assert layer["nnz_per_token"]["max"] == nnz.max()
    assert layer["dead_neurons"] == int((stats.firing_counts(a) == 0).sum())
    assert layer["max_tile_count"] == stats.tile_occupancy(a, tile=128).max()
    assert layer["suggested_slots"] == stats.suggest_slots(a, tile=128, target_overflow=1e-3)
    assert layer["overflow"]["observed_tile_rate"] == pytest.approx(
        stats.empirical_overflow_rate(a, 12, tile=128, per="tile"))


def test_stats_layers_with_plot(capsys, tmp_path):
    a = np.stack([_acts((100, 300), seed=s, shift=1.5 + 0.3 * s) for s in range(3)])
    src, png = tmp_path / "a.npy", tmp_path / "stats.png"
    np.save(src, a)
    rc, out, err = run(capsys, "stats", src, "--slots", 16, "--plot", png)
    assert rc == 0, err
    table = [ln for ln in out.splitlines() if ln[:1].isdigit()]
    assert [ln.split()[0] for ln in table[:3]] == ["0", "1", "2"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"figure written to {png}" in out


@pytest.mark.parametrize("array, argv_tail, message", [
    (np.zeros(5, np.float32), (), "expected (tokens, neurons)"),
    (np.zeros((3, 4), np.int32), (), "expected a floating dtype"),
    (np.zeros((0, 4), np.float32), (), "no tokens or no neurons"),
    (np.ones((3, 4), np.float32), ("--slots", 0), "--slots must be >= 1"),
    (np.ones((3, 4), np.float32), ("--target", 1.5), "--target must be between 0 and 1"),
    (np.ones((3, 4), np.float32), ("--plot", "x.jpg"), "must end in .png, .pdf or .svg"),
])
def test_stats_bad_inputs(capsys, tmp_path, array, argv_tail, message):
    src = tmp_path / "a.npy"
    np.save(src, array)
    rc, _, err = run(capsys, "stats", src, *argv_tail)
    assert rc == 2
    assert message in err


def test_stats_requires_npy(capsys, tmp_path):
    src = tmp_path / "a.npz"
    np.savez(src, a=np.ones((2, 2)))
    rc, _, err = run(capsys, "stats", src)
    assert rc == 2 and "must be a .npy file" in err


# ------------------------------------------------------------------------- bench
def _fake_benchmarks(folder: Path):
    """Two suites (one writes JSON to $OUT, one fails) and a helper module."""
    folder.mkdir()
    (folder / "workloads.py").write_text("SIZE = 3\n")
    (folder / "alpha.py").write_text(textwrap.dedent('''\
        """Alpha: a suite that passes."""
        # twellpy-bench: suite
        import json, os, sys
        from benchmarks.workloads import SIZE
        if __name__ == "__main__":
            print("working...")
            print("op      time")
            print(f"spmm    {SIZE}.0 ms  args={sys.argv[1:]}")
            with open(os.path.join(os.environ["OUT"], "alpha.json"), "w") as f:
                json.dump({"spmm_ms": float(SIZE)}, f)
        '''))
    (folder / "beta.py").write_text(textwrap.dedent('''\
        """Beta: a suite that fails."""
        # twellpy-bench: suite
        import sys
        if __name__ == "__main__":
            print("beta table")
            print("boom", file=sys.stderr)
            sys.exit(3)
        '''))
    return folder


def test_bench_list_skips_helpers(capsys, tmp_path):
    d = _fake_benchmarks(tmp_path / "benchmarks")
    rc, out, _ = run(capsys, "bench", "--dir", d, "--list")
    assert rc == 0
    names = [ln.split()[0] for ln in out.splitlines()]
    assert names == ["alpha", "beta"]
    assert "Alpha: a suite that passes." in out


def test_bench_tables_and_json(capsys, tmp_path):
    d = _fake_benchmarks(tmp_path / "benchmarks")
    rc, out, err = run(capsys, "bench", "--dir", d, "alpha", "--", "--quick")
    assert rc == 0, err
    assert "=== alpha" in out and "spmm    3.0 ms  args=['--quick']" in out

    keep = tmp_path / "kept"
    rc, out, err = run(capsys, "bench", "--dir", d, "--json", "--out", keep)
    assert rc == 1  # beta failed
    doc = json.loads(out)
    by_name = {s["name"]: s for s in doc["suites"]}
    assert by_name["alpha"]["returncode"] == 0
    assert by_name["alpha"]["out_files"] == {"alpha.json": {"spmm_ms": 3.0}}
    assert by_name["beta"]["returncode"] == 3 and "boom" in by_name["beta"]["stderr_tail"]
    assert doc["failed"] == ["beta"]
    assert json.loads((keep / "alpha" / "alpha.json").read_text()) == {"spmm_ms": 3.0}


def test_bench_from_a_folder_not_named_benchmarks(capsys, tmp_path):
    # as in an installed wheel, where the scripts live in twellpy/_benchmarks
    d = _fake_benchmarks(tmp_path / "benchmarks")
    moved = d.rename(tmp_path / "_benchmarks")
    rc, out, err = run(capsys, "bench", "--dir", moved, "alpha")
    assert rc == 0, out + err
    assert "spmm    3.0 ms" in out


@pytest.mark.skipif(gpu_available(), reason="checks the CPU-only behaviour")
def test_bench_without_gpu_skips_gpu_suites_and_runs_ffn_on_cpu(capsys, tmp_path):
    d = tmp_path / "benchmarks"
    d.mkdir()
    for name, marker in (("kernels", "suite gpu-only"), ("ffn", "suite cpu-args=--cpu")):
        (d / f"{name}.py").write_text(f"# twellpy-bench: {marker}\nimport sys\n"
                                      "if __name__ == '__main__':\n    print('argv', sys.argv[1:])\n")
    rc, out, err = run(capsys, "bench", "--dir", d, "--json", "--", "--reps", "3")
    assert rc == 0, err
    doc = json.loads(out)
    by_name = {s["name"]: s for s in doc["suites"]}
    assert [s["name"] for s in doc["suites"]] == ["ffn", "kernels"]
    assert by_name["kernels"]["skipped"].startswith("needs a CUDA GPU")
    assert "argv ['--cpu', '--reps', '3']" in by_name["ffn"]["stdout"]
    assert doc["failed"] == []


def test_passthrough_only_for_bench(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--", "--x"])
    assert e.value.code == 2
    assert "only accepted by bench" in capsys.readouterr().err


def test_bench_timeout(capsys, tmp_path):
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "slow.py").write_text("# twellpy-bench: suite\nimport time\nif __name__ == '__main__':\n"
                               "    print('start', flush=True)\n    time.sleep(30)\n    print('never')\n")
    rc, out, _ = run(capsys, "bench", "--dir", d, "--timeout", 1)
    assert rc == 1
    assert "timed out" in out and "never" not in out


@pytest.mark.parametrize("argv_tail, message", [
    (("nope",), "unknown suite(s) nope; available: alpha, beta"),
])
def test_bench_unknown_suite(capsys, tmp_path, argv_tail, message):
    d = _fake_benchmarks(tmp_path / "benchmarks")
    rc, _, err = run(capsys, "bench", "--dir", d, *argv_tail)
    assert rc == 2 and message in err


def test_bench_bad_dir(capsys, tmp_path):
    rc, _, err = run(capsys, "bench", "--dir", tmp_path / "missing")
    assert rc == 2 and "is not a folder" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run(capsys, "bench", "--dir", empty)
    assert rc == 2 and "no benchmark scripts" in err


def test_bench_finds_the_repository_suites():
    suites = cli._find_suites(cli._default_bench_dir())
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py")
               if "\n# twellpy-bench: suite" in p.read_text()}
    assert set(suites) == scripts
    assert all(s.path.parent == REPO / "benchmarks" for s in suites.values())
