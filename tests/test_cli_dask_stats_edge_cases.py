"""Edge cases of the command line, twellpy.dask, twellpy.stats and twellpy.plot
that reviewers found: dtypes kept by ``convert``, argument and file-system
errors, bfloat16 ``.npy`` files, benchmark discovery, Dask argument checks and
``@`` operands, zero-column statistics and one-row heat maps."""
import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import twellpy as tw
from twellpy import cli
from twellpy._array import bfloat16, gpu_available

REPO = Path(__file__).resolve().parent.parent


def run(capsys, *argv):
    """main(argv) in-process; returns (exit status, stdout, stderr)."""
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def usage_error(capsys, *argv):
    """Run argv, expecting argparse to reject it (exit 2); returns stderr."""
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    assert e.value.code == 2
    return capsys.readouterr().err


def _acts(m=40, n=600, density=0.05, seed=0):
    rng = np.random.default_rng(seed)
    return np.where(rng.random((m, n)) < density, rng.random((m, n)) + 0.1, 0).astype(np.float32)


# ----------------------------------------------------------- convert keeps dtypes
@pytest.fixture
def files(tmp_path):
    h = _acts()
    np.save(tmp_path / "h.npy", h)
    sp.save_npz(tmp_path / "s.npz", sp.csr_array(h))
    return tmp_path, h


def test_convert_between_twellpy_formats_keeps_16_bit_dtypes(capsys, files):
    d, h = files
    assert run(capsys, "convert", d / "h.npy", d / "e.npz", "--format", "ell", "--dtype", "bfloat16")[0] == 0
    rc, out, err = run(capsys, "convert", d / "e.npz", d / "t.npz", "--format", "twell")
    assert rc == 0, err
    t = tw.load(d / "t.npz")
    assert t.format == "twell" and t.dtype == bfloat16
    np.testing.assert_array_equal(t.toarray(), h.astype(bfloat16))
    for fmt in ("ell", "hybrid"):
        rc, _, err = run(capsys, "convert", d / "t.npz", d / f"x_{fmt}.npz", "--format", fmt)
        assert rc == 0, err
        assert tw.load(d / f"x_{fmt}.npz").dtype == bfloat16


def test_convert_between_twellpy_formats_honours_dtype(capsys, files):
    d, h = files
    assert run(capsys, "convert", d / "h.npy", d / "t.npz", "--format", "twell")[0] == 0
    rc, _, err = run(capsys, "convert", d / "t.npz", d / "x.npz", "--format", "ell", "--dtype", "float16")
    assert rc == 0, err
    x = tw.load(d / "x.npz")
    assert x.format == "ell" and x.dtype == np.float16
    np.testing.assert_array_equal(x.toarray(), h.astype(np.float16))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_convert_scipy_input_to_16_bit(capsys, files, dtype):
    d, h = files
    rc, _, err = run(capsys, "convert", d / "s.npz", d / "x.npz", "--format", "hybrid", "--dtype", dtype)
    assert rc == 0, err
    x = tw.load(d / "x.npz")
    assert x.dtype == cli._parse_dtype(dtype)
    np.testing.assert_array_equal(x.toarray(), h.astype(x.dtype))


@pytest.mark.parametrize("src", ["h.npy", "s.npz", "t.npz"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_convert_to_scipy_rejects_16_bit_for_every_input(capsys, files, src, dtype):
    d, _ = files
    assert run(capsys, "convert", d / "h.npy", d / "t.npz", "--format", "twell")[0] == 0
    rc, _, err = run(capsys, "convert", d / src, d / "o.npz", "--format", "csr", "--dtype", dtype)
    assert rc == 2
    assert f"--dtype {dtype} cannot be written with scipy.sparse" in err
    assert not (d / "o.npz").exists()


def test_convert_16_bit_dense_input_to_scipy_is_exact_float32(capsys, files):
    d, h = files
    np.save(d / "hb.npy", h.astype(bfloat16))
    rc, _, err = run(capsys, "convert", d / "hb.npy", d / "o.npz", "--format", "csc")
    assert rc == 0, err
    m = sp.load_npz(d / "o.npz")
    assert m.dtype == np.float32
    np.testing.assert_array_equal(m.toarray(), h.astype(bfloat16).astype(np.float32))


def test_convert_warns_about_options_the_format_ignores(capsys, files):
    d, _ = files
    rc, _, err = run(capsys, "convert", d / "h.npy", d / "o.npz", "--format", "twell", "--width", 4)
    assert rc == 0 and "warning: --width does not apply to --format twell; ignored" in err
    rc, _, err = run(capsys, "convert", d / "h.npy", d / "o.npz", "--format", "ell", "--tile", 64, "--slots", 4)
    assert rc == 0 and "warning: --tile, --slots do not apply to --format ell" in err
    rc, _, err = run(capsys, "convert", d / "h.npy", d / "o.npz", "--format", "ell", "--width", "quantile:0.5")
    assert rc == 2 and "ELL takes an integer width" in err


def test_convert_nan_error_names_the_command_line_flag(capsys, files):
    d, h = files
    h = h.copy()
    h[0, 0] = np.nan
    np.save(d / "nan.npy", h)
    rc, _, err = run(capsys, "convert", d / "nan.npy", d / "o.npz", "--format", "ell")
    assert rc == 1 and "--no-check-finite" in err and "check_finite=False" not in err
    assert run(capsys, "convert", d / "nan.npy", d / "o.npz", "--format", "ell", "--no-check-finite")[0] == 0


# ------------------------------------------------------- argument and file errors
@pytest.mark.parametrize("argv_tail, message", [
    (("--format", "twell", "--tile", 0), "argument --tile: must be >= 1, got 0"),
    (("--format", "twell", "--slots", 0), "argument --slots: must be >= 1, got 0"),
    (("--format", "twell", "--slots", "x"), "argument --slots: expected an integer >= 1"),
    (("--format", "ell", "--width", "foo"), "argument --width: width='foo' is not understood"),
    (("--format", "hybrid", "--width", -3), "argument --width: width must be non-negative"),
    (("--format", "hybrid", "--width", "quantile:2"), "argument --width:"),
])
def test_convert_bad_option_values_are_usage_errors(capsys, files, argv_tail, message):
    d, _ = files
    assert message in usage_error(capsys, "convert", d / "h.npy", d / "o.npz", *argv_tail)


@pytest.mark.parametrize("option", ["--tile", "--slots"])
def test_demo_bad_tile_or_slots_fail_before_any_work(capsys, monkeypatch, option):
    # The matrix must not be built: argparse rejects the value first.
    monkeypatch.setattr(cli, "_activation_like", lambda *a, **k: pytest.fail("matrix was built"))
    assert f"argument {option}: must be >= 1, got 0" in usage_error(capsys, "demo", option, 0)


def test_missing_output_folder_is_a_one_line_error(capsys, files):
    d, _ = files
    rc, out, err = run(capsys, "convert", d / "h.npy", d / "nodir" / "o.npz", "--format", "ell")
    assert rc == 2 and "Traceback" not in err
    assert err.strip() == f"twellpy convert: error: output {d / 'nodir' / 'o.npz'}: folder {d / 'nodir'} does not exist"
    assert out == ""  # nothing was read or converted


def test_unwritable_output_is_a_one_line_error(capsys, files, monkeypatch):
    d, _ = files

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied", str(d / "o.npz"))

    monkeypatch.setattr(tw, "save", refuse)
    rc, _, err = run(capsys, "convert", d / "h.npy", d / "o.npz", "--format", "ell")
    assert rc == 1 and "Traceback" not in err
    assert err.strip().startswith("twellpy convert: error: [Errno 13] Permission denied")


@pytest.mark.parametrize("plot, message", [
    ("p.jpg", "must end in .png, .pdf or .svg"),
    ("nodir/p.png", "does not exist"),
])
def test_stats_checks_plot_before_computing(capsys, files, plot, message):
    d, _ = files
    rc, out, err = run(capsys, "stats", d / "h.npy", "--plot", d / plot)
    assert rc == 2 and message in err
    assert out == ""  # no statistics printed before the error


@pytest.mark.parametrize("where", ["before", "after"])
def test_traceback_flag_before_or_after_the_command(capsys, files, where):
    d, _ = files
    argv = ["convert", d / "h.npy", d / "nodir" / "o.npz", "--format", "ell"]
    argv = ["--traceback", *argv] if where == "before" else [*argv, "--traceback"]
    with pytest.raises(cli.CLIError, match="does not exist"):
        cli.main([str(a) for a in argv])


def test_no_traceback_flag_means_false(capsys, files):
    d, _ = files
    args = cli.build_parser().parse_args(["convert", str(d / "h.npy"), "o.npz", "--format", "ell"])
    assert args.traceback is False


# ------------------------------------------------------------ bfloat16 .npy files
def test_stats_reads_bfloat16_saved_with_numpy(capsys, files):
    d, h = files
    np.save(d / "hb.npy", h.astype(bfloat16))
    assert np.load(d / "hb.npy").dtype == np.dtype("V2")  # what numpy gives back
    rc, out, err = run(capsys, "stats", d / "hb.npy", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["dtype"] == "bfloat16"
    assert rep["layers"][0]["nnz_per_token"]["max"] == int(np.count_nonzero(h, axis=1).max())


def test_convert_reads_bfloat16_saved_with_numpy(capsys, files):
    d, h = files
    np.save(d / "hb.npy", h.astype(bfloat16))
    rc, _, err = run(capsys, "convert", d / "hb.npy", d / "o.npz", "--format", "twell")
    assert rc == 0, err
    t = tw.load(d / "o.npz")
    assert t.dtype == bfloat16
    np.testing.assert_array_equal(t.toarray(), h.astype(bfloat16))


def test_structured_two_byte_records_are_not_taken_as_bfloat16(capsys, tmp_path):
    np.save(tmp_path / "r.npy", np.zeros((3, 4), [("a", "u1"), ("b", "u1")]))
    rc, _, err = run(capsys, "stats", tmp_path / "r.npy")
    assert rc == 2 and "expected a floating dtype" in err


# ------------------------------------------------------------------------- bench
#: What benchmarks/ holds, classified by hand: a new script with a __main__
#: guard must be added to one of these (and get a marker if it is a suite).
REPO_SUITES = {"cpu": (False, ()), "dask_scaling": (False, ()), "dask_task_stream": (False, ()),
               "ffn": (False, ("--cpu",)), "multi_gpu": (False, ("--cpu",)), "train": (False, ("--cpu",)),
               "width_drift": (False, ()),
               **{n: (True, ()) for n in ("kernels", "overhead", "step_timeline", "overlap_probe",
                                          "profile_kernels", "decode_probe", "call_profile",
                                          "hot_rows_probe", "row_loops_probe", "backup_route_probe")}}
REPO_TOOLS = {"memcheck_triage", "memcheck_groups", "timestamp_lines", "sanitizer_probe", "sanitizer_sync_probe", "sanitizer_free_probe",
              "racecheck_cublas_probe", "tree_step_time", "dh_by_neuron_probe", "count_pack_probe",
              "run_times", "gpu_memory_hygiene", "workloads"}


def test_bench_lists_only_the_repository_benchmark_suites():
    suites = cli._find_suites(REPO / "benchmarks")
    assert {n: (s.gpu_only, s.cpu_args) for n, s in suites.items()} == REPO_SUITES
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(REPO_SUITES) | REPO_TOOLS, "classify the new script in benchmarks/"


def _script(folder, name, marker, body="print('ran', sys.argv[1:])"):
    head = f"# twellpy-bench: {marker}\n" if marker else ""
    (folder / f"{name}.py").write_text(f'"""{name} docstring."""\n{head}import sys\n'
                                       f"if __name__ == '__main__':\n    {body}\n")


@pytest.mark.skipif(gpu_available(), reason="checks the behaviour without a GPU")
def test_bench_without_arguments_passes_on_a_cpu(capsys, tmp_path):
    d = tmp_path / "benchmarks"
    d.mkdir()
    _script(d, "plain", "suite")
    _script(d, "gpu_probe", "suite gpu-only", body="raise SystemExit('CUDARuntimeError')")
    _script(d, "both", "suite cpu-args=--cpu,--small")
    _script(d, "log_tool", None, body="raise SystemExit('a tool, not a suite')")
    rc, out, err = run(capsys, "bench", "--dir", d, "--json")
    assert rc == 0, out + err
    doc = json.loads(out)
    by_name = {s["name"]: s for s in doc["suites"]}
    assert set(by_name) == {"plain", "gpu_probe", "both"}
    assert by_name["gpu_probe"]["skipped"].startswith("needs a CUDA GPU")
    assert "ran ['--cpu', '--small']" in by_name["both"]["stdout"]
    assert "skipping gpu_probe: GPU only" in err


def test_bench_list_marks_gpu_only_and_cpu_variants(capsys, tmp_path):
    _script(tmp_path, "gpu_probe", "suite gpu-only")
    _script(tmp_path, "both", "suite cpu-args=--cpu")
    _script(tmp_path, "log_tool", None)
    rc, out, _ = run(capsys, "bench", "--dir", tmp_path, "--list")
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("both") and lines[0].endswith("(without a GPU: --cpu)")
    assert lines[1].startswith("gpu_probe") and lines[1].endswith("(GPU only)")


def test_bench_names_a_tool_as_not_a_suite(capsys, tmp_path):
    _script(tmp_path, "plain", "suite")
    _script(tmp_path, "log_tool", None)
    rc, _, err = run(capsys, "bench", "--dir", tmp_path, "log_tool")
    assert rc == 2 and "log_tool.py: no '# twellpy-bench: suite' line" in err


@pytest.mark.parametrize("marker, message", [
    ("suit", "must start with # twellpy-bench: suite"),
    ("suite gpu_only", "unknown word 'gpu_only'"),
    ("suite gpu-only cpu-args=--cpu", "contradict"),
])
def test_bench_rejects_a_malformed_marker(capsys, tmp_path, marker, message):
    _script(tmp_path, "bad", marker)
    rc, _, err = run(capsys, "bench", "--dir", tmp_path, "--list")
    assert rc == 2 and message in err


def test_bench_help_example_runs(capsys):
    epilog = cli.build_parser()._subparsers._group_actions[0].choices["bench"].epilog
    example = epilog.split("e.g. ", 1)[1].split()
    assert example[:2] == ["twellpy", "bench"]
    # the example's suite and arguments, plus a small size so the test is quick
    argv = example[2:] + (["--m", "256", "--warmup", "0", "--threads", "1"] if example[2] == "cpu" else [])
    rc, out, err = run(capsys, "bench", "--dir", REPO / "benchmarks", *argv)
    assert rc == 0, out + err


# ------------------------------------------------------------------ stats, plot
def test_stats_with_zero_neurons():
    from twellpy import stats as st

    z = np.zeros((5, 0), np.float32)
    np.testing.assert_array_equal(st.nnz_per_token(z), np.zeros(5, np.int64))
    np.testing.assert_array_equal(st.nnz_per_token(np.zeros((2, 3, 0), np.float32)), np.zeros(6, np.int64))
    assert st.firing_counts(z).shape == (0,) and st.firing_frequency(z).shape == (0,)
    assert st.tile_occupancy(z, tile=4).shape == (5, 0)
    np.testing.assert_array_equal(st.tile_occupancy_histogram(z, tile=4), np.zeros(5, np.int64))
    assert st.nnz_per_layer([z]).density.tolist() == [0.0]
    with pytest.raises(ValueError, match="acts must hold at least one token and one neuron"):
        st.fit_overflow_model(z, tile=4)
    # containers of zero rows or zero columns too
    np.testing.assert_array_equal(st.nnz_per_token(tw.ELL.from_dense(z)), np.zeros(5, np.int64))
    assert st.nnz_per_token(tw.TwELL.from_dense(np.zeros((0, 3), np.float32), tile=4, slots=2)).shape == (0,)


def test_nnz_per_layer_takes_a_3d_array_like_the_cli():
    from twellpy import stats as st

    a = np.zeros((3, 4, 5), np.float32)
    a[1, :, :2] = 1
    got = st.nnz_per_layer(a)
    ref = st.nnz_per_layer([a[0], a[1], a[2]])
    assert got.names == ["0", "1", "2"]
    np.testing.assert_array_equal(got.mean, ref.mean)
    np.testing.assert_array_equal(got.mean, [0.0, 2.0, 0.0])
    with pytest.raises(ValueError, match="must be 3-D"):
        st.nnz_per_layer(np.zeros((4, 5), np.float32))


def test_token_ranking_does_not_truncate_float_counts():
    from twellpy import stats as st

    most, fewest = st.token_ranking(["a", "b", "a"], np.array([1.5, 2.0, 2.5]), k=2)
    assert most == [("a", 2.0, 2), ("b", 2.0, 1)]
    most, _ = st.token_ranking(["a", "b"], np.array([0.9, 0.2]), k=1)
    assert most == [("a", 0.9, 1)]
    most, _ = st.token_ranking(["a", "b"], np.array([3, 1]), k=1)
    assert most == [("a", 3.0, 1)]


@pytest.mark.parametrize("shape", [(1, 600), (50, 200), (1, 100), (2, 256)])
def test_tile_heatmap_marks_overflow_for_any_shape(shape):
    pytest.importorskip("matplotlib")
    from matplotlib.collections import LineCollection

    from twellpy import plot as tp

    h = (np.random.default_rng(1).random(shape) < 0.3).astype(np.float32)
    fig = tp.tile_heatmap(h, tile=256, slots=2)
    ax = fig.axes[0]
    lines = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(lines) == 1 and len(lines[0].get_segments()) > 0


def test_tile_heatmap_outlines_exactly_the_over_capacity_cells():
    pytest.importorskip("matplotlib")
    from twellpy.plot import _outline_cells

    # one over-capacity cell: a unit square around pixel (row 0, column 1)
    segs = {tuple(map(tuple, s)) for s in _outline_cells(np.array([[False, True]])).get_segments()}
    assert segs == {((0.5, -0.5), (1.5, -0.5)), ((0.5, 0.5), (1.5, 0.5)),
                    ((0.5, -0.5), (0.5, 0.5)), ((1.5, -0.5), (1.5, 0.5))}


@pytest.mark.parametrize("shape", [(1, 600), (40, 200), (3, 1, 300)])
def test_cli_stats_plot_for_one_token_or_one_tile(capsys, tmp_path, shape):
    pytest.importorskip("matplotlib")
    np.save(tmp_path / "a.npy", (np.random.default_rng(2).random(shape) < 0.3).astype(np.float32))
    rc, out, err = run(capsys, "stats", tmp_path / "a.npy", "--slots", 16, "--plot", tmp_path / "q.png")
    assert rc == 0, err
    assert (tmp_path / "q.png").stat().st_size > 10_000


# ------------------------------------------------------------------------ dask
@pytest.fixture
def ffn_inputs():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 8)).astype(np.float32)
    wg, wu = (rng.standard_normal((16, 8)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((8, 16)).astype(np.float32)
    return da.from_array(x, chunks=(10, -1)), wg, wu, wd


@pytest.mark.parametrize("kw, exc", [
    ({"mode": "bogus"}, ValueError), ({"slots": 0}, ValueError), ({"tile": -1}, ValueError),
    ({"slots": 2.5}, ValueError), ({"check_finite": "maybe"}, ValueError), ({"check_finite": None}, TypeError),
])
@pytest.mark.parametrize("kind", ["gated", "relu"])
def test_dask_ffn_checks_keyword_values_in_the_call(ffn_inputs, kw, exc, kind):
    import twellpy.dask as twd

    dx, wg, wu, wd = ffn_inputs
    # the direct API's message, raised by the call itself (no graph returned)
    with pytest.raises(exc) as direct:
        tw.ffn.GatedFFN(wg, wu, wd, **kw)
    with pytest.raises(exc) as lazy:
        if kind == "gated":
            twd.gated_forward(dx, wg, wu, wd, **kw)
        else:
            twd.relu_forward(dx, wu, wd, **kw)
    assert str(lazy.value) == str(direct.value)


def test_dask_ffn_good_keyword_values_still_compute(ffn_inputs):
    import dask

    import twellpy.dask as twd

    dx, wg, wu, wd = ffn_inputs
    y = twd.gated_forward(dx, wg, wu, wd, mode="sparse", slots=4, tile=8, check_finite="sync")
    ref = tw.ffn.GatedFFN(wg, wu, wd, mode="sparse", slots=4, tile=8)(dx.compute())
    with dask.config.set(scheduler="synchronous"):
        np.testing.assert_allclose(y.compute(), ref, rtol=1e-5, atol=1e-5)


@pytest.fixture
def sparse_dask():
    da = pytest.importorskip("dask.array")
    import twellpy.dask as twd

    rng = np.random.default_rng(3)
    h = np.maximum(rng.standard_normal((40, 103)), 0).astype(np.float32)
    return twd.from_dask(da.from_array(h, chunks=(10, -1)), "ell"), h, rng


@pytest.mark.parametrize("chunks", [(100, -1), None])
def test_sparse_dask_matmul_dask_operand_is_a_clear_error(sparse_dask, chunks):
    import dask.array as da

    A, _, rng = sparse_dask
    W = rng.standard_normal((103, 5)).astype(np.float32)
    dW = da.from_array(W, chunks=chunks) if chunks else da.from_array(W)
    with pytest.raises(TypeError, match=r"w is a dask array.*numpy/cupy array or a SharedArray"):
        A @ dW
    with pytest.raises(TypeError, match=r"w is a dask array"):
        A.matmul(dW)
    with pytest.raises(TypeError, match=r"SparseDaskArray @ SparseDaskArray is not supported"):
        A @ A


@pytest.mark.parametrize("left", ["numpy", "dask"])
def test_dense_at_sparse_dask_is_a_clear_error(sparse_dask, left):
    import dask.array as da

    A, _, _ = sparse_dask
    G = np.ones((4, 40), np.float32)
    G = da.from_array(G) if left == "dask" else G
    # raised by the operator: no graph is built that fails at compute time
    with pytest.raises(TypeError, match=r"@ SparseDaskArray is not supported.*A\.compute\(\)"):
        G @ A


def test_sparse_dask_matmul_numpy_still_works(sparse_dask):
    import dask

    A, h, rng = sparse_dask
    W = rng.standard_normal((103, 5)).astype(np.float32)
    with dask.config.set(scheduler="synchronous"):
        np.testing.assert_allclose((A @ W).compute(), h @ W, rtol=1e-5, atol=1e-5)
        # and W @ A on the computed container, as the error message advises
        G = rng.standard_normal((4, 40)).astype(np.float32)
        np.testing.assert_allclose(G @ A.compute(), G @ h, rtol=1e-5, atol=1e-5)


def test_sparse_dask_sum_dtypes_match_the_docstring(sparse_dask):
    import dask

    A, h, _ = sparse_dask
    assert A.sum(axis=1).dtype == np.float32 and A.sum(axis=0).dtype == np.float32
    assert A.sum().dtype == np.float64 and A.mean().dtype == np.float64
    assert "axis=None``:\n            a 0-d float64 array" in type(A).sum.__doc__
    with dask.config.set(scheduler="synchronous"):
        assert float(A.sum().compute()) == pytest.approx(A.compute().sum(), rel=1e-12)
