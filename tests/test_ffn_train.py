"""CPU tests of the sparse FFN training step against a float64 dense reference."""
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from twellpy import _ffn_train as T
from twellpy._array import bfloat16

from _train_ref import dense_gated, dense_relu, f64, make_problem, step_outputs

TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5, bfloat16: 1e-2,
       np.dtype(np.float16): 1e-2}


def rel(got, ref):
    got, ref = f64(got), f64(ref)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / den) if den else float(np.linalg.norm(got))


CASES = {
    "uniform": dict(M=96, D=40, H=256, nnz=12),
    "uneven": dict(M=80, D=40, H=256, nnz=12, sigma=0.6),
    "hot2000": dict(M=48, D=24, H=2304, nnz=10, hot=(5, 2000)),
    "empty_rows": dict(M=40, D=24, H=128, nnz=6, empty=(0, 7, 39)),
    "M1": dict(M=1, D=24, H=128, nnz=10),
}


def _cast(arrs, dt):
    return [a.astype(dt) for a in arrs]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64), bfloat16, np.dtype(np.float16)],
                         ids=str)
@pytest.mark.parametrize("width", ["auto", 3, "min_storage", "quantile:0.5"])
def test_gated_matches_dense(case, dtype, width):
    x, wg, wu, wd, dy = _cast(make_problem(**CASES[case], seed=1), dtype)
    l1 = 0.05
    y, ctx = T.gated_forward_train(x, wg, wu, wd, l1=l1, width=width)
    dx, dwg, dwu, dwd = T.gated_backward(ctx, dy)
    ref = dense_gated(x, wg, wu, wd, dy, l1)
    tol = TOL[dtype]
    for name, got in (("y", y), ("dx", dx), ("dw_gate", dwg), ("dw_up", dwu), ("dw_down", dwd)):
        assert got.dtype == dtype, name
        assert got.shape == ref[name].shape, name
        assert rel(got, ref[name]) <= tol, (name, rel(got, ref[name]))
    st = ctx.stats
    if dtype != bfloat16:  # bf16 rounding of z may move a borderline neuron
        np.testing.assert_array_equal(f64(st["token_counts"]), ref["token_counts"])
        np.testing.assert_array_equal(f64(st["neuron_counts"]), ref["neuron_counts"])
        assert st["l0"] == pytest.approx(ref["token_counts"].mean())
    assert st["l1"] == pytest.approx(ref["l1"], rel=max(tol, 1e-9))
    assert st["n_backup_rows"] == int((f64(st["token_counts"]) > st["width"]).sum())
    assert st["deterministic"] is True


def test_hot_token_goes_to_backup_and_nothing_is_dropped():
    x, wg, wu, wd, dy = make_problem(**CASES["hot2000"], seed=3)
    y, ctx = T.gated_forward_train(x, wg, wu, wd, width="auto")
    assert int(ctx.stats["token_counts"][5]) >= 2000
    assert 5 in set(ctx.backup_rows.tolist())
    assert ctx.stats["width"] < 2000
    ref = dense_gated(x, wg, wu, wd, dy, 0.0)
    assert rel(y, ref["y"]) < 1e-10


def test_fixed_width_sends_every_wide_row_to_backup():
    x, wg, wu, wd, dy = make_problem(**CASES["uneven"], seed=4)
    y, ctx = T.gated_forward_train(x, wg, wu, wd, width="fixed:2")
    counts = f64(ctx.stats["token_counts"])
    assert ctx.width == 2
    np.testing.assert_array_equal(ctx.backup_rows, np.flatnonzero(counts > 2))
    grads = T.gated_backward(ctx, dy)
    ref = dense_gated(x, wg, wu, wd, dy, 0.0)
    for got, name in zip(grads, ("dx", "dw_gate", "dw_up", "dw_down")):
        assert rel(got, ref[name]) < 1e-10, name


@pytest.mark.parametrize("case", ["uniform", "uneven", "hot2000", "empty_rows", "M1"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64), bfloat16, np.dtype(np.float16)],
                         ids=str)
def test_relu_matches_dense(case, dtype):
    x, wu, wd, dy = _cast(make_problem(**CASES[case], seed=2, gated=False), dtype)
    l1 = 0.1
    y, ctx = T.relu_forward_train(x, wu, wd, l1=l1)
    dx, dwu, dwd = T.relu_backward(ctx, dy)
    ref = dense_relu(x, wu, wd, dy, l1)
    for name, got in (("y", y), ("dx", dx), ("dw_up", dwu), ("dw_down", dwd)):
        assert got.dtype == dtype
        assert rel(got, ref[name]) <= TOL[dtype], (name, rel(got, ref[name]))
    assert ctx.stats["l1"] == pytest.approx(ref["l1"], rel=max(TOL[dtype], 1e-9))


def test_ctx_keeps_no_dense_hidden_array():
    M, D, H = 64, 16, 512
    x, wg, wu, wd, dy = make_problem(M, D, H, 8, seed=5)
    _, ctx = T.gated_forward_train(x, wg, wu, wd)
    for k, v in vars(ctx).items():
        if isinstance(v, np.ndarray):
            assert v.size < M * H, (k, v.shape)
    for k, v in ctx.stats.items():
        if isinstance(v, np.ndarray):
            assert v.size < M * H, (k, v.shape)


def test_ctx_hybrids_hold_the_activations():
    x, wg, wu, wd, dy = make_problem(**CASES["uneven"], seed=6)
    _, ctx = T.gated_forward_train(x, wg, wu, wd, width=3)
    z = x @ wg.T
    g = np.maximum(z, 0)
    u = x @ wu.T
    np.testing.assert_allclose(ctx.g.toarray(), g, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ctx.u.toarray(), u * (z > 0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ctx.h.toarray(), g * u, rtol=1e-12, atol=1e-12)
    assert ctx.g.format == "hybrid" and ctx.g.n_backup == ctx.R


def test_deterministic_bits():
    x, wg, wu, wd, dy = _cast(make_problem(**CASES["uneven"], seed=7), np.float32)
    outs = []
    for _ in range(2):
        y, ctx = T.gated_forward_train(x, wg, wu, wd, l1=0.01, deterministic=True)
        outs.append((y,) + T.gated_backward(ctx, dy))
    for a, b in zip(*outs):
        assert a.tobytes() == b.tobytes()


def test_l1_gradient_is_injected_on_the_pattern_only():
    x, wg, wu, wd, dy = make_problem(**CASES["uniform"], seed=8)
    _, c0 = T.gated_forward_train(x, wg, wu, wd, l1=0.0)
    _, c1 = T.gated_forward_train(x, wg, wu, wd, l1=3.0)
    g0 = T.gated_backward(c0, dy)
    g1 = T.gated_backward(c1, dy)
    M = x.shape[0]
    z = x @ wg.T
    pat = z > 0
    h = np.where(pat, z, 0) * (x @ wu.T)
    extra = (3.0 / M) * np.sign(h) * pat
    np.testing.assert_allclose(g1[2] - g0[2], (extra * np.maximum(z, 0)).T @ x, atol=1e-10)


def test_facade_exports_training_functions():
    import twellpy.ffn as ffn

    for name in T.__all__:
        assert getattr(ffn, name) is getattr(T, name)


def test_bad_inputs():
    x, wg, wu, wd, dy = make_problem(8, 6, 16, 4, seed=9)
    with pytest.raises(ValueError, match="w_up has shape"):
        T.gated_forward_train(x, wg, wu[:, :5], wd)
    with pytest.raises(ValueError, match="w_down has shape"):
        T.gated_forward_train(x, wg, wu, wd.T)
    with pytest.raises(TypeError, match="w_gate has dtype float32"):
        T.gated_forward_train(x, wg.astype(np.float32), wu, wd)
    with pytest.raises(TypeError, match="x has dtype int64"):
        T.gated_forward_train(x.astype(np.int64), wg, wu, wd)
    with pytest.raises(ValueError, match="x must be 2-D"):
        T.gated_forward_train(x[0], wg, wu, wd)
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        T.gated_forward_train(bad, wg, wu, wd)
    with pytest.raises(ValueError, match="l1 must be a finite number >= 0"):
        T.gated_forward_train(x, wg, wu, wd, l1=-1.0)
    with pytest.raises(ValueError, match="unknown width strategy"):
        T.gated_forward_train(x, wg, wu, wd, width="widest")
    _, ctx = T.gated_forward_train(x, wg, wu, wd)
    with pytest.raises(ValueError, match="dy has shape"):
        T.gated_backward(ctx, dy[:3])
    with pytest.raises(TypeError, match="dy has dtype float32"):
        T.gated_backward(ctx, dy.astype(np.float32))
    with pytest.raises(ValueError, match="ctx comes from the gated forward"):
        T.relu_backward(ctx, dy)
    with pytest.raises(TypeError, match="ctx must be the TrainContext"):
        T.gated_backward({}, dy)


def test_choose_width_strategies():
    counts = np.array([1, 2, 3, 4, 100])
    assert T.choose_width(counts, 7) == 7
    assert T.choose_width(counts, "fixed:5") == 5
    assert T.choose_width(counts, "quantile:0.5") == 3
    assert T.choose_width(counts, "quantile:1") == 100
    # one 100-wide row is cheaper as a backup row than as 96 extra slots per row
    assert T.choose_width(counts, "min_storage", slot_bytes=8, row_bytes=8 * 128) == 4
    # q0.9 floor (100), on auto's grid (steps of 32 from 64 to 128)
    assert T.choose_width(counts, "auto", slot_bytes=8, row_bytes=8 * 128) == 128
    assert T.choose_width(counts, "auto", n_cols=104) == 104   # never past the row length
    assert T.choose_width(np.zeros(0, int), "auto", slot_bytes=8, row_bytes=8) == 1
    with pytest.raises(ValueError, match="quantile p must be in"):
        T.choose_width(counts, "quantile:2")
    with pytest.raises(TypeError, match="width must be an int"):
        T.choose_width(counts, 2.5)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 300), max_size=200),
       spec=st.sampled_from(["auto", "min_storage", "quantile:0", "quantile:0.37", "quantile:0.9", "quantile:1",
                             "fixed:5", 3]),
       n_cols=st.integers(1, 400), w=st.integers(0, 400))
@example(counts=[1, 2], spec="fixed:5", n_cols=3, w=0)
@example(counts=[], spec="auto", n_cols=8, w=3)
def test_count_summary_gives_the_counts_answers(counts, spec, n_cols, w):
    """The step's host summary of its token counts (one histogram) gives the width,
    the wide rows, the ELL entries and the total that the counts themselves give."""
    counts = np.array(counts, dtype=np.int32)
    summary = T._CountSummary(counts)
    sizes = dict(slot_bytes=8, n_cols=n_cols)
    M = counts.size

    def quantile(p):  # the sorted counts' entry at rank ceil(p M) - 1
        return int(np.sort(counts)[min(max(math.ceil(p * M) - 1, 0), M - 1)]) if M else 0

    def min_storage():  # the first width of least slot-plus-backup-row bytes, by brute force
        cost = [M * v * 8 + int(np.count_nonzero(counts > v)) * 8 * n_cols for v in range(int(counts.max()) + 1)]
        return int(np.argmin(cost))

    if spec == "auto":
        want = 1 if M == 0 else T._stable_width(max(min_storage(), quantile(0.9), 1), n_cols)
    elif spec == "min_storage":
        want = 1 if M == 0 else max(min_storage(), 1)
    elif isinstance(spec, str) and spec.startswith("quantile:"):
        want = max(quantile(float(spec.split(":")[1])), 1)
    else:  # fixed widths, capped at the row length
        want = min(int(str(spec).split(":")[-1]), n_cols)
    assert T.choose_width(summary, spec, **sizes) == T.choose_width(counts, spec, **sizes) == want
    assert summary.wider(w) == int(np.count_nonzero(counts > w))
    assert summary.entries_upto(w) == int(counts[counts <= w].sum(dtype=np.int64))
    assert summary.total == int(counts.sum(dtype=np.int64)) and summary.size == counts.size
    lay, want = T._next_layout(summary, spec, **sizes, row_bytes=8 * n_cols), T._next_layout(
        counts, spec, **sizes, row_bytes=8 * n_cols)
    assert lay == want


def test_small_training_loop_reduces_loss():
    """A few SGD steps of a ReLU-FFN regression lower the loss (the example's use case)."""
    rng = np.random.default_rng(10)
    M, D, H = 512, 32, 128
    x = rng.standard_normal((M, D)).astype(np.float32)
    target = np.tanh(x @ rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
    wg = (rng.standard_normal((H, D)) / np.sqrt(D)).astype(np.float32)
    wu = (rng.standard_normal((H, D)) / np.sqrt(D)).astype(np.float32)
    wd = (rng.standard_normal((D, H)) / np.sqrt(H)).astype(np.float32)
    losses = []
    for _ in range(15):
        y, ctx = T.gated_forward_train(x, wg, wu, wd, l1=1e-3)
        err = y - target
        losses.append(float((err ** 2).mean()))
        _, dwg, dwu, dwd = T.gated_backward(ctx, (2.0 / err.size) * err)
        wg -= 0.5 * dwg
        wu -= 0.5 * dwu
        wd -= 0.5 * dwd
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("case", ["uneven", "hot2000", "empty_rows"])
def test_direct_pack_matches_the_csr_path(monkeypatch, case, gated):
    """The one-chunk forward packs relu(z) straight into the Hybrid; the chunked one goes through
    a CSR. On the same gate output both must give the same bits everywhere (values, pattern,
    counts, gradients), and row chunks must still match the dense reference."""
    spec = dict(CASES[case], M=600)  # 600 rows: three 256-row chunks when the budget is tiny
    if case == "empty_rows":
        spec["empty"] = (0, 7, 599)
    prob = _cast(make_problem(**spec, seed=4, gated=gated), bfloat16)
    x, wg, wu, wd, dy = prob if gated else (prob[0], None, *prob[1:])
    for width in ("auto", 2):
        direct, l1_direct, w_direct = step_outputs(x, wg, wu, wd, dy, width, gated)
        monkeypatch.setattr(T, "_DIRECT_PACK", False)  # same single GEMM, CSR in between
        via_csr, l1_csr, w_csr = step_outputs(x, wg, wu, wd, dy, width, gated)
        monkeypatch.undo()
        assert w_direct == w_csr
        assert direct.keys() == via_csr.keys()
        for k in direct:
            a, b = direct[k], via_csr[k]
            assert a.shape == b.shape and a.dtype == b.dtype, k
            assert a.tobytes() == b.tobytes(), (width, k)
        assert l1_direct == l1_csr  # the same saved values go through the same kernel
        counts = direct["token_counts"]
        kept = int(direct["ell_nnz"].sum()) + int(counts[direct["backup_rows"]].sum())
        assert kept == int(counts.sum())  # every active entry is in the ELL part or a backup row
    monkeypatch.setattr(T, "GATE_CHUNK_BYTES", 1)  # every chunk is the 256-row minimum
    chunked, _, _ = step_outputs(x, wg, wu, wd, dy, "auto", gated)
    ref = dense_gated(x, wg, wu, wd, dy, 0.05) if gated else dense_relu(x, wu, wd, dy, 0.05)
    assert rel(chunked["y"], ref["y"]) <= TOL[bfloat16]
    grad_names = ("dx", "dw_gate", "dw_up", "dw_down") if gated else ("dx", "dw_up", "dw_down")
    for i, name in enumerate(grad_names):
        assert rel(chunked[f"grad{i}"], ref[name]) <= TOL[bfloat16], name


# ---------------------------------------------------------------------------
# backup rows in chunks, and their weight gradients through GEMMs
def _spy_weight_grads(monkeypatch):
    """Record, per backward, whether the weight gradients started from GEMM sums."""
    from twellpy.backends import cpu_train as CPU

    seen, real = [], CPU.ffn_weight_grads

    def spy(*args, base=None, **kw):
        seen.append(base is not None)
        return real(*args, base=base, **kw)

    monkeypatch.setattr(CPU, "ffn_weight_grads", spy)
    return seen


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64), bfloat16], ids=str)
@pytest.mark.parametrize("case", ["uneven", "hot2000", "empty_rows", "M1"])
@pytest.mark.parametrize("chunk_rows", [1, 3, None], ids=["chunk1", "chunk3", "onechunk"])
def test_backup_rows_in_chunks_with_gemm_weight_grads_match_dense(monkeypatch, gated, dtype, case, chunk_rows):
    x, wg, wu, wd, dy = _cast(make_problem(**CASES[case], seed=11), dtype)
    H, D = wu.shape
    acc = 8 if dtype == np.float64 else 4
    if chunk_rows is not None:
        monkeypatch.setattr(T, "BACKUP_CHUNK_BYTES", chunk_rows * max(H, D) * acc)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM", True)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_ROWS", 1)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_MEAN", 0)
    seen = _spy_weight_grads(monkeypatch)
    width = 2  # nearly every row is a backup row
    l1 = 0.05
    if gated:
        y, ctx = T.gated_forward_train(x, wg, wu, wd, l1=l1, width=width)
        grads = T.gated_backward(ctx, dy)
        ref = dense_gated(x, wg, wu, wd, dy, l1)
        names = ("dx", "dw_gate", "dw_up", "dw_down")
    else:
        y, ctx = T.relu_forward_train(x, wu, wd, l1=l1, width=width)
        grads = T.relu_backward(ctx, dy)
        ref = dense_relu(x, wu, wd, dy, l1)
        names = ("dx", "dw_up", "dw_down")
    R = ctx.stats["n_backup_rows"]
    assert seen == [R >= 1], "the weight gradients take the GEMM route exactly when there are backup rows"
    if case != "empty_rows":
        assert R >= 1
    tol = TOL[dtype]
    assert rel(y, ref["y"]) <= tol
    for name, got in zip(names, grads):
        assert got.dtype == dtype and got.shape == ref[name].shape, name
        assert rel(got, ref[name]) <= tol, (name, rel(got, ref[name]))
    assert ctx.stats["l1"] == pytest.approx(ref["l1"], rel=max(tol, 1e-9))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
def test_gemm_weight_grads_route_rules_and_bits(monkeypatch, gated):
    """The GEMM route is deterministic, close to the gather route and taken
    only past both thresholds."""
    x, wg, wu, wd, dy = _cast(make_problem(**CASES["uneven"], seed=12), np.dtype(np.float32))
    seen = _spy_weight_grads(monkeypatch)
    name = "TWELLPY_TRAIN_BACKUP_GEMM"
    assert T._switch_setting(name, "1") is True and T._switch_setting(name, "0") is False
    for bad in ("yes", "", "2"):
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got '{bad}'"):
            T._switch_setting(name, bad)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM", False)
    assert not T._backup_wgrad_by_gemm(10**6, 10**9)  # off: never, whatever the rows
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM", True)

    def grads(**kw):
        if gated:
            _, ctx = T.gated_forward_train(x, wg, wu, wd, l1=0.05, width=2, **kw)
            return ctx, T.gated_backward(ctx, dy)
        _, ctx = T.relu_forward_train(x, wu, wd, l1=0.05, width=2, **kw)
        return ctx, T.relu_backward(ctx, dy)

    ctx, gather = grads()  # the defaults: a few dozen rows are far below the row threshold
    R = ctx.stats["n_backup_rows"]
    entries = ctx.nnz_total - ctx.ell_entries
    assert 1 <= R < T.BACKUP_WGRAD_GEMM_MIN_ROWS and seen == [False]
    assert entries == int(np.asarray(ctx.stats["token_counts"])[np.asarray(ctx.backup_rows)].sum())
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_ROWS", R)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_MEAN", -(-entries // R) + 1)  # mean just short
    grads()
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_MEAN", entries // R)
    _, first = grads()
    _, again = grads()
    _, unchecked = grads(check_finite=False)
    assert seen == [False, False, True, True, True]
    for a, b, c, d in zip(first, again, gather, unchecked):
        assert a.tobytes() == b.tobytes() == d.tobytes()   # deterministic; finite sums are not redone
        np.testing.assert_allclose(a, c, rtol=2e-5, atol=2e-5 * float(np.abs(c).max()))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("where", ["x", "dy", "both"])
@pytest.mark.parametrize("chunk_rows", [2, None], ids=["chunk2", "onechunk"])
def test_gemm_weight_grads_with_unchecked_nan_inputs_match_the_gather(monkeypatch, gated, where, chunk_rows):
    """check_finite=False with NaN/Inf in a backup row's x or dy: the GEMMs meet
    them with the zeros of inactive neurons (0 * NaN = NaN); those elements are
    redone over the active entries, so NaN lands exactly where the gather puts it."""
    x, wg, wu, wd, dy = _cast(make_problem(**CASES["uneven"], seed=13), np.dtype(np.float32))
    seen = _spy_weight_grads(monkeypatch)

    def grads():
        if gated:
            _, ctx = T.gated_forward_train(x, wg, wu, wd, l1=0.05, width=2, check_finite=False)
            return ctx, T.gated_backward(ctx, dy)
        _, ctx = T.relu_forward_train(x, wu, wd, l1=0.05, width=2, check_finite=False)
        return ctx, T.relu_backward(ctx, dy)

    ctx, _ = grads()
    r0, r1 = (int(r) for r in np.asarray(ctx.backup_rows)[[0, -1]])
    if where in ("x", "both"):
        # z = +-Inf in that row: the neurons at -Inf are inactive there (a NaN in x
        # would make every neuron of the row active, leaving no zero to meet it)
        x[r1, 7] = np.inf
        x[r0, 11] = -np.inf  # two chunks' sums of opposite infinities meet in one sum
    if where in ("dy", "both"):
        dy[r0, 3] = np.nan
        dy[r1, 9] = -np.inf
    _, gather = grads()
    if chunk_rows:  # each chunk's sums are redone before they join the others'
        monkeypatch.setattr(T, "BACKUP_CHUNK_BYTES", chunk_rows * wu.shape[0] * 4)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM", True)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_ROWS", 1)
    monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_MEAN", 0)
    with np.errstate(invalid="raise", over="raise"):  # NaN/Inf of the caller's data raise nothing
        _, by_gemm = grads()
    assert seen == [False, False, True]
    for a, b in zip(by_gemm[1:], gather[1:]):  # the weight gradients
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        fin = np.isfinite(b)
        assert fin.mean() > 0.2  # neurons inactive in the poisoned rows stay finite
        np.testing.assert_allclose(a[fin], b[fin], rtol=2e-5, atol=2e-5 * float(np.abs(b[fin]).max()))


def test_backup_chunks_cover_the_rows_once(monkeypatch):
    monkeypatch.setattr(T, "BACKUP_CHUNK_BYTES", 10 * 4 * 7)
    assert T._backup_chunks(0, 7, 5, np.float32) == []
    assert T._backup_chunks(25, 7, 5, np.float32) == [(0, 10), (10, 20), (20, 25)]
    assert T._backup_chunks(25, 7, 5, np.float64) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25)]
    assert T._backup_chunks(3, 5, 7000, bfloat16) == [(0, 1), (1, 2), (2, 3)]  # at least a row


# ---------------------------------------------------------------------------
# the CPU twins of the backup-row kernels, against the formulas in float64
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("l1s", [0.0, 0.02])
def test_backup_row_helpers_follow_the_formulas(gated, l1s):
    from twellpy.backends import cpu_train as CPU

    rng = np.random.default_rng(21)
    R, H, M = 4, 37, 11
    g = np.maximum(rng.standard_normal((R, H)), 0).astype(np.float32)
    g[0, 0] = np.float32(1e-40)  # a denormal is an entry
    u_acc = rng.standard_normal((R, H)).astype(np.float32)
    dh_acc = rng.standard_normal((R, H)).astype(np.float32)
    rows = np.array([1, 4, 5, 10], dtype=np.int32)
    habs = np.full(M, -3.0, dtype=np.float32)
    u = np.full((R, H), np.nan, dtype=np.float32)
    h = CPU.backup_rows_forward(g, u_acc, u if gated else None, rows, habs, gated)
    on = g != 0
    u_ref = np.where(on, u_acc, 0)
    h_ref = g * u_ref if gated else g
    if gated:
        np.testing.assert_array_equal(u, u_ref)
    np.testing.assert_array_equal(h, h_ref)
    np.testing.assert_allclose(habs[rows], np.abs(h_ref.astype(np.float64)).sum(axis=1), rtol=1e-6)
    np.testing.assert_array_equal(np.delete(habs, rows), -3.0)
    da = np.full((R, H), np.nan, dtype=np.float32)
    db = np.full((R, H), np.nan, dtype=np.float32) if gated else None
    h_out = np.full((R, H), np.nan, dtype=np.float32) if gated else None
    CPU.backup_rows_backward(dh_acc, g, u if gated else None, l1s, gated, da, db, h_out=h_out)
    if gated:
        np.testing.assert_array_equal(h_out, h_ref)  # the forward's h, 0 off the pattern
    else:
        with pytest.raises(ValueError, match="h_out"):
            CPU.backup_rows_backward(dh_acc, g, None, l1s, gated, da, db, h_out=da)
    d = np.where(on, dh_acc + l1s * np.sign(h_ref), 0)
    np.testing.assert_allclose(da, d * g if gated else d, rtol=1e-6, atol=0)
    if gated:
        np.testing.assert_allclose(db, d * u_ref, rtol=1e-6, atol=0)
    assert np.isfinite(da).all()


def test_cpu_gemm_acc_accumulates_into_out():
    from twellpy.backends import cpu_train as CPU

    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((3, 8)), rng.standard_normal((8, 5))
    c = rng.standard_normal((3, 5))
    want = c + a @ b
    assert CPU.gemm_acc(a, b, out=c) is c
    np.testing.assert_allclose(c, want, rtol=1e-12)
    dst = np.zeros((4, 5), dtype=np.float16)
    CPU.put_rows_from_acc(dst, np.array([2], dtype=np.int32), want[:1].astype(np.float32))
    np.testing.assert_array_equal(dst[2], want[0].astype(np.float32).astype(np.float16))
    np.testing.assert_array_equal(dst[[0, 1, 3]], 0)


def test_row_maps_cpu_twin():
    from twellpy.backends import cpu_train

    maps = cpu_train.row_maps(np.array([5, 1, 9, 0, 4], np.int32), 3, 3)
    np.testing.assert_array_equal(maps, [0, -1, 1, -1, 2, 0, 2, 4])
    assert maps.dtype == np.int32
    np.testing.assert_array_equal(cpu_train.row_maps(np.zeros(0, np.int32), 3, 0), np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="n_backup is 1, but 2 rows have more than 3 non-zeros"):
        cpu_train.row_maps(np.array([5, 1, 9], np.int32), 3, 1)


def test_quantile_width_means_the_same_in_training_and_hybrid():
    """"quantile:p" is sorted(counts)[ceil(p*M) - 1] in both places (the training step used
    index ceil(p*(M-1)) before: one row wider at M = 10, p = 0.9), and "auto"'s 0.9 floor too."""
    from twellpy.hybrid import choose_width

    rng = np.random.default_rng(0)
    for M in (1, 2, 5, 10, 37, 1001):
        counts = rng.integers(0, 50, M)
        for p in (0, 0.1, 0.5, 0.9, 0.99, 1):
            want = int(np.sort(counts)[max(int(np.ceil(p * M)) - 1, 0)])
            assert choose_width(counts, 50, 4, f"quantile:{p}") == want
            assert T.choose_width(counts, f"quantile:{p}") == max(want, 1)
    counts = np.array([0] * 8 + [5, 9])  # ceil(0.9 * 10) = 9 rows kept: W = 5, not 9
    assert T.choose_width(counts, "quantile:0.9") == 5


# ---------------------------------------------------------------------------
# speculative layout (issue 5): the width and backup capacity of the previous
# step of the same layer, the counts read after the ELL kernel is queued. The
# CPU backend runs the same logic (it has no wait to save), so these tests
# check the bookkeeping and the bits in CI; tests/test_gpu_train.py repeats
# them on the device.
@pytest.fixture
def fresh_layouts(monkeypatch):
    """Every test starts with no remembered layer (and leaves none behind)."""
    monkeypatch.setattr(T, "_LAYOUTS", type(T._LAYOUTS)())
    return T._LAYOUTS


def test_auto_width_grid():
    """auto's grid: multiples of max(8, 2**(floor(log2 W) - 1)), at most half of W
    added, never past the row length; the drift of W1-16k's, W2's and sigma 0.3's
    raw widths (50-55, 138-142, 290-356 from step to step) stays on one grid point."""
    sw = T._stable_width
    assert [sw(w) for w in (1, 8, 9, 31, 32, 33, 50, 55, 63, 64, 65, 128, 129, 138, 142, 192, 193, 290, 356)] == \
        [8, 8, 16, 32, 32, 48, 64, 64, 64, 64, 96, 128, 192, 192, 192, 192, 256, 384, 384]
    for w in range(1, 5000):
        g = sw(w)
        assert w <= g <= max(w + 7, w + w // 2), w
        assert sw(g) == g, w                      # grid points are fixed points
    assert sw(50, n_cols=40) == 40 and sw(3, n_cols=4) == 4 and sw(0) == 8


def test_speculation_backoff_policy():
    """A re-run doubles the backoff (1, 2, 4, ... up to _SPEC_MAX_BACKOFF) and the
    layer then takes the exact path that many steps; a hit halves it."""
    after = T._backoff_after
    assert after(None, "exact") == (0, 0)
    lay, seen = T._Layout(56, 16, 0.25), []
    for _ in range(8):
        b, k = after(lay, "rerun")
        seen.append(b)
        lay = lay._replace(backoff=b, skip=k)
    assert seen == [1, 2, 4, 8, 16, 32, 32, 32] and T._SPEC_MAX_BACKOFF == 32
    skips = []
    while lay.skip:   # the exact steps count the skip down, keeping the backoff
        lay = lay._replace(**dict(zip(("backoff", "skip"), after(lay, "exact"))))
        skips.append(lay.skip)
    assert skips == list(range(31, -1, -1)) and lay.backoff == 32
    assert after(lay, "hit") == (16, 0) and after(T._Layout(56, 16, 0.25, 1, 0), "hit") == (0, 0)


def test_speculation_backs_off_a_layer_whose_width_keeps_moving(fresh_layouts):
    """Batches that alternate between two widths: after each re-run the layer runs
    exact for 1, 2, 4, ... steps, so re-runs become rare; every step is exact bits."""
    x, wg, wu, wd, dy = make_problem(M=200, D=24, H=256, nnz=12, sigma=0.4, seed=47)
    wide = x.copy()
    wide[:, 1:] *= 2.5
    outs = {}
    for name, xs in (("narrow", x), ("wide", wide)):
        outs[name] = step_outputs(xs, wg, wu, wd, dy, "auto", True, speculate=False)
    assert outs["narrow"][2] != outs["wide"][2], "the test needs two widths"
    paths = []
    for i in range(24):
        name = ("narrow", "wide")[i % 2]
        ctxs = []
        got, _, _ = step_outputs(x if name == "narrow" else wide, wg, wu, wd, dy, "auto", True, ctxs,
                                 speculate=True)
        paths.append(ctxs[0].speculation)
        for k in got:
            assert got[k].tobytes() == outs[name][0][k].tobytes(), (i, k)
    # exact (first), rerun, exact x1, rerun, exact x2, rerun, exact x4, rerun, exact x8, rerun, ...
    assert paths[:3] == ["exact", "rerun", "exact"] and "hit" not in paths
    assert paths.count("rerun") == 5, paths


def test_backup_capacity_policy():
    cap = T._backup_capacity
    assert cap(0, 10**6) == 16                 # room for a few wide rows even when none was seen
    assert cap(10, 10**6) == 32                # 10 + 16 extra, rounded up to 16
    assert cap(100, 10**6) == 128              # 100 + 25% = 125 -> 128
    assert cap(1638, 10**6) == 2048            # 1638 + 410 = 2048
    assert cap(100, 10**6, slack=1.0) == 208   # 200 -> 208
    assert cap(10, 20) == 20 and cap(0, 1) == 1 and cap(0, 0) == 0   # never more than M
    with pytest.raises(ValueError, match="n_wide, n_rows, slack >= 0"):
        cap(-1, 10)
    with pytest.raises(ValueError, match="n_wide, n_rows, slack >= 0"):
        cap(1, 10, slack=float("nan"))
    counts = np.array([3] * 90 + [40] * 10)
    sizes = dict(n_cols=64, slot_bytes=8, row_bytes=256)
    lay = T._next_layout(counts, "auto", **sizes)
    assert lay.width == T.choose_width(counts, "auto", **sizes)
    assert lay.capacity == T._backup_capacity(int((counts > lay.width).sum()), 100)
    assert lay.slack == T._SPEC_SLACK
    lay = T._next_layout(counts, 3, **sizes)
    assert (lay.width, lay.capacity, lay.slack) == (3, 32, T._SPEC_SLACK)   # 10 wide rows
    # an overflow doubles the slack, up to the maximum; a later step keeps it
    slacks = [T._SPEC_SLACK]
    for _ in range(6):
        slacks.append(T._next_layout(counts, 3, slack=slacks[-1], overflowed=True, **sizes).slack)
    assert slacks == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert T._next_layout(counts, 3, slack=1.0, **sizes).slack == 1.0


def _spec_problem(case, dtype, gated, seed=31):
    prob = _cast(make_problem(**CASES[case], seed=seed, gated=gated), dtype)
    return prob if gated else (prob[0], None, *prob[1:])


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("width", ["auto", 3])
def test_speculative_step_gives_the_exact_bits(fresh_layouts, case, dtype, gated, width):
    """The second call of a layer uses the first call's layout, and every output
    (y, the saved pattern and values, counts, gradients, statistics) is the exact
    path's with the same ``width`` strategy, bit for bit; M = 1 and empty rows included."""
    x, wg, wu, wd, dy = _spec_problem(case, dtype, gated)
    ctxs = []
    first, _, _ = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=True)
    spec, l1_spec, w_spec = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=True)
    assert [c.speculation for c in ctxs] == ["exact", "hit"]
    exact, l1_exact, w_exact = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=False)
    assert ctxs[-1].speculation == "off"
    assert w_spec == w_exact and l1_spec == l1_exact
    assert spec.keys() == exact.keys()
    for k in spec:
        assert spec[k].shape == exact[k].shape and spec[k].dtype == exact[k].dtype, k
        assert spec[k].tobytes() == exact[k].tobytes(), k
        assert first[k].tobytes() == exact[k].tobytes(), k   # same data: the first call chose the same W
    s, e = ctxs[1].stats, ctxs[2].stats
    for k in ("l0", "n_backup_rows", "width"):
        assert s[k] == e[k], k
    assert ctxs[1].nnz_total == ctxs[2].nnz_total == int(exact["token_counts"].sum())
    assert ctxs[1].gvals.size == ctxs[1].M * ctxs[1].width + ctxs[1].R * ctxs[1].H   # the unused room is cut off


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
def test_speculative_overflow_runs_the_step_again_exactly(fresh_layouts, gated):
    """A step with more wide rows than the remembered capacity: the exact path runs
    again (same bits as speculate=False), the capacity grows with a doubled slack,
    and the next step of the same layer fits."""
    spec = dict(M=300, D=24, H=256, nnz=12, sigma=0.6)
    x, wg, wu, wd, dy = make_problem(**spec, seed=41, gated=gated) if gated else \
        (lambda p: (p[0], None, *p[1:]))(make_problem(**spec, seed=41, gated=False))
    narrow = x.copy()
    narrow[6:, 1:] = 0.0          # rows 6.. fire nothing: at most 6 wide rows, capacity 32
    ctxs = []
    step_outputs(narrow, wg, wu, wd, dy, 2, gated, ctxs, speculate=True)
    (lay,) = fresh_layouts.values()
    assert lay.capacity == 32
    got, _, _ = step_outputs(x, wg, wu, wd, dy, 2, gated, ctxs, speculate=True)
    assert ctxs[-1].speculation == "rerun"
    assert ctxs[-1].R > 32, "the test needs more wide rows than the capacity"
    want, _, _ = step_outputs(x, wg, wu, wd, dy, 2, gated, ctxs, speculate=False)
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k
    (lay,) = fresh_layouts.values()
    assert lay.slack == 2 * T._SPEC_SLACK and (lay.backoff, lay.skip) == (1, 1)
    assert lay.capacity == T._backup_capacity(ctxs[-1].R, 300, 2 * T._SPEC_SLACK) > ctxs[-1].R
    # one exact step (the backoff after a re-run), then the grown capacity holds
    for how in ("exact", "hit"):
        again, _, _ = step_outputs(x, wg, wu, wd, dy, 2, gated, ctxs, speculate=True)
        assert ctxs[-1].speculation == how
        for k in want:
            assert again[k].tobytes() == want[k].tobytes(), (how, k)
    # the reference of every one: the float64 dense step
    ref = dense_gated(x, wg, wu, wd, dy, 0.05) if gated else dense_relu(x, wu, wd, dy, 0.05)
    assert rel(got["y"], ref["y"]) < 1e-10


def test_speculation_option_and_layers(fresh_layouts, monkeypatch):
    x, wg, wu, wd, dy = make_problem(**CASES["uneven"], seed=43)
    with pytest.raises(TypeError, match="speculate must be True, False or None, got str"):
        T.gated_forward_train(x, wg, wu, wd, speculate="1")
    with pytest.raises(ValueError, match="TWELLPY_TRAIN_SPECULATE must be 0, 1 or auto, got 'yes'"):
        T._speculate_setting("yes")
    assert T._speculate_setting("1") is True and T._speculate_setting("0") is False
    assert T._speculate_setting("auto") == "auto"
    # None follows the module default (the environment variable): "auto", the
    # default, is on for GPU arrays only (tests/test_gpu_train.py checks that side)
    for setting in (False, "auto"):
        monkeypatch.setattr(T, "SPECULATE", setting)
        assert T.gated_forward_train(x, wg, wu, wd)[1].speculation == "off"
    assert not fresh_layouts
    monkeypatch.setattr(T, "SPECULATE", True)
    assert [T.gated_forward_train(x, wg, wu, wd)[1].speculation for _ in range(2)] == ["exact", "hit"]
    # another layer (other weights), another width or another batch size: its own entry
    wg2 = wg.copy()
    assert T.gated_forward_train(x, wg2, wu, wd)[1].speculation == "exact"
    assert T.gated_forward_train(x, wg, wu, wd, width=3)[1].speculation == "exact"
    assert T.gated_forward_train(x[:50], wg, wu, wd)[1].speculation == "exact"
    assert len(fresh_layouts) == 4
    monkeypatch.setattr(T, "_SPEC_MAX_LAYERS", 2)
    T.gated_forward_train(x, wg, wu, wd)
    assert len(fresh_layouts) == 2             # the least recently used layers are forgotten
    # batches beyond one gate chunk (256 rows at least) speculate chunk by chunk, unless
    # TWELLPY_TRAIN_SPECULATE_CHUNKED is off: then the CSR path, always exact
    monkeypatch.setattr(T, "GATE_CHUNK_BYTES", 1)
    xl, wgl, wul, wdl, _ = make_problem(**dict(CASES["uneven"], M=600), seed=45)
    for chunked, want in ((False, ["exact", "exact"]), (True, ["exact", "hit"])):
        monkeypatch.setattr(T, "SPECULATE_CHUNKED", chunked)
        monkeypatch.setattr(T, "_LAYOUTS", type(T._LAYOUTS)())
        assert [T.gated_forward_train(xl, wgl, wul, wdl)[1].speculation for _ in range(2)] == want
    # an empty batch has nothing to speculate on
    _, ctx = T.gated_forward_train(x[:0], wg, wu, wd, speculate=True)
    assert ctx.speculation == "off" and ctx.M == 0


def test_speculative_step_still_checks_its_inputs(fresh_layouts):
    x, wg, wu, wd, dy = make_problem(**CASES["uniform"], seed=44)
    T.gated_forward_train(x, wg, wu, wd, speculate=True)
    bad = x.copy()
    bad[3, 4] = np.inf
    with pytest.raises(ValueError, match="x contains 0 NaN and 1 Inf"):
        T.gated_forward_train(bad, wg, wu, wd, speculate=True)
    y, ctx = T.gated_forward_train(x, wg, wu, wd, speculate=True)
    assert ctx.speculation == "hit"
    assert rel(y, dense_gated(x, wg, wu, wd, dy, 0.0)["y"]) < 1e-10


def test_row_maps_cpu_twin_with_a_capacity():
    from twellpy.backends import cpu_train

    counts = np.array([5, 1, 9, 0, 4], np.int32)
    # room for more: the unused backup slots are -1
    np.testing.assert_array_equal(cpu_train.row_maps(counts, 3, 5, capacity=True),
                                  [0, -1, 1, -1, 2, 0, 2, 4, -1, -1])
    # room for fewer: the wide rows past it map to -1 (the caller sees the overflow in the counts)
    np.testing.assert_array_equal(cpu_train.row_maps(counts, 3, 2, capacity=True), [0, -1, 1, -1, -1, 0, 2])
    np.testing.assert_array_equal(cpu_train.row_maps(counts, 3, 0, capacity=True), [-1] * 5)
    np.testing.assert_array_equal(cpu_train.row_maps(counts, 3, 3, capacity=True), cpu_train.row_maps(counts, 3, 3))


def test_relu_to_hybrid_cpu_twin_with_room_to_spare():
    """A capacity larger than the routed rows: the extra rows are zero and count no neuron."""
    from twellpy.backends import cpu_train

    z = np.random.default_rng(3).standard_normal((20, 50)).astype(np.float32)
    counts = cpu_train.relu_count(z)
    W = int(np.sort(counts)[10])
    R = int((counts > W).sum())
    exact = cpu_train.relu_to_hybrid(z, cpu_train.row_maps(counts, W, R)[:20], W, R)
    roomy = cpu_train.relu_to_hybrid(z, cpu_train.row_maps(counts, W, R + 4, capacity=True)[:20], W, R + 4)
    n = 20 * W + R * 50
    assert roomy[0][:n].tobytes() == exact[0].tobytes()
    assert not roomy[0][n:].any()
    for a, b in zip(roomy[1:], exact[1:]):
        np.testing.assert_array_equal(a, b)


def _boundary_width(counts, avoid):
    """A width with rows at exactly W and at least two rows wider, not ``avoid``."""
    for W in np.unique(counts)[::-1]:
        W = int(W)
        if W >= 1 and W != avoid and (counts == W).any() and int((counts > W).sum()) >= 2:
            return W
    raise AssertionError("the problem has no width with rows at W and rows wider")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
def test_speculative_capacity_boundary(fresh_layouts, gated):
    """Room for exactly the wide rows is a hit, one row less is a re-run (and the
    slack doubles); rows with exactly W active neurons stay ELL rows; both give
    the exact path's bits."""
    x, wg, wu, wd, dy = _spec_problem("uneven", np.dtype(np.float32), gated)
    counts = f64(step_outputs(x, wg, wu, wd, dy, 3, gated, [])[0]["token_counts"]).astype(np.int64)
    W = _boundary_width(counts, None)
    R = int((counts > W).sum())
    ctxs = []
    want, _, _ = step_outputs(x, wg, wu, wd, dy, W, gated, ctxs, speculate=True)   # seeds the entry
    (key,) = fresh_layouts
    for cap, how in ((R, "hit"), (R - 1, "rerun")):
        fresh_layouts[key] = T._Layout(W, cap, T._SPEC_SLACK)
        got, _, w_got = step_outputs(x, wg, wu, wd, dy, W, gated, ctxs, speculate=True)
        ctx = ctxs[-1]
        assert ctx.speculation == how, (cap, R)
        assert w_got == W and ctx.R == R
        assert not np.isin(np.flatnonzero(counts == W), f64(got["backup_rows"])).any()
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (how, k)
        assert fresh_layouts[key].slack == (T._SPEC_SLACK if how == "hit" else 2 * T._SPEC_SLACK)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
def test_speculation_with_another_width_runs_again(fresh_layouts, gated):
    """A remembered W that this step's counts would not pick under ``width`` (a
    drifted batch, another thread's step) is a re-run with the exact path's bits for
    ``width``, not a hit with the old W, even with room for every wide row; the slack
    stays (the room was not short) and the layout follows the new counts."""
    x, wg, wu, wd, dy = _spec_problem("uneven", np.dtype(np.float32), gated)
    ctxs = []
    auto, _, w_auto = step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=False)
    step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=True)   # seeds the entry
    (key,) = fresh_layouts
    counts = f64(auto["token_counts"]).astype(np.int64)
    M = ctxs[0].M
    for W in (w_auto - 8, w_auto + 8):
        if W < 1:
            continue
        fresh_layouts[key] = T._Layout(W, M, T._SPEC_SLACK)   # room for every row
        got, _, w_got = step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=True)
        assert ctxs[-1].speculation == "rerun" and w_got == w_auto, W
        for k in auto:
            assert got[k].tobytes() == auto[k].tobytes(), (W, k)
        lay = fresh_layouts[key]
        assert (lay.width, lay.slack, lay.backoff, lay.skip) == (w_auto, T._SPEC_SLACK, 1, 1)
        assert lay.capacity == T._backup_capacity(int((counts > w_auto).sum()), M)
    for how in ("exact", "hit"):   # backing off for one step, then on the new layout
        assert step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=True)[2] == w_auto
        assert ctxs[-1].speculation == how


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
def test_speculative_steps_on_changing_data(fresh_layouts, gated):
    """A run of steps whose batches change (row scales drift up, then down): every
    step, whichever path it took (hit or re-run), equals the exact path with the
    same strategy, bit for bit."""
    prob = make_problem(M=200, D=24, H=256, nnz=12, sigma=0.4, seed=46, gated=gated)
    x0, dy = prob[0], prob[-1]
    weights = prob[1:-1] if gated else (None, *prob[1:-1])
    seen = []
    for scale in (1.0, 1.0, 1.6, 2.4, 2.4, 0.7, 1.0):
        x = x0.copy()
        x[:, 1:] *= scale   # larger rows fire more neurons: more rows are wide
        ctxs = []
        got, _, w = step_outputs(x, *weights, dy, "auto", gated, ctxs, speculate=True)
        want, _, w_want = step_outputs(x, *weights, dy, "auto", gated, ctxs, speculate=False)
        assert w == w_want, scale
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (scale, k)
        seen.append(ctxs[0].speculation)
    assert seen[0] == "exact" and "hit" in seen, seen


def test_speculative_steps_from_several_threads(fresh_layouts):
    """Threads training the same layer on batches of two widths share its remembered
    layout (so they keep moving each other's W): every step is the exact path's for
    width="auto", bit for bit, whichever path it took."""
    import concurrent.futures as cf

    x, wg, wu, wd, dy = make_problem(M=200, D=24, H=256, nnz=12, sigma=0.4, seed=47)
    wide = x.copy()
    wide[:, 1:] *= 2.5                     # row scales only: more neurons fire, W moves
    inputs = (x, wide)
    want = [T.gated_forward_train(xi, wg, wu, wd, speculate=False) for xi in inputs]
    assert want[0][1].width != want[1][1].width, "the test needs two widths"

    def step(i):
        y, ctx = T.gated_forward_train(inputs[i % 2], wg, wu, wd, speculate=True)
        return y.tobytes() == want[i % 2][0].tobytes() and ctx.width == want[i % 2][1].width, ctx.speculation

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(step, range(32)))
    assert all(ok for ok, _ in results), results
    assert {how for _, how in results} <= {"exact", "hit", "rerun"}


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
def test_speculation_slack_grows_only_when_its_own_room_was_short(fresh_layouts, gated):
    """A re-run doubles the slack only if the remembered capacity was short for the
    remembered W, whatever the new W's wide rows: room enough at the old W but not at
    the new one keeps the slack; room short at the old W but enough at the new one
    doubles it."""
    x, wg, wu, wd, dy = _spec_problem("uneven", np.dtype(np.float32), gated)
    ctxs = []
    _, _, w_auto = step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=True)   # seeds the entry
    (key,) = fresh_layouts
    counts = np.asarray(ctxs[0].stats["token_counts"]).astype(np.int64)
    wider = lambda w: int((counts > w).sum())   # noqa: E731
    hi, lo = w_auto + 8, max(w_auto - 8, 1)
    assert wider(hi) < wider(w_auto) < wider(lo), "the test needs wide rows around auto's W"
    for W, cap, slack in ((hi, wider(hi), T._SPEC_SLACK),          # room at W, not at auto's W
                          (lo, wider(w_auto), 2 * T._SPEC_SLACK)):  # short at W, room at auto's W
        fresh_layouts[key] = T._Layout(W, cap, T._SPEC_SLACK)
        step_outputs(x, wg, wu, wd, dy, "auto", gated, ctxs, speculate=True)
        assert ctxs[-1].speculation == "rerun" and ctxs[-1].width == w_auto
        assert fresh_layouts[key].slack == slack, (W, cap)


def test_width_drift_model_and_the_auto_grid():
    """benchmarks/width_drift.py (the docs' re-run rates): its counts have the
    workload's mean, and on the grid W1-16k's width holds still over steps whose
    raw width moves."""
    from benchmarks.width_drift import drift, token_counts

    c = token_counts(np.random.default_rng(0), M=16384, D=2048, H=5632, nnz=30)
    assert abs(c.mean() - 30) < 0.5 and c.min() >= 0
    r = drift("W1-16k", 12)
    assert r["grid_changes"] == 0.0 and r["raw_changes"] > 0
    assert r["grid_range"][0] == r["grid_range"][1] >= r["raw_range"][1]


@pytest.mark.parametrize("count_pack", [True, False], ids=["count_pack", "count_then_pack"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_speculative_count_pack_gives_the_exact_bits(fresh_layouts, monkeypatch, count_pack, case, dtype, gated):
    """COUNT_PACK on (the default) and off (on: a hit counts and packs relu(z) in one
    read, then writes the wide rows' backup rows): every output equals the exact path's,
    bit for bit, as does a step re-run because its capacity was short."""
    monkeypatch.setattr(T, "COUNT_PACK", count_pack)
    one = [1] if count_pack else []  # the relu_count_pack calls of a hit
    x, wg, wu, wd, dy = _spec_problem(case, dtype, gated)
    calls = []
    from twellpy.backends import cpu_train

    real = cpu_train.relu_count_pack
    monkeypatch.setattr(cpu_train, "relu_count_pack", lambda *a, **k: calls.append(1) or real(*a, **k))
    ctxs = []
    step_outputs(x, wg, wu, wd, dy, 3, gated, ctxs, speculate=True)
    spec, _, _ = step_outputs(x, wg, wu, wd, dy, 3, gated, ctxs, speculate=True)
    exact, _, _ = step_outputs(x, wg, wu, wd, dy, 3, gated, ctxs, speculate=False)
    assert [c.speculation for c in ctxs] == ["exact", "hit", "off"] and calls == one
    for k in exact:
        assert spec[k].tobytes() == exact[k].tobytes(), k
    if ctxs[-1].R:   # room for one wide row less: the count-pack pass is discarded, the step re-run
        (key,) = fresh_layouts
        fresh_layouts[key] = T._Layout(3, ctxs[-1].R - 1, T._SPEC_SLACK)
        again, _, _ = step_outputs(x, wg, wu, wd, dy, 3, gated, ctxs, speculate=True)
        assert ctxs[-1].speculation == "rerun" and calls == one * 2
        for k in exact:
            assert again[k].tobytes() == exact[k].tobytes(), k


@pytest.mark.parametrize("route", ["gather", "gemm"], ids=["backup_gather", "backup_gemm"])
@pytest.mark.parametrize("width", ["auto", 2])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64), bfloat16], ids=str)
def test_dh_by_neuron_gives_the_row_flows_bits_on_the_cpu(monkeypatch, route, width, gated, case, dtype):
    """DH_BY_NEURON (dh with the weight gradients, over the transposed pattern, then
    the ELL dx that leaves the backup rows' dx alone): on the CPU the same values as
    the row-oriented backward, bit for bit, with the backup rows' weight gradients
    gathered or summed by GEMMs, and close to the float64 reference."""
    x, wg, wu, wd, dy = _cast(make_problem(**CASES[case], seed=23), dtype)
    if route == "gemm":
        monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM", True)
        monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_ROWS", 1)
        monkeypatch.setattr(T, "BACKUP_WGRAD_GEMM_MIN_MEAN", 0)
    from twellpy.backends import cpu_train

    calls = []
    real = cpu_train.ffn_backward_by_neuron
    monkeypatch.setattr(cpu_train, "ffn_backward_by_neuron", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(T, "DH_BY_NEURON", False)
    ctxs = []
    rows, _, _ = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs)
    monkeypatch.setattr(T, "DH_BY_NEURON", True)
    neuron, _, _ = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs)
    assert calls == [1]
    assert ctxs[1].R == ctxs[0].R and (width == "auto" or case == "empty_rows" or ctxs[1].R > 0)
    for k in rows:
        assert neuron[k].tobytes() == rows[k].tobytes(), k
    ref = dense_gated(x, wg, wu, wd, dy, 0.05) if gated else dense_relu(x, wu, wd, dy, 0.05)
    names = ("dx", "dw_gate", "dw_up", "dw_down") if gated else ("dx", "dw_up", "dw_down")
    for i, name in enumerate(names):
        assert rel(neuron[f"grad{i}"], ref[name]) <= TOL[dtype], name


CHUNKED_CASES = {
    "uniform": dict(M=700, D=24, H=256, nnz=12),
    "uneven": dict(M=600, D=24, H=256, nnz=12, sigma=0.6),
    "hot": dict(M=520, D=16, H=1024, nnz=8, hot=(300, 900), empty=(0, 257, 519)),
}


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 70), chunk=st.integers(1, 80), width=st.integers(0, 6), room=st.integers(0, 12),
       seed=st.integers(0, 2**16))
@example(M=64, chunk=8, width=2, room=3, seed=1)        # more wide rows than room, over several chunks
@example(M=2, chunk=1, width=0, room=1, seed=0)         # chunks of one row (BLAS blocks them otherwise)
def test_streamed_count_pack_is_the_whole_batchs(M, chunk, width, room, seed):
    """The CPU twin of the chunked speculative pattern step (a chunk at a time, each
    chunk's wide rows placed after the wide rows of the chunks before it) writes what
    one count and pack of the whole gate output and the whole batch's row maps give:
    ELL part, counts, neuron counts, maps, and the backup rows that fit the room."""
    from twellpy.backends import cpu_train

    rng = np.random.default_rng(seed)
    D, H = 16, 40
    # quarters times small integers: every product and sum is exact in float32, so the
    # one-GEMM reference and the GEMM a chunk cannot differ by BLAS's row blocking
    x = np.round(rng.standard_normal((M, D)) * 4).astype(np.float32) / 4
    w = np.round((rng.standard_normal((H, D)) - 1.2 * rng.random((H, 1))) * 4).astype(np.float32) / 4
    x[rng.random(M) < 0.2] *= 6.0                          # some rows fire many neurons
    (vals, idx, nnz, ncounts, counts), maps = cpu_train.gate_count_pack_streamed(x, w, width, room, chunk)
    z = cpu_train.gemm(x, w.T, x.dtype)
    want = cpu_train.relu_count_pack(z, width, room)
    want_maps = cpu_train.row_maps(want[4], width, room, capacity=True)
    cpu_train.backup_rows_from_z(z, want_maps, want[0], width, room)
    np.testing.assert_array_equal(counts, want[4])
    np.testing.assert_array_equal(maps, want_maps)
    np.testing.assert_array_equal(vals.view(np.uint32), want[0].view(np.uint32))
    for got, w_ in zip((idx, nnz, ncounts), want[1:4]):
        np.testing.assert_array_equal(got, w_)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", list(CHUNKED_CASES))
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("width", ["auto", 3])
def test_speculative_chunked_batch_gives_the_exact_bits(fresh_layouts, monkeypatch, case, dtype, gated, width):
    """TWELLPY_TRAIN_SPECULATE_CHUNKED: a batch of several gate chunks (256 rows each
    here) speculates by counting and packing each chunk as it is GEMM'd; a hit gives
    the exact (CSR) path's bits, and a layout too small runs the step again exactly."""
    from twellpy.backends import cpu_train

    monkeypatch.setattr(T, "GATE_CHUNK_BYTES", 1)  # every chunk is the 256-row minimum
    monkeypatch.setattr(T, "SPECULATE_CHUNKED", True)
    calls, real = [], cpu_train.gate_count_pack_streamed
    monkeypatch.setattr(cpu_train, "gate_count_pack_streamed", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    prob = _cast(make_problem(**CHUNKED_CASES[case], seed=43, gated=gated), dtype)
    x, wg, wu, wd, dy = prob if gated else (prob[0], None, *prob[1:])
    ctxs = []
    step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=True)
    spec, l1_spec, w_spec = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=True)
    exact, l1_exact, w_exact = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=False)
    assert [c.speculation for c in ctxs] == ["exact", "hit", "off"] and calls == [256]
    assert w_spec == w_exact and l1_spec == l1_exact and spec.keys() == exact.keys()
    for k in spec:
        assert spec[k].shape == exact[k].shape and spec[k].tobytes() == exact[k].tobytes(), k
    if ctxs[-1].R:
        # room for one backup row fewer than the batch has: the step runs again, exactly
        (key,) = fresh_layouts
        fresh_layouts[key] = T._Layout(ctxs[-1].width, ctxs[-1].R - 1, T._SPEC_SLACK)
        again, _, _ = step_outputs(x, wg, wu, wd, dy, width, gated, ctxs, speculate=True)
        assert ctxs[-1].speculation == "rerun" and len(calls) == 2
        for k in exact:
            assert again[k].tobytes() == exact[k].tobytes(), k


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu"])
@pytest.mark.parametrize("case", ["uneven", "hot2000", "M1"])
def test_backward_ell_kernel_first_gives_the_same_step(monkeypatch, case, gated):
    """TWELLPY_TRAIN_BWD_ELL_FIRST (the backward's ELL kernel launched before the
    transpose) changes only the launch order: the same outputs, gradients and L1
    statistic, wide rows' backup rows included."""
    prob = _cast(make_problem(**CASES[case], seed=29, gated=gated), bfloat16)
    x, wg, wu, wd, dy = prob if gated else (prob[0], None, *prob[1:])
    got = {}
    for first in (False, True):
        monkeypatch.setattr(T, "BWD_ELL_FIRST", first)
        got[first] = step_outputs(x, wg, wu, wd, dy, "auto", gated)
    for k in got[False][0]:
        assert got[True][0][k].tobytes() == got[False][0][k].tobytes(), k
    assert got[True][1:] == got[False][1:]


@pytest.mark.parametrize("ell_first", [False, True], ids=["transpose-first", "ell-first"])
@pytest.mark.parametrize("failing", ["ffn_backward_ell", "backup_rows_backward"])
def test_backward_joins_its_side_work_when_a_step_fails(monkeypatch, failing, ell_first):
    """An error between the backward's side work (the transpose) and its use still joins
    the side work before the error leaves the backward: the caller may free the context
    whose pattern the side stream reads. The side work is recorded here on the CPU."""
    prob = _cast(make_problem(**CASES["hot2000"], seed=31, gated=True), np.float32)
    x, wg, wu, wd, dy = prob
    _, ctx = T.gated_forward_train(x, wg, wu, wd, l1=0.01)
    assert ctx.R >= 1  # a backup row, so the backward's step 2 runs
    events = []

    class RecordingSide:
        def __init__(self, enabled=True):
            pass

        def start_here(self):
            events.append("start_here")
            return self

        def __enter__(self):
            events.append("enter")
            return self

        def __exit__(self, *exc):
            events.append("exit")
            return False

        def join(self):
            events.append("join")

    from twellpy import backends
    from twellpy.backends import cpu_train

    assert backends.get(x, "train") is cpu_train

    def boom(*a, **k):
        raise RuntimeError(f"{failing} failed")

    monkeypatch.setattr(T, "BWD_ELL_FIRST", ell_first)
    monkeypatch.setattr(T, "DH_BY_NEURON", False)
    monkeypatch.setattr(cpu_train, "SideWork", RecordingSide)
    monkeypatch.setattr(cpu_train, failing, boom)
    with pytest.raises(RuntimeError, match=f"{failing} failed"):
        T.gated_backward(ctx, dy)
    assert events and events[-1] == "join", events
    if failing == "backup_rows_backward" or not ell_first:
        assert "enter" in events and events.index("exit") < events.index("join")


@pytest.mark.parametrize("name", ["TWELLPY_PAIR_TRANSPOSE", "TWELLPY_TRAIN_TWO_PASS"])
def test_gpu_training_switches_reject_bad_values(name):
    """The training backend's on/off environment switches take 0 or 1; anything else
    stops the import with a message naming the variable (checked in a fresh process:
    the switches are read once, at import)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TWELLPY_PAIR_TRANSPOSE", "TWELLPY_TRAIN_TWO_PASS")}
    env[name] = "yes"
    r = subprocess.run([sys.executable, "-c", "import twellpy.backends.cuda_train"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"{name} must be 0 or 1, got 'yes'" in r.stderr
    env[name] = "0"
    r = subprocess.run([sys.executable, "-c", "import twellpy.backends.cuda_train as c; print(int(c.PAIR_TRANSPOSE), "
                        "int(c.TWO_PASS))"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    want = {"TWELLPY_PAIR_TRANSPOSE": "0 1", "TWELLPY_TRAIN_TWO_PASS": "1 0"}[name]
    assert r.stdout.strip().splitlines()[-1] == want
