"""GPU tests of the fused FFN inference (run on the device: pytest -m gpu)."""
import os
import re

import numpy as np
import pytest

from benchmarks.workloads import make_ffn, reference_ffn
from conftest import GPU_COUNT, rel_err
from conftest import poison_gpu_pool as poison
from twellpy._array import bfloat16
from twellpy._ffn_infer import GatedFFN, ReluFFN, gated_forward, relu_forward

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

GPU_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), bfloat16]
# errors of the fused path against a float64 reference
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-5, np.dtype(np.float16): 5e-3, bfloat16: 1e-2}


def to_gpu(w):
    return {k: (cp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in w.items()}


def ref64(w, gated=True):
    g = lambda a: None if a is None else (a.get() if hasattr(a, "get") else a)  # noqa: E731
    return reference_ffn(g(w["x"]), g(w["w_gate"]) if gated else None, g(w["w_up"]), g(w["w_down"]),
                         dtype=np.float64)


def run(w, gated=True, **kw):
    if gated:
        return gated_forward(w["x"], w["w_gate"], w["w_up"], w["w_down"], **kw)
    return relu_forward(w["x"], w["w_up"], w["w_down"], **kw)


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("mode", ["sparse", "dense", "auto"])
def test_matches_float64_reference(dtype, gated, mode):
    w = to_gpu(make_ffn(1003, 256, 1024, 20, sigma=0.2, gated=gated, dtype=dtype, xp=np, seed=3))
    poison()
    y = run(w, gated, mode=mode)
    assert isinstance(y, cp.ndarray) and y.dtype == dtype and y.shape == (1003, 256)
    assert bool(cp.isfinite(y).all())
    assert rel_err(y, ref64(w, gated)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float32)], ids=str)
def test_matches_cpu_backend(dtype):
    w = make_ffn(517, 128, 512, 12, sigma=0.3, dtype=dtype, seed=5)
    y_cpu = run(w)
    y_gpu = run(to_gpu(w))
    assert rel_err(y_gpu, y_cpu) <= 2 * TOL[dtype]


def test_sigma_03_bf16_overflowing_tiles():
    w = to_gpu(make_ffn(4096, 512, 2048, 30, sigma=0.3, dtype=bfloat16, xp=np, seed=11))
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], mode="sparse")
    poison()
    y, h = ffn(w["x"], return_activations=True)
    ref = ref64(w)
    assert rel_err(y, ref) <= 1e-2
    # the uneven rows really overflow 32 slots of a 256-wide tile
    assert h.backup_rows.size > 0
    g = w["x"].astype(np.float64) @ w["w_gate"].astype(np.float64).T
    h_ref = cp.where(g <= 0, 0, g * (w["x"].astype(np.float64) @ w["w_up"].astype(np.float64).T))
    assert rel_err(cp.asarray(h.toarray()), h_ref) <= 1e-2


@pytest.mark.parametrize("heavy_limit", [None, 256])
@pytest.mark.parametrize("gated", [True, False])
def test_token_firing_2000_neurons(gated, heavy_limit):
    w = make_ffn(64, 256, 4096, 25, gated=gated, dtype=bfloat16, seed=2)
    x = w["x"].astype(np.float32)
    x[5, 0] = 0.0    # no threshold: about half of 4096 neurons fire (list drained and refilled)
    x[9, 0] = 0.5    # a few hundred fire (per-row list of the row-pack kernel)
    x[11, 0] = 0.3   # ~900 fire: over the row-pack capacity (ffn_long.cu, or one block with long_rows off)
    w["x"] = x.astype(bfloat16)
    wg = to_gpu(w)
    ffn = (GatedFFN(wg["w_gate"], wg["w_up"], wg["w_down"]) if gated else ReluFFN(wg["w_up"], wg["w_down"]))
    ffn.heavy_limit = heavy_limit
    poison()
    y = ffn(wg["x"], mode="sparse")
    pre = (w["w_gate"] if gated else w["w_up"]).astype(np.float32)
    fired = (w["x"].astype(np.float32) @ pre.T > 0).sum(axis=1)
    assert fired[5] >= 1500 and 100 < fired[9] <= 512 and 512 < fired[11] < 1024
    if heavy_limit is None:   # the kernel's list was drained and refilled for row 5
        assert ffn.last_info["heavy_rows"] == 0 and ffn.activity()["heavy_rows"] == 0
    else:                     # rows 5 and 9 went to the dense sub-FFN
        assert ffn.last_info["heavy_rows"] >= 1
    assert ffn.activity()["mean_active"] > 25
    assert rel_err(y, ref64(wg, gated)) <= 1e-2
    assert rel_err(y[5], ref64(wg, gated)[5]) <= 1e-2


@pytest.mark.parametrize("mode", ["auto", "sparse"])
@pytest.mark.parametrize("M", [0, 1, 7, 65536 + 7])
def test_row_counts(M, mode):
    w = make_ffn(max(M, 1), 256, 512, 10, dtype=bfloat16, xp=cp, seed=M % 97)
    x = w["x"][:M]
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], mode=mode)
    poison()
    y = ffn(x)
    assert y.shape == (M, 256)
    if M:
        assert bool(cp.isfinite(y).all())
        ref = reference_ffn(x, w["w_gate"], w["w_up"], w["w_down"], dtype=np.float32)
        assert rel_err(y, ref) <= 1e-2


@pytest.mark.parametrize("variant", ["narrow", "wide", "l2hint"])
def test_deterministic_bits(variant):
    w = to_gpu(make_ffn(8192 + 5, 512, 2048, 30, sigma=0.3, dtype=bfloat16, xp=np, seed=4))
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], mode="sparse")
    ffn._plan.kb_variant = "wide" if variant == "wide" else "narrow"
    ffn._plan.l2_hint = variant == "l2hint"
    poison()
    y1 = ffn(w["x"]).view(np.uint16)
    poison()
    y2 = ffn(w["x"]).view(np.uint16)
    assert bool((y1 == y2).all())
    assert rel_err(y1.view(bfloat16), ref64(w)) <= 1e-2


@pytest.mark.parametrize("mode", ["sparse", "auto"])
@pytest.mark.parametrize("gated", [True, False])
def test_two_stream_pipeline(mode, gated):
    # 5 chunks of 1000 rows: ring-buffer reuse across the two streams
    w = make_ffn(4500, 256, 1024, 12, sigma=0.3, gated=gated, dtype=bfloat16, xp=cp, seed=21)
    ffn = (GatedFFN(w["w_gate"], w["w_up"], w["w_down"]) if gated else ReluFFN(w["w_up"], w["w_down"]))
    ffn._plan.chunk_rows = 1000
    ffn.auto_threshold = 1e9 if mode == "auto" else ffn.auto_threshold
    poison()
    y1 = ffn(w["x"], mode=mode)
    poison()
    y2 = ffn(w["x"], mode=mode)
    assert ffn.last_info["mode"] == "sparse"
    assert bool((y1.view(np.uint16) == y2.view(np.uint16)).all())
    assert rel_err(y1, ref64(w, gated)) <= 1e-2
    ffn.auto_threshold = 0.5   # now the probe of chunk 0 switches every chunk to dense
    y3 = ffn(w["x"], mode="auto")
    assert ffn.last_info["mode"] == "dense"
    assert rel_err(y3, ref64(w, gated)) <= 1e-2


def test_return_activations_matches_dense_h():
    w = to_gpu(make_ffn(300, 128, 1024, 40, sigma=0.3, dtype=np.float32, xp=np, seed=8))
    y, h = gated_forward(w["x"], w["w_gate"], w["w_up"], w["w_down"], return_activations=True,
                         slots=8, tile=128)
    x64, wg64, wu64 = (w[k].astype(cp.float64) for k in ("x", "w_gate", "w_up"))
    g = x64 @ wg64.T  # an independent float64 reference, not the float32 GEMM under test
    h_ref = cp.where(g <= 0, 0, g * (x64 @ wu64.T))
    assert h.shape == (300, 1024) and h.format == "twell"
    assert rel_err(cp.asarray(h.toarray()), h_ref) <= 1e-5
    assert rel_err(y, ref64(w)) <= 2e-5
    y_plain = gated_forward(w["x"], w["w_gate"], w["w_up"], w["w_down"])
    assert bool((y_plain == y).all())


def test_auto_falls_back_to_dense_when_dense():
    w = to_gpu(make_ffn(4096, 256, 1024, 400, dtype=bfloat16, xp=np, seed=9))
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    y = ffn(w["x"])
    assert ffn.last_info["mode"] == "dense"
    assert ffn.last_info["mean_active"] > ffn.auto_threshold
    assert rel_err(y, ref64(w)) <= 1e-2


def test_nan_propagates_with_check_finite_false():
    w = make_ffn(40, 64, 256, 10, dtype=np.float32, seed=6)
    x = w["x"].copy()
    x[3, 7] = np.nan
    wu = w["w_up"].copy()
    wu[11, 2] = np.nan
    xg, wgg, wug, wdg = (cp.asarray(a) for a in (x, w["w_gate"], wu, w["w_down"]))
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        gated_forward(xg, wgg, cp.asarray(w["w_up"]), wdg)
    with pytest.raises(ValueError, match="w_up contains 1 NaN"):
        gated_forward(cp.asarray(w["x"]), wgg, wug, wdg)
    ref = reference_ffn(x.astype(np.float64), w["w_gate"].astype(np.float64), wu.astype(np.float64),
                        w["w_down"].astype(np.float64), dtype=np.float64)
    for mode in ("sparse", "dense"):
        y = gated_forward(xg, wgg, wug, wdg, check_finite=False, mode=mode).get()
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
        assert np.isnan(y[3]).all()
        ok = ~np.isnan(ref).any(axis=1)
        assert ok.sum() > 0
        assert rel_err(y[ok], ref[ok]) <= 2e-5


@pytest.mark.parametrize("chunk_rows", [None, 300], ids=["one-chunk", "two-streams"])
@pytest.mark.parametrize("heavy_limit", [256, None], ids=["heavy-rows", "no-heavy"])
@pytest.mark.parametrize("mode", ["auto", "sparse", "dense"])
@pytest.mark.parametrize("m", [1, 700], ids=["M1", "M700"])
def test_deferred_finite_check_on_every_path(m, mode, heavy_limit, chunk_rows):
    # the NaN/Inf count of x is queued before the gate GEMM and read at the call's first
    # host synchronisation (probe, heavy-row stats or the end): every path must still raise,
    # name x and count right, and leave the object working
    gated = chunk_rows is None
    w = make_ffn(m, 128, 512, 12, sigma=0.3, gated=gated, dtype=np.float32, xp=cp, seed=40 + m)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"]) if gated else ReluFFN(w["w_up"], w["w_down"])
    ffn.heavy_limit = heavy_limit
    ffn._plan.chunk_rows = chunk_rows
    bad = w["x"].copy()
    bad[m // 2, 5] = np.nan
    bad[m - 1, 7] = np.inf
    for _ in range(2):  # twice: the counter is zeroed per call
        poison()
        with pytest.raises(ValueError, match="x contains 1 NaN and 1 Inf values"):
            # "sync": M = 1 would otherwise defer the report (test_decode_calls_defer_the_finite_check)
            ffn(bad, mode=mode, check_finite="sync")
    poison()
    y = ffn(w["x"], mode=mode)
    assert rel_err(y, ref64(w, gated)) <= 1e-5
    y_nan = ffn(bad, mode=mode, check_finite=False)  # IEEE semantics when asked for
    assert not bool(cp.isfinite(y_nan[m - 1]).all())  # the Inf row
    if m > 1:
        assert bool(cp.isnan(y_nan[m // 2]).all())


@pytest.mark.parametrize("chunk_rows", [None, 48], ids=["one-chunk", "two-streams"])
@pytest.mark.parametrize("mode", ["auto", "sparse", "dense"])
@pytest.mark.parametrize("m", [1, 128])
def test_decode_calls_defer_the_finite_check(m, mode, chunk_rows):
    # check_finite=True: a call of at most defer_check_rows rows, except an object's first,
    # returns without waiting for the NaN/Inf count of x (waiting would idle the GPU after
    # every decode step); a later call, before it queues anything, or check() raises for
    # it, once, naming the call
    import gc

    w = make_ffn(m, 128, 512, 12, dtype=np.float32, xp=cp, seed=70 + m)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    ffn._plan.chunk_rows = chunk_rows
    bad = w["x"].copy()
    bad[m - 1, 3] = np.nan
    ref = ref64(w)
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        ffn(bad, mode=mode)                                                # call 1 waits: raises itself
    assert rel_err(ffn(w["x"], mode=mode), ref) <= 1e-5                    # call 2
    poison()
    y_bad = ffn(bad, mode=mode)                                            # call 3 returns
    assert ffn.last_info["finite_check"] == "deferred"
    assert bool(cp.isnan(y_bad[m - 1]).all())                              # IEEE in the rows concerned
    if m > 1:
        assert rel_err(y_bad[: m - 1], ref[: m - 1]) <= 1e-5               # and exact elsewhere
    with pytest.raises(ValueError, match=rf"x of an earlier call of this FFN \(call 3, {m} rows\) contains 1 NaN"):
        ffn(w["x"], mode=mode)                                             # call 4 reports call 3
    poison()
    assert rel_err(ffn(w["x"], mode=mode), ref) <= 1e-5                    # call 5: the object works
    ffn(bad, mode=mode)                                                    # call 6
    with pytest.raises(ValueError, match=r"call 6,"):
        ffn.check()
    ffn.check()                                                            # reported once
    ffn(bad, mode=mode)                                                    # call 7
    cp.cuda.Device().synchronize()                                         # its count has landed:
    with pytest.raises(ValueError, match=r"call 7,"):
        ffn(w["x"], mode=mode)                                             # call 8 raises at its start
    for _ in range(12):                                                    # more calls than the ring holds
        ffn(w["x"], mode=mode)
    ffn.check()
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        ffn(bad, mode=mode, check_finite="sync")                           # waits, raises itself
    ffn.defer_check_rows = 0
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        ffn(bad, mode=mode)                                                # every call waits
    ffn.check()
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        gated_forward(bad, w["w_gate"], w["w_up"], w["w_down"], mode=mode)  # a one-off call waits
    dropped = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    dropped(w["x"], mode=mode)
    dropped(bad, mode=mode)
    with pytest.warns(RuntimeWarning, match=r"call 2, .*freed"):
        del dropped
        gc.collect()


@pytest.mark.parametrize("chunk_rows", [None, 4100, 1024], ids=["one-chunk", "two-streams", "small-chunks"])
def test_auto_dense_calls_sample_the_density(chunk_rows, monkeypatch):
    # an "auto" call that an earlier count already sends dense builds no row lists: it packs
    # every DENSITY_SAMPLE-th row of chunk 0 (rotating start; the whole chunk when it is
    # small) to keep measuring, and that count still decides later calls
    from twellpy.backends import cuda_ffn

    M, H = 8192, 512
    w = make_ffn(M, 128, H, 24, dtype=np.float32, xp=cp, seed=81)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    plan = ffn._plan
    plan.chunk_rows = chunk_rows
    ffn.auto_threshold = 4.0
    want = ffn(w["x"], mode="dense")
    rows0 = M if chunk_rows is None else chunk_rows
    true_mean = float(((w["x"][:rows0] @ w["w_gate"].T) > 0).sum()) / rows0
    packs = []
    real = cuda_ffn.FFNPlan._launch_rowpack

    def recording(self, g, buf, stream, total=None, on_current=False):
        packs.append((g.shape[0], g.strides[0] // g.itemsize, int(g.data.ptr - plan._ws["g"][buf].data.ptr)
                      // (H * g.itemsize), total is not None))
        return real(self, g, buf, stream, total=total, on_current=on_current)

    monkeypatch.setattr(cuda_ffn.FFNPlan, "_launch_rowpack", recording)
    ffn(w["x"])                                      # the first auto call probes: full lists, dense
    assert ffn.last_info["mode"] == "dense" and ffn.last_info["decided_by"] == "probe"
    starts = set()
    for _ in range(4):
        cp.cuda.Device().synchronize()               # the count has landed
        del packs[:]
        poison()
        y = ffn(w["x"])
        assert ffn.last_info["mode"] == "dense" and ffn.last_info["decided_by"] == "earlier call"
        assert rel_err(y, want) <= 1e-5
        assert len(packs) == 1                       # chunk 0 only, with the count
        rows, stride, start, counted = packs[0]
        assert counted
        if rows0 >= cuda_ffn.DENSITY_SAMPLE * cuda_ffn.DENSITY_MIN_SAMPLE:
            assert stride == cuda_ffn.DENSITY_SAMPLE * H and 0 <= start < cuda_ffn.DENSITY_SAMPLE
            assert rows == len(range(start, rows0, cuda_ffn.DENSITY_SAMPLE))
            starts.add(start)
        else:
            assert (rows, stride, start) == (rows0, H, 0)   # a small chunk is counted whole
        assert plan._density_rows == rows
    if rows0 >= cuda_ffn.DENSITY_SAMPLE * cuda_ffn.DENSITY_MIN_SAMPLE:
        assert len(starts) > 1                       # the sampled rows rotate
    cp.cuda.Device().synchronize()
    ffn.auto_threshold = 1e9                         # the sampled density now decides: sparse
    del packs[:]
    poison()
    y = ffn(w["x"])
    assert ffn.last_info["mode"] == "sparse"
    assert abs(ffn.last_info["mean_active"] - true_mean) <= 0.2 * true_mean
    assert sum(p[0] for p in packs) == M and all(p[1] == H for p in packs)   # full lists everywhere
    assert rel_err(y, ref64(w)) <= 1e-5


def test_odd_shapes_and_batch_dims():
    # D, H not multiples of 8 take the dense path on the GPU and stay exact
    w = to_gpu(make_ffn(50, 100, 300, 15, dtype=np.float32, xp=np, seed=1))
    assert rel_err(run(w), ref64(w)) <= 2e-5
    w = to_gpu(make_ffn(24, 64, 256, 10, dtype=bfloat16, xp=np, seed=1))
    y3 = gated_forward(w["x"].reshape(2, 3, 4, 64), w["w_gate"], w["w_up"], w["w_down"])
    y2 = gated_forward(w["x"], w["w_gate"], w["w_up"], w["w_down"])
    assert y3.shape == (2, 3, 4, 64)
    assert bool((y3.reshape(24, 64).view(np.uint16) == y2.view(np.uint16)).all())


def test_wide_model_w5_shape():
    w = make_ffn(257, 4096, 11008, 30, dtype=bfloat16, xp=cp, seed=12)
    y = run(w, mode="sparse")
    assert rel_err(y, ref64(w)) <= 1e-2


@pytest.mark.skipif(os.environ.get("TWELLPY_SANITIZE") == "1",
                    reason="sanitizer runs allocate without CuPy's pool, whose counter this test reads")
def test_reusable_object_allocates_only_output():
    w = to_gpu(make_ffn(4096, 256, 1024, 20, dtype=bfloat16, xp=np, seed=13))
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], mode="sparse")
    ffn(w["x"])
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    y = ffn(w["x"])
    cp.cuda.Device().synchronize()
    grown = pool.used_bytes() - before
    assert grown <= y.nbytes + 4096


def test_weights_on_another_device_or_dtype():
    w = make_ffn(8, 64, 128, 5, dtype=np.float32, seed=0)
    with pytest.raises(ValueError, match="w_up is on cuda:0 but w_gate is on cpu"):
        gated_forward(w["x"], w["w_gate"], cp.asarray(w["w_up"]), w["w_down"])
    ffn = GatedFFN(cp.asarray(w["w_gate"]), cp.asarray(w["w_up"]), cp.asarray(w["w_down"]))
    with pytest.raises(ValueError, match="x is on cpu but the weights are on cuda:0"):
        ffn(w["x"])
    with pytest.raises(TypeError, match="x has dtype float16 but the weights have dtype float32"):
        ffn(cp.asarray(w["x"]).astype(np.float16))


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    w = make_ffn(33, 64, 256, 10, dtype=np.float32, seed=2)
    t = {k: torch.from_numpy(v).cuda() for k, v in w.items() if isinstance(v, np.ndarray)}
    y = gated_forward(t["x"], t["w_gate"], t["w_up"], t["w_down"])
    assert isinstance(y, torch.Tensor) and y.is_cuda
    assert rel_err(y.cpu().numpy(), ref64(w)) <= 2e-5


@pytest.mark.parametrize("gated", [True, False])
def test_sparse_kernel_tunings_give_the_same_bits(gated):
    """Every (batch variant, register budget) the benchmark times sums in the same
    order, so each gives the default's bits; heavy rows (list rounds) included."""
    from twellpy.backends import cuda_ffn

    w = make_ffn(333, 2048, 2048, 30, sigma=0.3, gated=gated, dtype=np.float32, xp=np, seed=17)
    w["x"][7, 1:] *= 10.0  # x[:, 0] = 1 carries the threshold: this row fires ~half of 2048 neurons,
    w = to_gpu({k: (v.astype(bfloat16) if isinstance(v, np.ndarray) else v) for k, v in w.items()})
    # far over the 512-entry row lists (the kernel scans g itself for it)
    cls = GatedFFN if gated else ReluFFN
    args = (w["w_gate"], w["w_up"], w["w_down"]) if gated else (w["w_up"], w["w_down"])
    ffn = cls(*args, mode="sparse")
    base = ffn(w["x"])
    assert rel_err(base, ref64(w, gated)) <= TOL[bfloat16]
    plan = ffn._plan
    for kb in cuda_ffn._KB_FOR_NV:
        for blocks in (1, 2, 3, 4):
            plan.kb_variant, plan.min_blocks = kb, blocks
            poison()
            y = ffn(w["x"])
            assert bool((y.view(cp.uint16) == base.view(cp.uint16)).all()), (kb, blocks)


def test_default_bf16_call_loads_a_declared_module():
    """The module the default W1-shaped call loads is one the declarations list
    (``twellpy info --compile`` then warms exactly what run time uses)."""
    from twellpy.backends import _registry as reg

    w = to_gpu(make_ffn(64, 2048, 1024, 20, sigma=0.2, dtype=bfloat16, xp=np, seed=11))
    poison()
    y = run(w, mode="sparse")
    assert rel_err(y, ref64(w)) <= TOL[bfloat16]
    declared = {(n, tuple(sorted(d.items()))) for names, d in reg.declared()["ffn_sparse.cu"] for n in names}
    used = {(name, defs) for (_, f, defs, name) in list(reg._CACHE) if f == "ffn_sparse.cu"}
    assert used, "the sparse FFN kernel was not fetched through the registry"
    assert used & declared, f"run time loaded {sorted(used)}, none of them declared"


# ---------------------------------------------------------------------------
# mode="auto" after the first call: decided from an earlier call's density,
# copied to pinned host memory without a mid-call synchronisation
@pytest.mark.parametrize("chunk_rows", [None, 1000], ids=["one-chunk", "two-streams"])
@pytest.mark.parametrize("gated", [True, False])
def test_auto_decides_from_an_earlier_call(chunk_rows, gated):
    sparse_w = make_ffn(4500, 256, 1024, 12, sigma=0.3, gated=gated, dtype=bfloat16, xp=cp, seed=31)
    ffn = (GatedFFN(sparse_w["w_gate"], sparse_w["w_up"], sparse_w["w_down"]) if gated
           else ReluFFN(sparse_w["w_up"], sparse_w["w_down"]))
    ffn._plan.chunk_rows = chunk_rows
    assert ffn.auto_probe == "first"
    ffn.auto_threshold = 100.0

    def call(x):
        poison()
        y = ffn(x)
        cp.cuda.Device().synchronize()  # the count copied by this call has arrived
        return y

    y = call(sparse_w["x"])
    assert ffn.last_info["decided_by"] == "probe" and ffn.last_info["mode"] == "sparse"
    mean0 = ffn.last_info["mean_active"]
    assert 6 < mean0 < 24
    assert rel_err(y, ref64(sparse_w, gated)) <= 1e-2
    y = call(sparse_w["x"])
    assert ffn.last_info["decided_by"] == "earlier call" and ffn.last_info["mode"] == "sparse"
    assert ffn.last_info["mean_active"] == pytest.approx(mean0)
    assert rel_err(y, ref64(sparse_w, gated)) <= 1e-2
    # the same weights on inputs that fire about half the neurons (x[:, 0] carries the
    # threshold): this call still decides from the sparse call before it (exact
    # either way), the next one switches to dense
    x_dense = sparse_w["x"].copy()
    x_dense[:, 0] = 0
    w_dense_inputs = dict(sparse_w, x=x_dense)
    y = call(x_dense)
    assert ffn.last_info["mode"] == "sparse" and ffn.last_info["decided_by"] == "earlier call"
    assert rel_err(y, ref64(w_dense_inputs, gated)) <= 1e-2
    y = call(x_dense)
    assert ffn.last_info["mode"] == "dense", ffn.last_info
    assert ffn.last_info["mean_active"] > 100.0
    assert rel_err(y, ref64(w_dense_inputs, gated)) <= 1e-2
    # "always": every call measures its own density again
    ffn.auto_probe = "always"
    y = call(sparse_w["x"])
    assert ffn.last_info["decided_by"] == "probe" and ffn.last_info["mode"] == "sparse"
    assert rel_err(y, ref64(sparse_w, gated)) <= 1e-2
    with pytest.raises(ValueError, match="auto_probe"):
        ffn.auto_probe = "sometimes"


def test_auto_without_probe_still_checks_x():
    w = make_ffn(2000, 128, 512, 10, dtype=np.float32, xp=cp, seed=33)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    ffn(w["x"])
    cp.cuda.Device().synchronize()
    ffn(w["x"])
    assert ffn.last_info["decided_by"] == "earlier call"  # so the next call does not probe either
    x = w["x"].copy()
    x[1234, 5] = cp.inf
    with pytest.raises(ValueError, match="x contains 0 NaN and 1 Inf"):
        ffn(x)
    y = ffn(w["x"])  # the FFN is still usable and exact
    assert rel_err(y, ref64(w)) <= 2e-5


def test_auto_decision_while_the_copy_is_in_flight():
    # many calls queued back to back without a host wait: whichever earlier
    # count has arrived decides; every result is exact
    w = make_ffn(3000, 256, 1024, 12, dtype=bfloat16, xp=cp, seed=34)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], check_finite=False)
    ref = ref64(w)
    ys = [ffn(w["x"]) for _ in range(6)]
    sources = set()
    for y in ys:
        assert rel_err(y, ref) <= 1e-2
    for _ in range(3):
        ffn(w["x"])
        sources.add(ffn.last_info["decided_by"])
    assert sources <= {"earlier call", "earlier decision"}



@pytest.mark.parametrize("case", ["sparse-one-chunk", "sparse-two-streams", "auto-after-first-call", "dense"])
def test_checked_call_does_not_wait_for_its_own_kernels(case, monkeypatch):
    # check_finite=True must raise before returning, but reading the NaN/Inf count
    # may only wait for the count (and what was queued before it), never for the
    # call's own GEMM and sparse kernels: a held kernel queued after the count must
    # not keep the call from returning. The old read (counters.get on the stream)
    # blocked until the hold timed out.
    import threading
    import time

    from _stream_hold import StreamHold

    w = make_ffn(2000, 128, 512, 10, dtype=np.float32, xp=cp, seed=35)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], check_finite=True)
    plan = ffn._plan
    mode = "auto" if case.startswith("auto") else case.split("-")[0]
    if case == "sparse-two-streams":
        plan.chunk_rows = 700
    ref = ref64(w)
    ffn(w["x"], mode=mode)  # compiles, sizes the workspaces, and gives "auto" an earlier density
    cp.cuda.Device().synchronize()
    hold = StreamHold()
    if mode == "dense":
        dense_rows = plan.dense_rows
        seen = {}

        def held_dense_rows(*args, **kwargs):
            seen["stream_still_held"] = int(hold._flag[0]) == 0
            hold.enqueue()  # on the current stream, after the count
            return dense_rows(*args, **kwargs)

        monkeypatch.setattr(plan, "dense_rows", held_dense_rows)
        # held before the call: the GEMMs are queued at once (the old dense path
        # checked x synchronously first, so it waited for the held stream)
        hold.enqueue()
        early = threading.Timer(0.5, hold.release)
        early.start()
        ffn(w["x"], mode=mode)
        early.join()
        cp.cuda.Device().synchronize()
        assert seen["stream_still_held"], "the dense path waited for earlier work before queuing its GEMMs"
        hold.rearm()
    else:
        launch_rowpack = plan._launch_rowpack

        def held_rowpack(g, buf, stream, *args, **kwargs):  # after the gate GEMM
            hold.enqueue(stream)
            return launch_rowpack(g, buf, stream, *args, **kwargs)

        monkeypatch.setattr(plan, "_launch_rowpack", held_rowpack)
    poison()
    t0 = time.perf_counter()
    y = ffn(w["x"], mode=mode)
    returned_after = time.perf_counter() - t0
    hold.release()
    cp.cuda.Device().synchronize()
    assert returned_after < 2.0, f"the checked call waited {returned_after:.2f} s for its own kernels"
    if mode == "auto":
        assert ffn.last_info["decided_by"] in ("earlier call", "earlier decision")
    assert rel_err(y, ref) <= 2e-5
    # a NaN still raises before the call returns, with the hold in place; the error
    # path synchronises the streams (x stays in use until then), so a timer releases
    hold.rearm()
    bad = w["x"].copy()
    bad[1999, 3] = np.nan
    release = threading.Timer(0.2, hold.release)
    release.start()
    with pytest.raises(ValueError, match="x contains 1 NaN and 0 Inf"):
        ffn(bad, mode=mode)
    release.join()
    cp.cuda.Device().synchronize()


def test_calls_on_two_streams_do_not_share_workspaces_too_early(monkeypatch):
    # calls return before their kernels run; a call made right after on another
    # stream must wait for them before it rewrites the shared workspaces (g, the
    # row lists, the counters). Stream 1's call is held between its gate GEMM and
    # its row pack: without the wait, stream 2's gate GEMM would overwrite g first.
    from _stream_hold import StreamHold

    w = make_ffn(3000, 256, 1024, 12, dtype=np.float32, xp=cp, seed=36)
    other = dict(w, x=cp.ascontiguousarray(w["x"][::-1]) * 0.5)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], mode="sparse", check_finite=False)
    ffn(w["x"])
    cp.cuda.Device().synchronize()
    plan = ffn._plan
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    hold = StreamHold()
    launch_rowpack = plan._launch_rowpack
    held = []

    def rowpack_held_once(g, buf, stream, *args, **kwargs):
        if not held:
            held.append(1)
            hold.enqueue(stream)
        return launch_rowpack(g, buf, stream, *args, **kwargs)

    monkeypatch.setattr(plan, "_launch_rowpack", rowpack_held_once)
    poison()
    with s1:
        y1 = ffn(w["x"])
    with s2:
        y2 = ffn(other["x"])
    hold.release()
    cp.cuda.Device().synchronize()
    assert held
    assert rel_err(y1, ref64(w)) <= 2e-5
    assert rel_err(y2, ref64(other)) <= 2e-5


def test_auto_follows_a_change_of_density_without_waiting():
    # back-to-back "auto" calls with no host wait: once the inputs turn dense, a
    # later call must see an arrived count and switch (the copy in flight is not
    # re-recorded by every call, which would keep it from ever arriving)
    w = make_ffn(3000, 256, 1024, 12, dtype=bfloat16, xp=cp, seed=37)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], check_finite=False)
    ffn.auto_threshold = 100.0
    ffn(w["x"])
    cp.cuda.Device().synchronize()
    assert ffn.last_info["mode"] == "sparse"
    x_dense = w["x"].copy()
    x_dense[:, 0] = 0                       # about half the neurons fire
    modes = []
    for _ in range(40):
        ffn(x_dense)
        modes.append(ffn.last_info["mode"])
        if modes[-1] == "dense":
            break
    assert modes[-1] == "dense", f"auto never switched: {modes}"
    assert rel_err(ffn(x_dense), ref64(dict(w, x=x_dense))) <= 1e-2


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("chunk_rows,heavy_limit", [(None, None), (700, None), (None, 256)],
                         ids=["one-chunk", "two-streams", "hand-off"])
@pytest.mark.parametrize("second", ["split", "two_pass"])
def test_split_sparse_steps_give_the_fused_bits(monkeypatch, dtype, gated, chunk_rows, heavy_limit, second):
    """The sparse step in two kernels (up projection of the list rows, then their
    down projection: by twellpy_spmm_resident in split mode, by twellpy_ffn_list_down's
    gathers in two-pass mode) against the fused kernel: the same y and h bits on
    uneven data (sigma 0.3), with a token firing 2000 neurons (longer than its row
    list: computed by the long-row kernels, or whole by the first kernel under the
    hand-off), empty tokens, the two-stream pipeline and the heavy-row hand-off;
    outputs poisoned first."""
    from twellpy.backends import cuda, cuda_ffn

    monkeypatch.setattr(cuda_ffn, "TWO_PASS_MIN_ROWS", 1)   # the pipeline's 700-row chunks too
    M = 1500 if os.environ.get("TWELLPY_SANITIZE") == "1" else 2600
    w = make_ffn(M, 256, 2304, 12, sigma=0.3, gated=gated, dtype=dtype, xp=cp, seed=91)
    x = w["x"].copy()
    x[5, 1:] = 0.0
    x[5, 0] = -50.0                              # token 5 fires every neuron whose threshold column allows
    x[9] = 0.0                                   # token 9 fires none
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"]) if gated else ReluFFN(w["w_up"], w["w_down"])
    ffn.heavy_limit = heavy_limit
    plan = ffn._plan
    plan.chunk_rows = chunk_rows
    kinds, kernel, resident = [], plan._kernel, cuda._resident_spmm

    def spied_kernel(kind):
        kinds.append(kind)
        return kernel(kind)

    def spied_resident(*a, **k):
        kinds.append("resident")
        return resident(*a, **k)

    monkeypatch.setattr(plan, "_kernel", spied_kernel)
    monkeypatch.setattr(cuda, "_resident_spmm", spied_resident)
    outs = {}
    for on in (False, True):
        plan.split_down, plan.two_pass = (on, False) if second == "split" else (False, on)
        kinds.clear()
        poison()
        y, h = ffn(x, mode="sparse", return_activations=True)
        outs[on] = (y, h.toarray())
        assert ffn.last_info["mode"] == "sparse"
        second_kernel = "resident" if second == "split" else "list_down"
        assert (second_kernel in kinds) == on and any(k.endswith("_split") for k in kinds) == on, kinds
    (y0, h0), (y1, h1) = outs[False], outs[True]
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    assert bool((y1.view(u) == y0.view(u)).all()), f"{second} and fused y differ"
    assert bool((h1.view(u) == h0.view(u)).all()), f"{second} and fused h differ"
    ref = ref64(dict(w, x=x), gated)
    assert rel_err(y1, ref) <= TOL[np.dtype(dtype)] * (5 if np.dtype(dtype).itemsize == 2 else 1)
    assert int(cp.count_nonzero(h1[5])) > 512    # the long token really was longer than its list
    assert not bool(y1[9].any())


def test_two_pass_choice(monkeypatch):
    """two_pass runs from TWO_PASS_MIN_ROWS rows with row lists; TWELLPY_FFN_TWO_PASS
    is checked."""
    from twellpy.backends import cuda_ffn

    w = make_ffn(8, 256, 1024, 10, dtype=bfloat16, xp=cp, seed=94)
    plan = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])._plan
    assert plan.two_pass is False                          # off: measured no faster
    plan.two_pass = True
    n = cuda_ffn.TWO_PASS_MIN_ROWS
    assert plan._two_pass_on(n, 0) and not plan._two_pass_on(n - 1, 0) and not plan._two_pass_on(n, None)
    plan.two_pass = False
    assert not plan._two_pass_on(n, 0)
    monkeypatch.setenv("TWELLPY_FFN_TWO_PASS", "yes")
    with pytest.raises(ValueError, match="TWELLPY_FFN_TWO_PASS must be 0 or 1, got 'yes'"):
        GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    monkeypatch.setenv("TWELLPY_FFN_TWO_PASS", "1")
    assert GatedFFN(w["w_gate"], w["w_up"], w["w_down"])._plan.two_pass is True


def test_split_mode_choice():
    """"auto" splits from cuda.RESIDENT_MIN_ROWS rows when a slice of w_downT fits;
    False never; True always (a slice fits here)."""
    from twellpy.backends import cuda

    w = make_ffn(8, 256, 1024, 10, dtype=bfloat16, xp=cp, seed=92)
    plan = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])._plan
    y = cp.empty((cuda.RESIDENT_MIN_ROWS, 256), bfloat16)
    plan.split_down = "auto"
    assert plan._split_plan(cuda.RESIDENT_MIN_ROWS, y, 0) is not None
    assert plan._split_plan(cuda.RESIDENT_MIN_ROWS - 1, y[:-1], 0) is None
    plan.split_down = False
    assert plan._split_plan(cuda.RESIDENT_MIN_ROWS, y, 0) is None
    plan.split_down = True
    assert plan._split_plan(3, y[:3], 0) is not None
    assert plan._split_plan(3, y[:3], None) is None        # no row lists: nothing to split


@pytest.mark.skipif(os.environ.get("TWELLPY_SANITIZE") == "1",
                    reason="without CuPy's pool (TWELLPY_SANITIZE) every cudaFree inside the call waits for the "
                           "device, so the call cannot return while held, and no pool can hand the workspaces out")
def test_dropping_an_ffn_waits_for_its_last_call_on_another_stream():
    """A plan dropped while its last call (on another stream) still runs waits for that call:
    its workspaces go back to the free list of the stream that allocated them, where the next
    allocation could take them while the other stream's kernels still write them."""
    import gc
    import threading

    from _stream_hold import StreamHold

    w = make_ffn(600, 128, 512, 10, dtype=np.float32, xp=cp, seed=36)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    ffn(w["x"], mode="sparse")  # workspaces allocated on the current stream
    cp.cuda.Device().synchronize()
    hold = StreamHold()
    plan = ffn._plan
    launch_rowpack = plan._launch_rowpack

    def held_rowpack(g, buf, stream, *args, **kwargs):
        # after the NaN/Inf count the call waits for: the call returns while this is held
        hold.enqueue(stream)
        return launch_rowpack(g, buf, stream, *args, **kwargs)

    plan._launch_rowpack = held_rowpack
    other = cp.cuda.Stream(non_blocking=True)
    with other:
        ffn(w["x"], mode="sparse")
    done = plan._done
    del plan._launch_rowpack  # the class's method again: no reference cycle keeps the plan alive
    del plan, launch_rowpack, held_rowpack
    assert not done.done, "the held call finished early: the test proves nothing"
    release = threading.Timer(0.3, hold.release)
    release.start()
    del ffn
    gc.collect()  # in case a reference cycle keeps the plan alive past the del
    assert done.done, "the dropped plan did not wait for its last call"
    release.join()
    cp.cuda.Device().synchronize()


@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two GPUs")
def test_ffn_on_the_second_gpu_with_the_first_current():
    """Weights and x on cuda:1 while cuda:0 is current: the call runs on cuda:1 (its events,
    streams and workspaces are the plan's device's), y lands there and matches float64."""
    with cp.cuda.Device(1):
        w = to_gpu(make_ffn(700, 128, 512, 10, dtype=np.float32, xp=np, seed=37))
        ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    with cp.cuda.Device(0):
        for mode in ("sparse", "auto", "auto"):
            y = ffn(w["x"], mode=mode)
            assert y.device.id == 1
        act = ffn.activity()
    assert act["mean_active"] is not None
    with cp.cuda.Device(1):
        assert rel_err(y, ref64(w)) <= TOL[np.dtype(np.float32)]


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("M, H", [(1, 1000), (2, 1000), (3, 1000), (8, 1000), (16, 1000), (3, 5632)])
def test_decode_kernels_match_float64_reference(M, H, gated, dtype):
    # calls of at most decode_rows rows run the two decode kernels (ffn_decode.cu; 16 here,
    # to cover every instantiation); the general path (decode_rows = 0) gives the same
    # result within the dtype's tolerance. H = 5632: the down kernel lists the active
    # neurons in three windows of 2048
    w = to_gpu(make_ffn(M, 256, H, 30, sigma=0.3, gated=gated, dtype=dtype, xp=np, seed=80 + M))
    if M >= 3:
        w["x"][1] = 0           # an empty row: nothing fires
        w["x"][2, 0] = -40.0    # column 0 of w_gate (w_up) holds -threshold: this row fires every neuron
    cls = GatedFFN if gated else ReluFFN
    ffn = cls(*((w["w_gate"],) if gated else ()), w["w_up"], w["w_down"])
    ffn.decode_rows = 16
    ref = ref64(w, gated)
    poison()
    y = ffn(w["x"])
    assert ffn.last_info["kernel"] == "decode" and ffn.last_info["mode"] == "sparse"
    assert rel_err(y, ref) <= TOL[dtype]
    if M >= 3:
        assert not bool(y[1].astype(cp.float32).any())
        assert rel_err(y[2], ref[2]) <= TOL[dtype]
    # activity statistics come from the gate kernel's counts
    g = cp.asarray(w["x"]).astype(cp.float64) @ cp.asarray(w["w_gate"] if gated else w["w_up"]).astype(cp.float64).T
    want = float((g > 0).sum()) / M
    assert abs(ffn.activity()["mean_active"] - want) <= 0.01 * want + 1.0 / M
    if M >= 3:
        assert ffn.activity()["mean_active"] * M > 0.9 * H  # the heavy row is counted, not dropped
    poison()
    y2 = ffn(w["x"])
    assert bool((y2.view(cp.uint8) == y.view(cp.uint8)).all())  # same bits every call
    ffn.decode_rows = 0
    y_general = ffn(w["x"])
    assert "kernel" not in ffn.last_info
    assert rel_err(y_general, ref) <= TOL[dtype]


def test_decode_path_choice_and_return_activations():
    w = to_gpu(make_ffn(17, 4096, 2048, 30, dtype=bfloat16, xp=np, seed=90))
    ref = ref64(w)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    poison()
    y = ffn(w["x"][:4])                                  # 4 * 4096 * 2 bytes = 32 KB of x: decode
    assert ffn.last_info.get("kernel") == "decode" and rel_err(y, ref[:4]) <= 1e-2
    y = ffn(w["x"][:5])                                  # over the default decode_rows (4): general path
    assert "kernel" not in ffn.last_info and rel_err(y, ref[:5]) <= 1e-2
    ffn.decode_rows = 16
    poison()
    y = ffn(w["x"][:16])                                 # 128 KB: decode, the kernel allowed it first
    assert ffn.last_info.get("kernel") == "decode" and rel_err(y, ref[:16]) <= 1e-2
    ffn(w["x"])                                          # 17 rows: general path
    assert "kernel" not in ffn.last_info
    ffn(w["x"][:1], mode="dense")
    assert ffn.last_info["mode"] == "dense" and "kernel" not in ffn.last_info
    ffn.heavy_limit = 256                                # heavy-row accounting asked for: general path
    ffn(w["x"][:1])
    assert "kernel" not in ffn.last_info
    ffn.heavy_limit = None
    with pytest.raises(ValueError, match="decode_rows must be an int in"):
        ffn.decode_rows = 129
    # x of exactly 48 KB (bf16, D = 3072, M = 8): over what needs no opt-in (static shared
    # memory too), so the kernel's attribute is raised; M = 7 needs none
    w3 = make_ffn(8, 3072, 512, 10, dtype=bfloat16, xp=cp, seed=92)
    f3 = GatedFFN(w3["w_gate"], w3["w_up"], w3["w_down"])
    f3.decode_rows = 8
    assert rel_err(f3(w3["x"][:7]), ref64(w3)[:7]) <= 1e-2 and f3.last_info["kernel"] == "decode"
    assert rel_err(f3(w3["x"]), ref64(w3)) <= 1e-2 and f3.last_info["kernel"] == "decode"
    # more x than any block may hold (fp32, D = 8192, 16 rows: 512 KB): general path
    w4 = make_ffn(16, 8192, 256, 10, dtype=np.float32, xp=cp, seed=94)
    f4 = GatedFFN(w4["w_gate"], w4["w_up"], w4["w_down"])
    assert rel_err(f4(w4["x"]), ref64(w4)) <= TOL[np.dtype(np.float32)] and "kernel" not in f4.last_info
    # return_activations: the h the decode kernel writes, as the container
    x = w["x"][:3]
    poison()
    y, h = ffn(x, return_activations=True)
    assert ffn.last_info["kernel"] == "decode"
    x64 = x.astype(cp.float64)
    g64 = (x64 @ w["w_gate"].astype(cp.float64).T).astype(cp.float32).astype(bfloat16).astype(cp.float64)
    h_ref = cp.where(g64 <= 0, 0, g64 * (x64 @ w["w_up"].astype(cp.float64).T))
    assert rel_err(cp.asarray(h.toarray()), h_ref) <= 1e-2
    assert bool((ffn(x).view(cp.uint16) == y.view(cp.uint16)).all())  # the same y without h
    assert rel_err(y, ref64({k: v[:3] if k == "x" else v for k, v in w.items()})) <= 1e-2


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("M", [17, 33, 100, 128])
@pytest.mark.parametrize("gated", [True, False])
def test_decode_kernels_in_row_groups(M, gated, dtype):
    # decode_rows up to 128: calls of more than 16 rows run in groups of 16 rows (a grid
    # dimension of both kernels); an empty row in group 0 and a row firing every neuron in
    # the last group; the activity count and a NaN in the last group cover every group
    w = to_gpu(make_ffn(M, 512, 5632, 30, sigma=0.3, gated=gated, dtype=dtype, xp=np, seed=300 + M))
    w["x"][5] = 0                        # group 0: nothing fires
    w["x"][M - 1, 0] = -40.0             # last group: every neuron fires (column 0 holds -threshold)
    cls = GatedFFN if gated else ReluFFN
    ffn = cls(*((w["w_gate"],) if gated else ()), w["w_up"], w["w_down"])
    ffn.decode_rows = 128
    ref = ref64(w, gated)
    poison()
    y, h = ffn(w["x"], return_activations=True)
    assert ffn.last_info["kernel"] == "decode" and ffn.last_info["mode"] == "sparse"
    assert rel_err(y, ref) <= TOL[dtype]
    for m in sorted({0, 15, 16, M - 2, M - 1} - {5}):
        assert rel_err(y[m], ref[m]) <= TOL[dtype], m
    assert not bool(y[5].astype(cp.float32).any())
    x64 = cp.asarray(w["x"]).astype(cp.float64)
    g = x64 @ cp.asarray(w["w_gate"] if gated else w["w_up"]).astype(cp.float64).T
    h_ref = cp.where(g <= 0, 0, g * (x64 @ cp.asarray(w["w_up"]).astype(cp.float64).T) if gated else g)
    assert rel_err(cp.asarray(h.toarray()), h_ref) <= TOL[dtype]
    want = float((g > 0).sum()) / M
    assert abs(ffn.activity()["mean_active"] - want) <= 0.01 * want + 1.0 / M
    poison()
    assert bool((ffn(w["x"]).view(cp.uint8) == y.view(cp.uint8)).all())  # same bits every call
    ffn.decode_rows = 16
    y_general = ffn(w["x"])
    assert "kernel" not in ffn.last_info and rel_err(y_general, ref) <= TOL[dtype]
    ffn.decode_rows = 128
    x_bad = cp.asarray(w["x"]).copy()
    x_bad[M - 1, 5] = cp.nan
    with pytest.raises(ValueError, match="x"):
        ffn(x_bad, check_finite="sync")


def test_decode_workspace_grows_across_sizes_and_streams():
    # one object, calls of growing and shrinking size (1, 40, 128, 17, 3 rows) alternating
    # two streams: the grow-only decode workspace is replaced while the previous call's
    # kernels may still run on the other stream, which it must wait for
    w = make_ffn(128, 1024, 2048, 20, dtype=bfloat16, xp=cp, seed=333)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    ffn.decode_rows = 128
    ref = ref64(w)
    streams = [cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)]
    outs = []
    for i, m in enumerate((1, 40, 128, 17, 3)):
        with streams[i % 2]:
            poison()
            outs.append((m, ffn(w["x"][:m])))
            assert ffn.last_info["kernel"] == "decode"
    for s_ in streams:
        s_.synchronize()
    for m, y in outs:
        assert rel_err(y, ref[:m]) <= 1e-2, m


def test_decode_call_on_a_second_stream_and_a_nan_count():
    # the gate kernel writes the NaN/Inf count itself (no count kernel): a waiting call
    # raises, a deferred one is reported by the next call, across streams
    w = to_gpu(make_ffn(2, 128, 512, 12, dtype=np.float32, xp=np, seed=91))
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    bad = w["x"].copy()
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="x contains 1 NaN and 0 Inf"):
        ffn(bad)                                          # the first call waits
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        y_bad = ffn(bad)                                  # deferred
        assert ffn.last_info["finite_check"] == "deferred" and ffn.last_info["kernel"] == "decode"
    s.synchronize()
    assert bool(cp.isnan(y_bad[1]).all()) and rel_err(y_bad[0], ref64(w)[0]) <= 2e-5
    with pytest.raises(ValueError, match=r"call 2, 2 rows\) contains 1 NaN"):
        ffn(w["x"])
    poison()
    assert rel_err(ffn(w["x"]), ref64(w)) <= 2e-5


def test_decode_path_with_misaligned_weights_and_non_finite_inactive_weights():
    # weights given as views at an odd offset are copied to aligned storage (16-byte loads);
    # an inactive neuron contributes nothing even with NaN up weights or a NaN down column,
    # and an active one with h = 0 still meets its down column (0 * NaN), as on the general path
    w = make_ffn(2, 256, 512, 20, dtype=bfloat16, xp=np, seed=93)  # H = 512, D = 256
    x, wg, wu, wd = (w[k].astype(np.float32) for k in ("x", "w_gate", "w_up", "w_down"))
    x[0, 1], x[1, 1] = 1.0, -1.0
    wg[5] = 0.0
    wg[5, 1] = 1.0                      # neuron 5: active in row 0 only
    wg[7] = 0.0
    wg[7, 1] = -1.0                     # neuron 7: active in row 1 only
    wu[5, 3] = np.nan
    wu[7] = 0.0                         # h = 0 in row 1
    wd[:, 7] = np.nan
    def odd(a):  # a copy of a (numpy) 2 bytes past an aligned address
        raw = cp.zeros(a.size + 1, bfloat16)
        view = raw[1:].reshape(a.shape)
        view[...] = cp.asarray(a.astype(bfloat16))
        assert view.data.ptr % 16
        return view

    def both(wu_, wd_):  # (decode, general) FFNs on weights at odd offsets
        fs = [GatedFFN(odd(wg), odd(wu_), cp.asarray(wd_.astype(bfloat16)), check_finite=False, mode="sparse")
              for _ in range(2)]
        fs[1].decode_rows = 0
        return fs

    xg = cp.asarray(x.astype(bfloat16))
    ffn, general = both(wu, wd)
    y = ffn(xg)
    assert ffn.last_info["kernel"] == "decode"
    assert bool(cp.isnan(y[0]).all()) and bool(cp.isnan(y[1]).all())
    assert bool(cp.isnan(general(xg)).all())     # the general path agrees
    wu_clean = wu.copy()
    wu_clean[5, 3] = 0.0
    ref = reference_ffn(x.astype(bfloat16), wg.astype(bfloat16), wu_clean.astype(bfloat16),
                        np.nan_to_num(wd, nan=1.0).astype(bfloat16), dtype=np.float64)
    wd_ok = wd.copy()
    wd_ok[:, 7] = 1.0                   # only the NaN up row left: row 1 is finite and exact
    ffn, general = both(wu, wd_ok)
    y = ffn(xg)
    assert bool(cp.isnan(y[0]).all()) and rel_err(y[1], ref[1]) <= 1e-2
    assert bool(cp.isnan(general(xg)[0]).all())
    # only the NaN down column left (neuron 7 is inactive in row 0, active with h = 0 in
    # row 1): row 1 is NaN, row 0 finite and exact; a kernel adding neuron 7 to every row fails
    ffn, general = both(wu_clean, wd)
    y, y_gen = ffn(xg), general(xg)
    assert bool(cp.isnan(y[1]).all()) and bool(cp.isnan(y_gen[1]).all())
    assert rel_err(y[0], ref[0]) <= 1e-2 and rel_err(y_gen[0], ref[0]) <= 1e-2


@pytest.mark.parametrize("gated", [True, False])
def test_plan_keeps_one_copy_of_the_down_projection(gated):
    """The plan held w_down and its transpose w_downT (two D x H copies); the dense path now
    multiplies by w_downT too (gemm_nn). Dense, sparse and auto calls still match the float64
    reference, and an F-ordered caller's w_down (whose .T is C-contiguous, a view) is copied,
    so an in-place change after construction reaches nothing."""
    w = to_gpu(make_ffn(257, 128, 512, 20, sigma=0.2, gated=gated, dtype=np.float32, xp=np, seed=41))
    w_down_f = cp.asfortranarray(w["w_down"])
    ffn = (GatedFFN(w["w_gate"], w["w_up"], w_down_f) if gated else ReluFFN(w["w_up"], w_down_f))
    plan = ffn._plan
    assert plan.w_down is None and plan.w_downT.shape == (512, 128) and plan.w_downT.flags.c_contiguous
    assert plan.w_downT.data.ptr != w_down_f.data.ptr
    want = ref64(w, gated)
    w_down_f[...] = cp.nan  # the caller's array changes after construction: the plan kept its own copy
    for mode in ("dense", "sparse", "auto"):
        poison()
        y = ffn(w["x"], mode=mode)
        assert rel_err(y, want) < TOL[np.dtype(np.float32)], mode


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("M, chunk_rows", [(1, None), (17, None), (300, None), (2600, 700)],
                         ids=["M1", "M17", "M300", "two-streams"])
def test_long_rows_spread_over_blocks_match_the_serial_path(dtype, gated, M, chunk_rows):
    """Tokens firing more neurons than a row list holds (LIST_ROW_CAP) run through
    ffn_long.cu by default: the other rows keep the serial path's bits exactly, the long
    rows (every neuron, about 2000, just over the cap) match the float64 reference, h of
    return_activations matches it too, and a second call gives the same bits. The
    general path at every size (decode kernels off), both FFN kinds, every dtype, the
    two-stream pipeline."""
    from twellpy.backends.cuda_ffn import LIST_ROW_CAP

    H = 4608                                     # > 4096: the down kernel reads a mask in two rounds
    w = make_ffn(M, 256, H, 12, gated=gated, dtype=dtype, xp=cp, seed=93 + M)
    x = w["x"].copy()
    pre = (w["w_gate"] if gated else w["w_up"]).astype(cp.float32)
    x[0, 0] = -50.0                              # token 0: every neuron
    if M > 2:
        x[M // 2, 0] = 0.0                       # no threshold: about half the neurons
        # token M - 1: about 600, just over the cap (x[:, 0] carries the threshold -w[:, 0])
        r = M - 1
        rest = x[r].astype(cp.float32) @ pre.T - x[r, 0].astype(cp.float32) * pre[:, 0]
        ratio = cp.sort(rest / -pre[:, 0])[::-1]
        x[r, 0] = float(ratio[LIST_ROW_CAP + 90])
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"]) if gated else ReluFFN(w["w_up"], w["w_down"])
    ffn.decode_rows = 0
    ffn._plan.chunk_rows = chunk_rows
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    outs = {}
    for long_rows in (False, True):
        ffn._plan.long_rows = long_rows
        poison()
        y, h = ffn(x, mode="sparse", return_activations=True)
        outs[long_rows] = (y, cp.asarray(h.toarray()))
    (y0, h0), (y1, h1) = outs[False], outs[True]
    fired = (x.astype(cp.float32) @ pre.T > 0).sum(axis=1)
    long = fired > LIST_ROW_CAP
    assert bool(long[0]) and int(fired[0]) == H
    if M > 2:
        assert LIST_ROW_CAP < int(fired[M - 1]) < 2 * LIST_ROW_CAP and int(fired[M // 2]) > 1000
    short = ~long
    assert bool((y1[short].view(u) == y0[short].view(u)).all()), "rows within their list changed bits"
    ref = cp.asarray(ref64(dict(w, x=x), gated))
    tol = TOL[np.dtype(dtype)] * (5 if np.dtype(dtype).itemsize == 2 else 1)
    assert rel_err(y1[long], ref[long]) <= tol
    assert rel_err(y1, ref) <= tol
    x64 = x.astype(cp.float64)
    g = x64 @ (w["w_gate"] if gated else w["w_up"]).astype(cp.float64).T
    h_ref = cp.where(g <= 0, 0, g * (x64 @ w["w_up"].astype(cp.float64).T) if gated else g)
    assert rel_err(h1[long], h_ref[long]) <= tol
    assert bool((h1[short].view(u) == h0[short].view(u)).all())
    poison()
    y2 = ffn(x, mode="sparse")
    assert bool((y2.view(u) == y1.view(u)).all()), "long rows are not deterministic"


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("M, chunk_rows", [(300, None), (2600, 700)], ids=["M300", "two-streams"])
def test_long_rows_in_three_launches_give_the_same_bits(dtype, gated, M, chunk_rows, monkeypatch):
    """long_launches = 3 (scan, up work, down work as three launches, no waiting between blocks; what the
    sanitizer runs use) gives exactly the one-launch bits of y and h, three long rows
    among ordinary ones, the two-stream pipeline too; TWELLPY_FFN_LONG_LAUNCHES sets
    the default and rejects other values."""
    w = make_ffn(M, 256, 4608, 12, gated=gated, dtype=dtype, xp=cp, seed=61 + M)
    x = w["x"].copy()
    x[0, 0] = x[M // 2, 0] = x[M - 1, 0] = -50.0       # three tokens firing every neuron
    make = lambda: GatedFFN(w["w_gate"], w["w_up"], w["w_down"]) if gated else ReluFFN(w["w_up"], w["w_down"])  # noqa: E731
    monkeypatch.delenv("TWELLPY_FFN_LONG_LAUNCHES", raising=False)  # the default, even in a run that sets it
    ffn = make()
    assert ffn._plan.long_launches == 1
    ffn.decode_rows = 0
    ffn._plan.chunk_rows = chunk_rows
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    outs = []
    for launches in (1, 3):
        ffn._plan.long_launches = launches
        poison()
        y, h = ffn(x, mode="sparse", return_activations=True)
        outs.append((y, cp.asarray(h.toarray())))
    assert not bool(ffn._plan._ws["long_state"].any()), "the last block zeroes the state for the next call"
    assert bool((outs[1][0].view(u) == outs[0][0].view(u)).all()), "y: three launches, other bits"
    assert bool((outs[1][1].view(u) == outs[0][1].view(u)).all()), "h: three launches, other bits"
    tol = TOL[np.dtype(dtype)] * (5 if np.dtype(dtype).itemsize == 2 else 1)
    assert rel_err(outs[1][0], cp.asarray(ref64(dict(w, x=x), gated))) <= tol
    monkeypatch.setenv("TWELLPY_FFN_LONG_LAUNCHES", "3")
    assert make()._plan.long_launches == 3
    monkeypatch.setenv("TWELLPY_FFN_LONG_LAUNCHES", "2")
    with pytest.raises(ValueError, match="TWELLPY_FFN_LONG_LAUNCHES must be 1 or 3"):
        make()


def test_long_rows_off_with_the_heavy_row_hand_off():
    """heavy_limit hands rows over the limit to the host's dense sub-FFN: the long-row
    kernels stay out of it (both results exact, no long-row launch)."""
    w = make_ffn(600, 256, 2304, 12, dtype=bfloat16, xp=cp, seed=97)
    x = w["x"].copy()
    x[3, 0] = -50.0
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    ffn.heavy_limit = 256
    launched = []
    real = ffn._plan._launch_long
    ffn._plan._launch_long = lambda *a, **k: (launched.append(1), real(*a, **k))
    poison()
    y = ffn(x, mode="sparse")
    assert not launched and ffn.last_info["heavy_rows"] >= 1
    assert rel_err(y, ref64(dict(w, x=x))) <= 1e-2
    ffn.heavy_limit = None
    poison()
    y = ffn(x, mode="sparse")
    assert launched and rel_err(y, ref64(dict(w, x=x))) <= 1e-2


# ---------------------------------------------------------------------------
# CUDA graphs of decode-size calls (graphs=True): the ordinary path's bits, one launch
def _graph_twins(w, gated, **kw):
    """(FFN with graphs, FFN without) on the same weights."""
    cls = GatedFFN if gated else ReluFFN
    args = ((w["w_gate"],) if gated else ()) + (w["w_up"], w["w_down"])
    return cls(*args, graphs=True, **kw), cls(*args, graphs=False, **kw)


def _inputs(M, D, dtype, k, hot=True):
    """The k-th x of a call sequence: other values each call (a graph replaying a stale x
    fails), and for M >= 3 one token firing every neuron (ffn_long.cu inside the graph)."""
    from benchmarks.workloads import make_inputs

    x = make_inputs(M, D, sigma=0.3, xp=cp, seed=900 + 7 * k + M)
    if hot and M >= 3:
        x[(k + 1) % M, 0] = -40.0  # column 0 of the gate weights holds -threshold
    return x.astype(dtype)


def _same_bits(a, b):
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return a.shape == b.shape and a.dtype == b.dtype and bool((a.view(u) == b.view(u)).all())


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("M", [1, 3, 16, 100, 128])
def test_graph_replay_gives_the_ordinary_bits(M, gated, dtype):
    """Calls with graphs give the bits of the same calls without: the decode kernels (M <= 8),
    the general sparse path (16-128 rows, long rows included) and the dense path, checked
    and unchecked, each on new x values every call, on poisoned memory."""
    w = make_ffn(M, 256, 1024, 20, sigma=0.3, gated=gated, dtype=dtype, xp=cp, seed=500 + M)
    ffn, plain = _graph_twins(w, gated)
    k = 0
    # dense first: the first calls of the other modes size more workspaces (heavy flags),
    # which drops the graphs made before; "sparse" last, replaying the "auto" graphs
    for mode in ("dense", "auto", "sparse"):
        for check in (False, True):
            seen = []
            for _ in range(4):
                x = _inputs(M, 256, dtype, k)
                k += 1
                poison()
                y = ffn(x, mode=mode, check_finite=check)
                seen.append(ffn.last_info["graph"])
                want = plain(x, mode=mode, check_finite=check)
                assert _same_bits(y, want), (mode, check, seen[-1])
                assert ffn.last_info["mode"] == plain.last_info["mode"]
                assert ffn.last_info.get("kernel") == plain.last_info.get("kernel")
            # "auto" and "sparse" share one graph (auto never probes at these sizes)
            first = ["warm-up", "capture"] if mode != "sparse" else []
            assert seen == first + ["replay"] * (4 - len(first)), (mode, check, seen)
    assert (ffn.last_info.get("kernel") == "decode") == (M <= 8)
    assert rel_err(ffn(x), ref64(dict(w, x=x), gated)) <= TOL[np.dtype(dtype)] * (5 if dtype != np.float64 else 1)
    # activity statistics come from the graph's own kernels, as on the ordinary path
    ffn(x, mode="sparse")
    plain(x, mode="sparse")
    assert ffn.activity() == plain.activity()


@pytest.mark.parametrize("M", [1, 16, 128])
def test_graph_calls_keep_the_finite_check(M):
    """The NaN/Inf count of x is made inside the graph and read outside it on the ordinary
    schedule: deferred calls are reported by the next call or check(), "sync" calls raise
    themselves, check_finite=False lets NaN through; the graph's output is never shared."""
    w = make_ffn(M, 128, 512, 12, dtype=np.float32, xp=cp, seed=77 + M)
    ffn, plain = _graph_twins(w, True)
    bad = w["x"].copy()
    bad[M - 1, 3] = np.nan
    ffn(w["x"])                                       # call 1 waits (warm-up)
    y2 = ffn(w["x"])                                  # call 2 captures
    y3 = ffn(w["x"])                                  # call 3 replays
    assert ffn.last_info["graph"] == "replay" and ffn.last_info["finite_check"] == "deferred"
    assert y3.data.ptr != y2.data.ptr and _same_bits(y3, plain(w["x"]))
    y_bad = ffn(bad)                                  # call 4: deferred, replayed
    assert ffn.last_info["graph"] == "replay" and bool(cp.isnan(y_bad[M - 1]).all())
    assert _same_bits(y3, plain(w["x"]))              # an earlier result is not overwritten
    with pytest.raises(ValueError, match=rf"call 4, {M} rows\) contains 1 NaN"):
        ffn(w["x"])                                   # call 5 reports call 4
    ffn(bad)                                          # call 6
    with pytest.raises(ValueError, match=r"call 6,"):
        ffn.check()
    for _ in range(12):                               # more calls than the ring of counts holds
        ffn(w["x"])
    ffn.check()
    # more replays than the ledger's ring of published counts holds, one bad among them:
    # reported by whichever later call finds it landed, or by check()
    from twellpy.backends.cuda import NonfiniteLedger

    first = ffn._plan._calls + 1
    with pytest.raises(ValueError, match=rf"call {first + 40}, {M} rows\) contains 1 NaN"):
        for k in range(NonfiniteLedger.RING + 6):
            ffn(bad if k == 40 else w["x"])
        ffn.check()
    ffn.check()
    # an ordinary (not replayed) deferred call and a replay, both bad: each reported once,
    # oldest first (together when both land before a collection, else one by one)
    reports = []

    def run(fn):
        try:
            return fn()
        except ValueError as exc:  # an earlier call reported at this one's start: it did not run
            reports.append(str(exc))
            return fn()

    run(lambda: ffn(bad, return_activations=True))
    assert ffn.last_info["graph"].startswith("fallback")
    n_ordinary = ffn._plan._calls
    run(lambda: ffn(bad))
    assert ffn.last_info["graph"] == "replay"
    n_replay = ffn._plan._calls
    try:
        ffn.check()
    except ValueError as exc:
        reports.append(str(exc))
    ffn.check()
    named = []
    for msg in reports:
        calls = [int(re.search(r"\(call (\d+),", msg).group(1))]
        more = re.search(r"and the x of calls ([\d, ]+)\)", msg)
        calls += [int(c) for c in more.group(1).split(", ")] if more else []
        assert calls == sorted(calls), msg
        named += calls
    assert named == [n_ordinary, n_replay], reports
    # the dense graph publishes its count too
    ffn(w["x"], mode="dense")                         # warm-up of the dense signature
    ffn(w["x"], mode="dense")                         # capture
    ffn(bad, mode="dense")
    assert ffn.last_info["graph"] == "replay" and ffn.last_info["mode"] == "dense"
    with pytest.raises(ValueError, match=rf"call {ffn._plan._calls}, {M} rows\)"):
        ffn.check()
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        ffn(bad, check_finite="sync")                 # same graph as the deferred calls: waits, raises
    assert _same_bits(ffn(w["x"], check_finite="sync"), plain(w["x"]))
    assert ffn.last_info["graph"] == "replay" and ffn.last_info["finite_check"] == "waited"
    ffn(bad, check_finite=False)
    y_nan = ffn(bad, check_finite=False)              # a graph without the count
    assert ffn.last_info["graph"] == "capture" and bool(cp.isnan(y_nan[M - 1]).all())
    ffn.check()


def test_graph_inputs_of_any_layout_and_fresh_outputs():
    """x given as a strided view or F-ordered is copied into the graph's input like a
    C-ordered one; each call's y is its own array (an old y keeps its values)."""
    w = make_ffn(16, 256, 1024, 20, dtype=bfloat16, xp=cp, seed=61)
    ffn, plain = _graph_twins(w, True)
    outs = []
    for k in range(6):
        x = _inputs(16, 256, bfloat16, k)
        big = cp.zeros((16, 512), bfloat16)
        big[:, ::2] = x
        layouts = (x, big[:, ::2], cp.asfortranarray(x))
        xin = layouts[k % 3]
        assert xin.flags.c_contiguous == (k % 3 == 0)
        poison()
        y = ffn(xin)
        assert _same_bits(y, plain(x))
        outs.append((y, plain(x)))
    assert ffn.last_info["graph"] == "replay"
    for y, want in outs:
        assert _same_bits(y, want)


def test_graph_for_an_auto_plan_changing_shape():
    """One "auto" object called at decode sizes and above: each size gets its graph, a
    larger call that grows the workspaces drops them (and they are captured again), calls
    past 128 rows run the ordinary path (and "auto" probes there); every call gives the
    bits of an object without graphs."""
    w = make_ffn(700, 256, 1024, 20, sigma=0.3, dtype=bfloat16, xp=cp, seed=62)
    ffn, plain = _graph_twins(w, True)
    notes = []
    for k, M in enumerate((16, 16, 16, 1, 1, 1, 128, 128, 16, 16, 16, 700, 128, 1, 700, 16, 16, 1)):
        x = _inputs(M, 256, bfloat16, k)
        poison()
        y = ffn(x)
        notes.append(ffn.last_info["graph"])
        assert _same_bits(y, plain(x)), (k, M, notes[-1])
    assert notes[:6] == ["warm-up", "capture", "replay"] * 2
    # 128 rows grew the workspaces: the graphs of 16 rows and 1 went, their signatures stay warm
    assert notes[6:11] == ["warm-up", "capture", "capture", "replay", "replay"]
    assert notes[11].startswith("fallback: 700 rows") and notes[14] == notes[11]
    # 700 rows grew them again (the second call of 700 rows runs as the first: no growth)
    assert notes[12:14] == ["capture", "capture"] and notes[15:] == ["capture", "replay", "replay"]


def test_graph_cache_bound_and_recapture():
    """At most GRAPH_LIMIT graphs per object (least recently used dropped, captured again
    when its calls come back), each call still exact."""
    from twellpy.backends import cuda_ffn

    w = make_ffn(40, 128, 512, 12, dtype=np.float32, xp=cp, seed=63)
    ffn, plain = _graph_twins(w, True)
    ffn(w["x"][:40])                                  # the workspaces at their largest first
    sizes = list(range(9, 9 + cuda_ffn.GRAPH_LIMIT + 2))
    for M in sizes:
        for want in ("warm-up", "capture", "replay"):
            poison()
            assert _same_bits(ffn(w["x"][:M]), plain(w["x"][:M]))
            assert ffn.last_info["graph"] == want, (M, want)
    plan = ffn._plan
    assert len(plan._graphs) == cuda_ffn.GRAPH_LIMIT
    assert sum(type(v) is cuda_ffn._GraphEntry for v in plan._graphs._items.values()) == cuda_ffn.GRAPH_LIMIT
    ffn(w["x"][:sizes[0]])
    assert ffn.last_info["graph"] == "warm-up"          # dropped: captured again
    ffn(w["x"][:sizes[-1]])
    assert ffn.last_info["graph"] == "replay"           # kept


@pytest.mark.skipif(os.environ.get("TWELLPY_SANITIZE") == "1",
                    reason="sanitizer runs allocate without CuPy's pool, whose counter this test reads")
def test_graphs_allocate_only_the_output_and_go_with_the_object():
    """A replayed call allocates its y only; dropping the object (or turning graphs off)
    frees its graphs and their buffers."""
    import gc
    import weakref

    from twellpy.backends import cuda_ffn

    w = make_ffn(128, 256, 1024, 20, dtype=bfloat16, xp=cp, seed=64)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], graphs=True)
    for M in (16, 128, 16, 16, 128):
        y = ffn(w["x"][:M])
    assert ffn.last_info["graph"] == "capture"
    pool = cp.get_default_memory_pool()
    del y  # before counting: rebinding y would free the old one inside the count and hide an extra allocation
    gc.collect()
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    y = ffn(w["x"])
    cp.cuda.Device().synchronize()
    assert ffn.last_info["graph"] == "replay" and pool.used_bytes() - before <= y.nbytes
    del y
    entries = [v for v in ffn._plan._graphs._items.values() if type(v) is cuda_ffn._GraphEntry]
    assert len(entries) == 2
    refs = [weakref.ref(e) for e in entries]
    held = sum(e.x.nbytes + e.y.nbytes for e in entries)
    del entries
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    ffn.graphs = False
    assert all(r() is None for r in refs) and before - pool.used_bytes() >= held
    assert ffn(w["x"][:16]) is not None and "graph" not in ffn.last_info
    ffn.graphs = True
    for _ in range(3):
        ffn(w["x"][:16])
    refs = [weakref.ref(v) for v in ffn._plan._graphs._items.values() if type(v) is cuda_ffn._GraphEntry]
    assert len(refs) == 1
    del ffn
    gc.collect()
    assert refs[0]() is None


def test_graphs_per_stream_and_across_streams():
    """A graph is made per caller's stream; calls alternating two streams (and the default
    stream) each replay their own, ordered after the previous call on the other stream."""
    w = make_ffn(16, 256, 1024, 20, dtype=bfloat16, xp=cp, seed=65)
    ffn, plain = _graph_twins(w, True)
    streams = [cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True), cp.cuda.Stream.null]
    outs = []
    for k in range(12):
        with streams[k % 3]:
            # made on the stream that reads it: the non-blocking streams do not wait for the
            # legacy stream, so an x made there could still be in the making
            x = _inputs(16, 256, bfloat16, k)
            y = ffn(x)
            outs.append((k, ffn.last_info["graph"], y, x))
    for s_ in streams:
        s_.synchronize()
    assert [n for _, n, _, _ in outs] == ["warm-up"] * 3 + ["capture"] * 3 + ["replay"] * 6
    for k, _, y, x in outs:
        assert _same_bits(y, plain(x)), k


def test_graph_follows_a_change_of_tuning():
    """A tuning changed after a capture (decode_rows, the long-row launches, the batch
    variant) gets a graph of its own, with the bits the ordinary path has under it."""
    w = make_ffn(16, 256, 1024, 20, dtype=bfloat16, xp=cp, seed=66)
    ffn, plain = _graph_twins(w, True)
    for setting in (None, ("long_launches", 3), ("kb_variant", "wide"), ("decode_rows", 16)):
        if setting is not None:
            name, value = setting
            for f in (ffn, plain):
                setattr(f if name == "decode_rows" else f._plan, name, value)
        notes = []
        for k in range(3):
            x = _inputs(16, 256, bfloat16, 10 + k)
            poison()
            assert _same_bits(ffn(x), plain(x)), setting
            notes.append(ffn.last_info["graph"])
        assert notes == ["warm-up", "capture", "replay"], setting
    assert ffn.last_info.get("kernel") == "decode"


def test_graph_capture_that_allocates_falls_back(monkeypatch):
    """An allocation during the capture fails it (no buffer may come from CuPy's pool
    there): a warning, the call and later ones of the signature on the ordinary path."""
    w = make_ffn(16, 256, 1024, 20, dtype=bfloat16, xp=cp, seed=67)
    ffn, plain = _graph_twins(w, True)
    plan = ffn._plan
    body = plan._graph_body

    def allocating(kind, x, y, check, blas, stream, **kw):
        body(kind, x, y, check, blas, stream, **kw)
        if stream.is_capturing():
            cp.empty((1024,), np.float32)

    monkeypatch.setattr(plan, "_graph_body", allocating)
    x = _inputs(16, 256, bfloat16, 0)
    ffn(x)
    with pytest.warns(RuntimeWarning, match="could not be captured.*allocated during a CUDA graph capture"):
        y = ffn(x)
    assert ffn.last_info["graph"].startswith("fallback: capture failed") and _same_bits(y, plain(x))
    assert not cp.cuda.get_current_stream().is_capturing()
    y = ffn(x)
    assert ffn.last_info["graph"].startswith("fallback: capture failed") and _same_bits(y, plain(x))


def test_graphs_of_the_environment_default(monkeypatch):
    w = make_ffn(4, 128, 512, 12, dtype=np.float32, xp=cp, seed=68)
    monkeypatch.delenv("TWELLPY_FFN_GRAPHS", raising=False)  # unset: on
    assert GatedFFN(w["w_gate"], w["w_up"], w["w_down"]).graphs is True
    monkeypatch.setenv("TWELLPY_FFN_GRAPHS", "0")
    assert GatedFFN(w["w_gate"], w["w_up"], w["w_down"]).graphs is False
    monkeypatch.setenv("TWELLPY_FFN_GRAPHS", "1")
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    assert ffn.graphs is True and "graphs=True" in repr(ffn)
    assert GatedFFN(w["w_gate"], w["w_up"], w["w_down"], graphs=False).graphs is False
    y = gated_forward(w["x"], w["w_gate"], w["w_up"], w["w_down"])   # a one-off call: warm-up only
    assert rel_err(y, ref64(w)) <= TOL[np.dtype(np.float32)]
    monkeypatch.setenv("TWELLPY_FFN_GRAPHS", "2")
    with pytest.raises(ValueError, match="TWELLPY_FFN_GRAPHS must be 0 or 1"):
        GatedFFN(w["w_gate"], w["w_up"], w["w_down"])


@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float16), np.dtype(np.float32)], ids=str)
def test_rowpack_word_test_gives_the_value_tests_lists(dtype):
    """twellpy_ffn_rowpack with its word test (FFN_ROWPACK_WORDS=1) writes the lists of the
    value-by-value test (FFN_ROWPACK_WORDS=0; 1 is the default) compiled the same way, bit for
    bit, on rows holding every 16-bit pattern (NaNs, denormals, both zeros, infinities),
    sparse rows (the scan's ballot shortcuts) and full ones; outputs poisoned."""
    from twellpy.backends import _registry

    rng = np.random.default_rng(41)
    M, H, capr = 96, 1024, 1024
    z = (rng.standard_normal((M, H)) - 2.5).astype(np.float32)
    z[1] = np.abs(z[1]) + 0.5
    z[2, 8:16] = 1.0
    z = z.astype(dtype)
    if z.dtype.itemsize == 2:                                 # rows 32..95: every 16-bit pattern
        z[32:] = rng.permutation(np.arange(1 << 16, dtype=np.uint16)).view(z.dtype).reshape(64, H)
    else:
        z[3, :8] = np.array([0x7fc00000, 0xffc00001, 1, 0x80000001, 0x7f800000, 0xff800000, 0, 0x80000000],
                            np.uint32).view(np.float32)
    g = cp.asarray(z)
    got = {}
    for words in (1, 0):
        kernel = _registry.get_kernel("ffn_pack.cu", f"twellpy_ffn_rowpack<{_registry.ctype(g.dtype)}>",
                                      FFN_ROWPACK_WORDS=words)
        idx = cp.full((M, capr), -77, cp.int32)
        val = cp.full((M, capr), cp.nan, cp.float32)
        count = cp.full(M, -1, cp.int32)
        total = cp.zeros(1, cp.uint64)
        kernel(((M + 7) // 8,), (256,), (g, cp.int64(H), cp.int32(M), cp.int32(H), cp.int32(capr), idx, val,
                                         count, total))
        got[words] = [a.get() for a in (idx, val, count, total)]
    for a, b, name in zip(got[1], got[0], ("idx", "val", "count", "total")):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    count = got[1][2]
    assert count[1] == H and count[2] >= 8 and int(got[1][3][0]) == int(count.sum())
