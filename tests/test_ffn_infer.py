"""CPU tests of the fused FFN inference (twellpy._ffn_infer + backends/cpu_ffn)."""
import numpy as np
from types import SimpleNamespace
import pytest
from hypothesis import given, settings, strategies as st

from benchmarks.workloads import find_threshold, make_ffn, make_inputs, reference_ffn
from conftest import RTOL, rel_err
from twellpy._array import bfloat16
from twellpy._ffn_infer import GatedFFN, ReluFFN, gated_forward, relu_forward
from twellpy.backends import cpu_ffn

ALL_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), bfloat16]


def ref64(w, gated=True):
    return reference_ffn(w["x"], w["w_gate"] if gated else None, w["w_up"], w["w_down"], dtype=np.float64)


def run(w, gated=True, **kw):
    if gated:
        return gated_forward(w["x"], w["w_gate"], w["w_up"], w["w_down"], **kw)
    return relu_forward(w["x"], w["w_up"], w["w_down"], **kw)


def h_ref64(w, gated=True):
    x = w["x"].astype(np.float64)
    if gated:
        g = x @ w["w_gate"].astype(np.float64).T
        return np.where(g <= 0, 0, g * (x @ w["w_up"].astype(np.float64).T))
    g = x @ w["w_up"].astype(np.float64).T
    return np.where(g <= 0, 0, g)


# ---- exactness against a float64 reference -------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("mode", ["sparse", "dense", "auto"])
def test_matches_float64_reference(dtype, gated, mode):
    w = make_ffn(301, 48, 200, 12, sigma=0.2, gated=gated, dtype=dtype, seed=1)
    y = run(w, gated, mode=mode)
    assert isinstance(y, np.ndarray) and y.dtype == dtype and y.shape == (301, 48)
    assert np.isfinite(y.astype(np.float64)).all()
    assert rel_err(y, ref64(w, gated)) <= max(RTOL[dtype], 1e-6 if dtype == np.float32 else 0)


@pytest.mark.parametrize("gated", [True, False])
def test_sparse_equals_dense_mode(gated):
    w = make_ffn(257, 64, 256, 20, sigma=0.3, gated=gated, dtype=np.float64, seed=2)
    ys = run(w, gated, mode="sparse")
    yd = run(w, gated, mode="dense")
    assert rel_err(ys, yd) <= 1e-12


def test_workload_generator_hits_target_density():
    w = make_ffn(2048, 128, 1024, 30, seed=3)
    g = w["x"].astype(np.float64) @ w["w_gate"].astype(np.float64).T
    mean = (g > 0).sum(axis=1).mean()
    assert 27 <= mean <= 33
    x = make_inputs(16, 8, sigma=0.5, seed=0)
    assert (x[:, 0] == 1).all() and x.dtype == np.float32
    # threshold is monotone: a higher target gives a lower threshold
    wg = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    assert find_threshold(x, wg, 10) < find_threshold(x, wg, 2)


def test_tokens_firing_many_neurons_and_uneven_rows():
    w = make_ffn(64, 32, 512, 10, dtype=np.float32, seed=4)
    x = w["x"].copy()
    x[3, 0] = 0.0     # no threshold: about half of the neurons fire
    x[7, 0] = -5.0    # almost every neuron fires
    x[8, :] = 0.0     # nothing fires... and x[8, 0] = 0 keeps it that way
    w["x"] = x
    fired = (x.astype(np.float64) @ w["w_gate"].astype(np.float64).T > 0).sum(axis=1)
    assert fired[3] > 150 and fired[7] > 450 and fired[8] == 0
    y, h = run(w, return_activations=True, slots=4, tile=64)
    assert rel_err(y, ref64(w)) <= 1e-6
    assert np.all(y[8] == 0)
    # rows over the 4-slot capacity live in the dense backup, nothing is lost
    assert 3 in h.backup_rows and 7 in h.backup_rows
    assert rel_err(h.toarray(), h_ref64(w)) <= 1e-6


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_return_activations(gated, dtype):
    w = make_ffn(123, 40, 300, 25, sigma=0.3, gated=gated, dtype=dtype, seed=5)
    y, h = run(w, gated, return_activations=True, slots=8, tile=32)
    assert h.format == "twell" and h.shape == (123, 300) and h.dtype == dtype
    assert h.tile == 32 and h.values.shape == (123, 10, 8)
    assert rel_err(h.toarray(), h_ref64(w, gated)) <= RTOL[dtype]
    # padding is 0 / -1, entries are sorted inside each (row, tile)
    live = np.arange(8)[None, None, :] < h.counts[:, :, None]
    assert (h.indices[~live] == -1).all() and (h.values[~live].astype(np.float32) == 0).all()
    idx = np.where(live, h.indices, np.iinfo(np.int32).max)
    assert (np.diff(idx, axis=2)[live[:, :, 1:]] > 0).all()
    y2 = run(w, gated)
    np.testing.assert_array_equal(y.view(np.uint8), y2.view(np.uint8))


@pytest.mark.parametrize("M", [0, 1, 2, 1025])
def test_row_counts(M):
    w = make_ffn(max(M, 1), 16, 64, 5, dtype=np.float32, seed=M)
    x = w["x"][:M]
    y = gated_forward(x, w["w_gate"], w["w_up"], w["w_down"])
    assert y.shape == (M, 16) and y.dtype == np.float32
    if M:
        assert rel_err(y, reference_ffn(x, w["w_gate"], w["w_up"], w["w_down"], dtype=np.float64)) <= 1e-6
    y, h = gated_forward(x, w["w_gate"], w["w_up"], w["w_down"], return_activations=True)
    assert h.shape == (M, 64)


def test_batch_dims_and_odd_shapes():
    w = make_ffn(30, 13, 37, 6, dtype=np.float64, seed=6)   # D, H not multiples of 8: still exact
    assert rel_err(run(w), ref64(w)) <= 1e-12
    y3 = gated_forward(w["x"].reshape(2, 3, 5, 13), w["w_gate"], w["w_up"], w["w_down"])
    assert y3.shape == (2, 3, 5, 13)
    np.testing.assert_array_equal(y3.reshape(30, 13), run(w))
    y1 = gated_forward(w["x"][4], w["w_gate"], w["w_up"], w["w_down"])   # one token, 1-D
    assert y1.shape == (13,)
    np.testing.assert_allclose(y1, run(w)[4], rtol=1e-12, atol=1e-14)


def test_deterministic_bits():
    w = make_ffn(600, 64, 512, 30, sigma=0.3, dtype=np.float32, seed=7)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], mode="sparse")
    a, b = ffn(w["x"]), ffn(w["x"])
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_auto_mode_switches_to_dense_when_dense():
    w = make_ffn(2048, 32, 256, 120, dtype=np.float32, seed=8)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    y = ffn(w["x"])
    assert ffn.last_info["mode"] == "dense"
    assert ffn.last_info["mean_active"] > ffn.auto_threshold
    assert rel_err(y, ref64(w)) <= 1e-6
    w = make_ffn(2048, 32, 256, 3, dtype=np.float32, seed=8)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    ffn(w["x"])
    assert ffn.last_info["mode"] == "sparse"
    assert 1 <= ffn.activity()["mean_active"] <= 6
    ffn.auto_threshold = 0.5
    ffn(w["x"])
    assert ffn.last_info["mode"] == "dense"
    # chunks decide one by one: a sparse chunk next to a dense one
    x_dense = w["x"].copy()
    x_dense[:, 0] = 0.0   # no threshold: about half of the neurons fire
    x2 = np.concatenate([w["x"], x_dense])
    ffn.auto_threshold = 30
    ffn._plan.chunk_rows = 2048
    y2 = ffn(x2)
    assert ffn.last_info["mode"] == "sparse+dense" and ffn.last_info["dense_chunks"] == 1
    ref2 = reference_ffn(x2, w["w_gate"], w["w_up"], w["w_down"], dtype=np.float64)
    assert rel_err(y2, ref2) <= 1e-6


def test_reusable_object_matches_functional():
    w = make_ffn(100, 32, 128, 10, dtype=bfloat16, seed=9)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    assert "GatedFFN(D=32, H=128" in repr(ffn)
    np.testing.assert_array_equal(ffn(w["x"]).view(np.uint16), run(w).view(np.uint16))
    r = ReluFFN(w["w_up"], w["w_down"], mode="dense")
    assert "ReluFFN" in repr(r)
    np.testing.assert_array_equal(r(w["x"]).view(np.uint16), run(w, False, mode="dense").view(np.uint16))


# ---- NaN semantics ----------------------------------------------------------------

def test_nan_propagates_with_check_finite_false():
    w = make_ffn(40, 16, 64, 8, dtype=np.float64, seed=10)
    x = w["x"].copy()
    x[3, 7] = np.nan
    wu = w["w_up"].copy()
    wu[11, 2] = np.nan
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        gated_forward(x, w["w_gate"], w["w_up"], w["w_down"])
    with pytest.raises(ValueError, match="w_up contains 1 NaN"):
        gated_forward(w["x"], w["w_gate"], wu, w["w_down"])
    for mode in ("sparse", "dense"):
        y = gated_forward(x, w["w_gate"], wu, w["w_down"], check_finite=False, mode=mode)
        ref = reference_ffn(x, w["w_gate"], wu, w["w_down"], dtype=np.float64)
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
        assert np.isnan(y[3]).all()          # relu(NaN) = NaN is active everywhere
        ok = ~np.isnan(ref).any(axis=1)
        assert ok.sum() > 20
        assert rel_err(y[ok], ref[ok]) <= 1e-12


def test_nan_gate_counts_as_active_in_activation():
    w = make_ffn(6, 8, 32, 4, gated=False, dtype=np.float32, seed=11)
    wu = w["w_up"].copy()
    wu[5, 3] = np.nan   # neuron 5 is NaN for every token
    y, h = relu_forward(w["x"], wu, w["w_down"], check_finite=False, return_activations=True)
    dense_h = h.toarray()
    assert np.isnan(dense_h[:, 5]).all()
    assert np.isnan(y).all()


# ---- bad input ----------------------------------------------------------------------

def test_bad_shapes_and_dtypes_name_the_argument():
    w = make_ffn(4, 16, 32, 4, dtype=np.float32, seed=12)
    x, wg, wu, wd = w["x"], w["w_gate"], w["w_up"], w["w_down"]
    with pytest.raises(ValueError, match=r"w_gate has shape \(32, 15\), expected \(32, 16\)"):
        gated_forward(x, wg[:, :15], wu, wd)
    with pytest.raises(ValueError, match=r"w_down has shape \(32, 16\), expected \(16, 32\)"):
        gated_forward(x, wg, wu, wd.T)
    with pytest.raises(ValueError, match=r"x has shape \(4, 15\), expected \(\.\.\., 16\)"):
        gated_forward(x[:, :15], wg, wu, wd)
    with pytest.raises(ValueError, match="w_up must be 2-D"):
        gated_forward(x, wg, wu[0], wd)
    with pytest.raises(TypeError, match="x has dtype float64 but the weights have dtype float32"):
        gated_forward(x.astype(np.float64), wg, wu, wd)
    with pytest.raises(TypeError, match="w_down has dtype float16 but w_gate has dtype float32"):
        gated_forward(x, wg, wu, wd.astype(np.float16))
    with pytest.raises(TypeError, match="w_up has dtype int32"):
        gated_forward(x, wg, wu.astype(np.int32), wd)
    with pytest.raises(TypeError, match="x has dtype int64"):
        gated_forward(np.ones((2, 16), np.int64), wg, wu, wd)
    with pytest.raises(TypeError, match="w_gate must be an array, got None"):
        gated_forward(x, None, wu, wd)
    with pytest.raises(ValueError, match="mode must be one of"):
        gated_forward(x, wg, wu, wd, mode="fast")
    with pytest.raises(ValueError, match="slots must be a positive integer"):
        gated_forward(x, wg, wu, wd, slots=0)
    with pytest.raises(ValueError, match="tile must be a positive integer"):
        GatedFFN(wg, wu, wd, tile=2.5)
    with pytest.raises(ValueError, match="w_up has shape"):
        relu_forward(x, np.zeros((0, 16), np.float32), np.zeros((16, 0), np.float32))
    with pytest.raises(ValueError, match="heavy_limit must be None or an int"):
        GatedFFN(wg, wu, wd).heavy_limit = 5000
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        gated_forward(np.float32(1.0), wg, wu, wd)


def test_inf_in_weights_rejected_by_default():
    w = make_ffn(4, 16, 32, 4, dtype=np.float32, seed=13)
    wd = w["w_down"].copy()
    wd[0, 0] = np.inf
    with pytest.raises(ValueError, match="w_down contains 0 NaN and 1 Inf"):
        GatedFFN(w["w_gate"], w["w_up"], wd)


# ---- CPU kernel directly; random shapes ------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(M=st.integers(0, 40), D=st.integers(1, 24), H=st.integers(1, 70),
       nnz=st.floats(0.5, 20), gated=st.booleans(), seed=st.integers(0, 2**16))
def test_random_shapes(M, D, H, nnz, gated, seed):
    w = make_ffn(max(M, 1), D, H, min(nnz, H), gated=gated, dtype=np.float64, seed=seed, sample_rows=64)
    w["x"] = w["x"][:M]
    y, h = run(w, gated, return_activations=True, slots=3, tile=16)
    assert y.shape == (M, D)
    if M:
        assert rel_err(y, ref64(w, gated)) <= 1e-12
        assert rel_err(h.toarray(), h_ref64(w, gated)) <= 1e-12


def test_pack_activation_layout():
    h = np.zeros((3, 10), np.float32)
    h[0, [1, 4, 9]] = [1.0, -2.0, 3.0]
    h[1, :] = np.arange(1, 11)          # 5 per tile of 5 > slots=2: backup row
    h[2, 7] = np.nan                    # NaN is a stored non-zero
    values, indices, counts, backup, rows = cpu_ffn.pack_activation(h, 5, 2)
    assert values.shape == (3, 2, 2) and counts.tolist() == [[2, 1], [0, 0], [0, 1]]
    assert indices[0].tolist() == [[1, 4], [9, -1]]
    assert values[0].tolist() == [[1.0, -2.0], [3.0, 0.0]]
    assert rows.tolist() == [1] and backup.shape == (1, 10) and (backup[0] == h[1]).all()
    assert (indices[1] == -1).all() and (values[1] == 0).all()
    assert indices[2, 1, 0] == 7 and np.isnan(values[2, 1, 0])


def test_auto_probe_is_a_cuda_setting():
    from benchmarks.workloads import make_ffn
    from twellpy._ffn_infer import GatedFFN

    w = make_ffn(64, 32, 128, 8, seed=3)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    assert ffn.auto_probe is None
    with pytest.raises(AttributeError, match="CUDA backend only"):
        ffn.auto_probe = "always"


def test_auto_takes_a_count_that_landed_by_the_end_of_a_call(monkeypatch):
    """The CUDA plan's "auto" bookkeeping (no device: fake copies): a count that was still
    in flight when a call began but has landed by its end decides the next call, instead
    of being read and dropped (the next call would then decide from an older count)."""
    from twellpy.backends import cuda_ffn

    class Copy:
        def __init__(self, count, landed):
            self.count, self.landed, self.was_read = count, landed, False

        def arrived(self):
            return self.landed

        def read(self):
            self.was_read = True
            return self.count

    queued = []
    monkeypatch.setattr(cuda_ffn, "PendingCount",
                        lambda counters, stream, host, event: queued.append(Copy(None, False)) or queued[-1])
    plan = object.__new__(cuda_ffn.FFNPlan)
    plan.auto_probe = "first"
    plan._density_mean, plan._density_rows, plan._density_slot = 10.0, 100, ("host", "event")
    plan._density_copy = in_flight = Copy(3000, landed=False)
    assert plan._earlier_density() == (10.0, "earlier decision")   # still in flight: the old mean
    in_flight.landed = True                                          # lands during the call
    plan._remember_density([0, 0, 0], rows=200, stream=None)
    assert in_flight.was_read and plan._density_mean == 30.0        # 3000 active over its 100 rows
    assert plan._density_copy is queued[-1] and plan._density_rows == 200
    assert plan._earlier_density() == (30.0, "earlier decision")


def _fake_cupy_for_checks(monkeypatch, log):
    """A fake CuPy for RepeatedNonfiniteCheck: kernel launches, copies, stream contexts."""
    from types import SimpleNamespace

    from twellpy.backends import cuda

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            log.append(("enter", self.ptr))

        def __exit__(self, *exc):
            log.append(("exit", self.ptr))

    current = Stream(1)
    runtime = SimpleNamespace(memcpyDeviceToHost=2,
                              memcpyAsync=lambda dst, src, n, kind, s: log.append(("copy", dst, s)))
    fake_cp = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: current, runtime=runtime))
    monkeypatch.setattr(cuda, "_cp", lambda: fake_cp)
    monkeypatch.setattr(cuda.reg, "get_kernel",
                        lambda f, name: (lambda grid, block, args: log.append(("kernel", name, grid, args[1]))))
    return Stream, current


class _FakeEvent:
    def __init__(self, log, name):
        self.log, self.name, self.done = log, name, False

    def record(self, s):
        self.log.append(("record", self.name, s.ptr))
        self.done = False

    def synchronize(self):
        self.log.append(("wait", self.name))
        self.done = True


def test_repeated_nonfinite_check_bookkeeping(monkeypatch):
    """The prepared NaN/Inf check of the CUDA plan (no device: a fake CuPy): each queue
    launches the kernel on the stream it is given (in that stream's context when it is
    not the current one) and copies into the next word of its ring; collect returns the
    landed counts oldest first, once each, and waits only as asked."""
    from twellpy.backends import cuda

    log = []
    Stream, current = _fake_cupy_for_checks(monkeypatch, log)
    host = np.array([7, 8, 9], np.uint64)
    events = [_FakeEvent(log, k) for k in range(3)]
    count = SimpleNamespace(data=SimpleNamespace(ptr=4096))
    arr = SimpleNamespace(size=3000, data=SimpleNamespace(ptr=8192))
    check = cuda.RepeatedNonfiniteCheck(bfloat16, count, host, events)
    check.queue(arr, current, "a")
    assert log == [("kernel", "twellpy_count_nonfinite<unsigned short>", (2,), 3000),
                   ("copy", host.ctypes.data, 1), ("record", 0, 1)]
    assert check.collect() == [] and check.in_flight == 1        # not landed: no wait, nothing
    events[0].done = True
    assert check.collect() == [("a", 7)] and check.collect() == []   # once each
    del log[:]
    check.queue(arr, Stream(5), "b")                               # another stream: in its context
    check.queue(SimpleNamespace(size=0, data=arr.data), current, "c")   # empty: copy, no launch
    assert log == [("enter", 5), ("kernel", "twellpy_count_nonfinite<unsigned short>", (2,), 3000), ("exit", 5),
                   ("copy", host.ctypes.data + 8, 5), ("record", 1, 5), ("copy", host.ctypes.data + 16, 1),
                   ("record", 2, 1)]
    check.queue(arr, current, "d")                                 # wraps round to word 0
    assert check.full and check.in_flight == 3
    with pytest.raises(RuntimeError, match="full"):
        check.queue(arr, current, "e")
    events[2].done = True                                          # "c" landed but "b" did not:
    assert check.collect() == []                                   # copies land in order
    del log[:]
    assert check.collect(wait="oldest") == [("b", 8), ("c", 9)] and log == [("wait", 1)]
    assert not check.full
    assert check.collect(wait="all") == [("d", 7)] and check.in_flight == 0
    with pytest.raises(ValueError, match="tag"):
        check.queue(arr, current, None)
    del log[:]
    check.queue(None, current, "f")                                # a fused kernel wrote the count:
    assert log == [("copy", host.ctypes.data + 8, 1), ("record", 1, 1)]  # the copy only


class _LedgerDevice:
    """What the GPU does for a NonfiniteLedger: each run of a queued launch stores its
    stamped count (the formula tests/test_kernel_emulation.py checks on the kernel)."""

    def __init__(self, ledger):
        self.ledger, self.seq = ledger, 0

    def run(self, n_bad):
        L = type(self.ledger)
        self.ledger._host[self.seq % L.RING] = np.uint64(((self.seq % (1 << L._SEQ_BITS)) << L._COUNT_BITS)
                                                         | min(n_bad, (1 << L._COUNT_BITS) - 1))
        self.seq += 1


def _host_ledger(monkeypatch, ring):
    """A NonfiniteLedger with a ring of ``ring`` words in ordinary host memory (no device)."""
    import collections

    from twellpy.backends.cuda import NonfiniteLedger

    monkeypatch.setattr(NonfiniteLedger, "RING", ring)
    ledger = object.__new__(NonfiniteLedger)
    ledger._host = np.full(ring, NonfiniteLedger._UNSET)
    ledger._tags, ledger._queued = collections.deque(), 0
    return ledger, _LedgerDevice(ledger)


def test_nonfinite_ledger_bookkeeping(monkeypatch):
    """Counts come back in launch order, each once, only once stamped with their own
    call's number (a slot still holding the stamp of the call RING earlier has not
    landed); collect(done) waits for the event and then every count must be there."""
    ledger, device = _host_ledger(monkeypatch, 3)

    class Done:
        waits = 0

        def synchronize(self):
            Done.waits += 1

    assert ledger.collect() == [] and ledger.collect(done=Done()) == [] and Done.waits == 0  # nothing queued
    for tag in "abc":
        ledger.queue(tag)
    assert ledger.full and ledger.in_flight == 3
    with pytest.raises(RuntimeError, match="full"):
        ledger.queue("d")
    with pytest.raises(ValueError, match="tag"):
        ledger.collect() or ledger.queue(None)
    assert ledger.collect() == []                       # nothing ran yet
    device.run(0)
    device.run(5)
    assert ledger.collect() == [("a", 0), ("b", 5)] and ledger.in_flight == 1
    ledger.queue("d")                                   # slot 0 again: still holds a's stamp
    assert ledger.collect() == []                       # c has not run: d is not looked at
    device.run(2**45)                                   # c saturates
    assert ledger.collect() == [("c", 2**40 - 1)]
    assert ledger.collect() == []                       # d: slot 0 holds call 0's stamp, not call 3's
    with pytest.raises(RuntimeError, match="count 3 did not reach the host"):
        ledger.collect(done=Done())                     # the launches ended and d's count is missing
    device.run(1)
    assert ledger.collect(done=Done()) == [("d", 1)] and ledger.in_flight == 0


def test_plan_merges_ordinary_and_graph_counts(monkeypatch):
    """FFNPlan reports NaN/Inf counts from the ordinary calls' copies and from the graph
    replays' ledger together, oldest call first, each once."""
    from twellpy.backends import cuda_ffn

    ledger, device = _host_ledger(monkeypatch, 4)

    class Copies:  # the ordinary calls' ring: every copy has landed
        def __init__(self):
            self.items = []

        @property
        def in_flight(self):
            return len(self.items)

        def collect(self, wait=None):
            out, self.items = self.items, []
            return out

    plan = object.__new__(cuda_ffn.FFNPlan)
    plan._check, plan._ledger, plan._unreported, plan._done = Copies(), ledger, [], None
    plan._density_copy = "density"
    tag = lambda call: cuda_ffn._CheckTag(call, 16, True)  # noqa: E731
    ledger.queue(tag(2))
    device.run(1)
    plan._check.items = [(tag(1), 0), (tag(3), 4)]
    ledger.queue(tag(4))
    assert plan._counts_in_flight()
    with pytest.raises(ValueError, match=r"call 2, 16 rows\) contains 1 NaN/Inf values \(and the x of calls 3\)"):
        plan._settle_checks(plan._landed_counts())
    assert ledger.in_flight == 1 and plan._counts_in_flight()   # call 4 has not run
    device.run(0)
    plan.check()
    assert not plan._counts_in_flight()


def test_deferred_nonfinite_reports_of_the_cuda_plan(monkeypatch):
    """FFNPlan's bookkeeping of NaN/Inf counts (no device: a fake ring). A deferred call's
    bad count raises once, when a later call or check() collects it, naming the call;
    a waited-for call reports its own count; a count read on another path is not
    reported again."""
    from twellpy.backends import cuda_ffn

    class Ring:
        def __init__(self):
            self.items, self.landed = [], 0

        @property
        def full(self):
            return len(self.items) - self.landed >= 2

        @property
        def in_flight(self):
            return len(self.items) - self.landed

        def rebind(self, count):
            pass

        def queue(self, x, stream, tag):
            assert not self.full
            self.items.append([tag, fused_counts.pop(0) if x is None else x.n_bad])

        def collect(self, wait=None):
            upto = len(self.items) if wait == "all" else self.landed + (1 if wait == "oldest" else 0)
            upto = max(upto, self.landed)
            out = [tuple(it) for it in self.items[self.landed:upto]]
            self.landed = upto
            return out

    class Stream:
        def __init__(self):
            self.waits = 0

        def synchronize(self):
            self.waits += 1

    fused_counts = []  # what a decode gate kernel "wrote" for x=None queues
    ring = Ring()
    plan = object.__new__(cuda_ffn.FFNPlan)
    plan._check, plan._check_counters, plan._calls, plan._density_copy = ring, "counters", 0, "density"
    plan._unreported, plan._ledger, plan._done = [], None, None
    x = lambda rows, n_bad: SimpleNamespace(shape=(rows, 8), n_bad=n_bad)  # noqa: E731

    def call(rows, n_bad, deferred):
        plan._calls += 1
        return plan._queue_check(x(rows, n_bad), "counters", None, deferred=deferred)

    t1 = call(1, 0, True)
    t2 = call(1, 3, True)
    t3 = call(1, 0, True)                      # ring full: waits for the oldest, t1 (clean)
    assert [it[0] for it in ring.items[ring.landed:]] == [t2, t3]
    with pytest.raises(ValueError, match=r"earlier call of this FFN \(call 2, 1 rows\) contains 3 NaN/Inf values;"):
        call(1, 0, True)                       # call 4, full again: t2 lands and raises before queueing
    assert len(ring.items) == 3 and ring.in_flight == 1 and plan._density_copy is None
    plan.check()                               # t3 was clean: nothing to report
    assert t1.call == 1 and t3.call == 3

    # several bad calls landed together: one error names them all, and each is reported once
    call(1, 1, True)
    call(1, 2, True)
    with pytest.raises(ValueError, match=r"\(call 5, 1 rows\) contains 1 NaN/Inf values \(and the x of calls 6\)"):
        plan.check()
    plan.check()

    # a waited-for call returns its own count; an earlier deferred bad one raises when it is clean
    call(1, 5, True)
    t9 = call(600, 0, False)
    s = Stream()
    with pytest.raises(ValueError, match=r"call 7, 1 rows\) contains 5"):
        plan._read_check(t9, (s,))
    assert s.waits == 1                        # queued work on x finishes first
    t10 = call(600, 2, False)
    assert plan._read_check(t10, ()) == 2      # its own count: the caller raises for it
    plan.check()                               # t10 is not deferred: not reported again

    # own count bad and an earlier deferred one bad: the earlier one is kept for the next report
    call(1, 4, True)
    t12 = call(600, 1, False)
    assert plan._read_check(t12, ()) == 1
    with pytest.raises(ValueError, match=r"call 10, 1 rows\) contains 4"):
        plan.check()
    plan.check()

    # a count read on another path (tag.deferred cleared) is not reported again
    t13 = call(1, 4, True)
    t13.deferred = False
    plan.check()

    # the decode path queues the copy of a count its gate kernel wrote (x None, rows given)
    plan._calls += 1
    fused_counts.append(2)
    t14 = plan._queue_check(None, "counters", None, deferred=True, rows=3)
    assert (t14.call, t14.rows) == (plan._calls, 3)
    with pytest.raises(ValueError, match=rf"call {plan._calls}, 3 rows\) contains 2 NaN/Inf"):
        plan.check()


def test_check_finite_modes_on_the_cpu():
    from benchmarks.workloads import make_ffn
    from twellpy._ffn_infer import GatedFFN

    w = make_ffn(16, 32, 128, 8, seed=3)
    bad = w["x"].copy()
    bad[3, 1] = np.nan
    for chk in (True, "sync"):
        ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], check_finite=chk)
        with pytest.raises(ValueError, match="x contains 1 NaN"):
            ffn(bad)                          # the CPU always checks within the call
        ffn.check()                           # nothing deferred
    assert ffn.defer_check_rows is None
    with pytest.raises(AttributeError, match="CUDA backend only"):
        ffn.defer_check_rows = 0
    y = ffn(bad, check_finite=False)
    assert np.isnan(y[3]).all()
    for wrong, err in (("always", ValueError), (2.5, TypeError), (None, TypeError)):
        with pytest.raises(err, match="check_finite must be True, False or 'sync'"):
            GatedFFN(w["w_gate"], w["w_up"], w["w_down"], check_finite=wrong)
    with pytest.raises(ValueError, match="check_finite must be True, False or 'sync'"):
        ffn(w["x"], check_finite="later")


# ---- CUDA graphs of decode-size calls: what runs without a device ----------------------

@pytest.mark.parametrize("case, want", [
    (dict(M=1, mode="auto"), ("sparse", None)),
    (dict(M=128, mode="sparse"), ("sparse", None)),
    (dict(M=16, mode="dense"), ("dense", None)),
    (dict(M=16, mode="auto", sparse_ok=False), ("dense", None)),            # odd D: every call dense
    (dict(M=16, mode="dense", heavy_limit=256, chunk=4), ("dense", None)),  # dense ignores both
    (dict(M=0, mode="auto"), (None, "0 rows")),
    (dict(M=129, mode="sparse"), (None, "129 rows")),
    (dict(M=16, mode="auto", return_activations=True), (None, "return_activations")),
    (dict(M=16, mode="sparse", heavy_limit=256), (None, "heavy_limit")),
    (dict(M=16, mode="sparse", heavy_limit=0), (None, "heavy_limit")),      # 0 is a limit, not None
    (dict(M=16, mode="auto", chunk=8), (None, "chunks of 8 rows")),
    (dict(M=16, mode="auto", chunk=16), ("sparse", None)),                  # one chunk of all rows
    (dict(M=100, mode="auto", auto_min_rows=64), (None, "measures the density")),
    (dict(M=100, mode="sparse", auto_min_rows=64), ("sparse", None)),
    (dict(M=200, mode="sparse", max_rows=256), ("sparse", None)),
])
def test_graph_route_decisions(case, want):
    """Only calls whose launches are decided before they start run as CUDA graphs."""
    from twellpy.backends.cuda_ffn import graph_route

    kind, reason = graph_route(**case)
    assert kind == want[0]
    if want[1] is None:
        assert reason is None
    else:
        assert want[1] in reason


def test_graph_cache_is_a_bounded_lru():
    from twellpy.backends.cuda_ffn import GRAPH_LIMIT, GraphCache

    assert GRAPH_LIMIT == 8 and GraphCache().limit == 8
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="limit must be a positive int"):
            GraphCache(bad)
    c = GraphCache(3)
    assert c.put("a", 1) == [] and c.put("b", 2) == [] and c.put("c", 3) == []
    assert c.get("a") == 1                      # now the most recently used
    assert c.put("d", 4) == [2]                 # "b" was the least recently used
    assert c.keys() == ["c", "a", "d"] and "b" not in c and c.get("b") is None
    assert c.put("c", 5) == [] and c.keys() == ["a", "d", "c"] and len(c) == 3   # replaced, not added
    assert c.put("e", 6) == [1] and c.put("f", 7) == [4]
    assert c.replace(lambda v: v % 2, 0) == [5, 7] and c.keys() == ["c", "e", "f"]   # order kept
    assert [c.get(k) for k in ("c", "e", "f")] == [0, 6, 0]
    assert c.clear() == [0, 6, 0] and len(c) == 0


def test_graphs_option_on_the_cpu():
    w = make_ffn(16, 32, 128, 8, seed=3)
    args = (w["w_gate"], w["w_up"], w["w_down"])
    with pytest.raises(ValueError, match="graphs=True needs the CUDA backend"):
        GatedFFN(*args, graphs=True)
    with pytest.raises(ValueError, match="graphs=True needs the CUDA backend"):
        ReluFFN(w["w_up"], w["w_down"], graphs=True)
    for bad in (1, "yes", 0.0):
        with pytest.raises(TypeError, match="graphs must be True, False or None"):
            GatedFFN(*args, graphs=bad)
    ffn = GatedFFN(*args, graphs=False)                 # accepted: nothing to turn off
    assert ffn.graphs is None and "graphs" not in repr(ffn)
    with pytest.raises(AttributeError, match="CUDA backend only"):
        ffn.graphs = True
    assert rel_err(ffn(w["x"]), ref64(w)) <= 1e-5 and "graph" not in ffn.last_info


def test_graphs_environment_variable(monkeypatch):
    """TWELLPY_FFN_GRAPHS sets the CUDA plans' default, like the other TWELLPY_FFN_* tunables."""
    from twellpy.backends.cuda_ffn import graphs_default

    monkeypatch.delenv("TWELLPY_FFN_GRAPHS", raising=False)
    assert graphs_default() is True
    monkeypatch.setenv("TWELLPY_FFN_GRAPHS", "1")
    assert graphs_default() is True
    monkeypatch.setenv("TWELLPY_FFN_GRAPHS", "0")
    assert graphs_default() is False
    for bad in ("yes", "true", " 1", "2"):
        monkeypatch.setenv("TWELLPY_FFN_GRAPHS", bad)
        with pytest.raises(ValueError, match="TWELLPY_FFN_GRAPHS must be 0 or 1"):
            graphs_default()


def _graph_plan(monkeypatch, **over):
    """A CUDA FFNPlan of D=256, H=1024 bf16 without a device: the attributes the graph
    routing reads, a fake CuPy that logs copies, launches and events."""
    from twellpy.backends import cuda_ffn

    log = []

    class Event:
        def __init__(self, name="done"):
            self.name = name

        def record(self, stream):
            log.append(("record", self.name, stream.ptr))

        def synchronize(self):
            log.append(("wait", self.name))

    class Stream:
        def __init__(self, ptr):
            self.ptr, self.capturing = ptr, False

        def wait_event(self, event):
            log.append(("stream waits", self.ptr, event.name))

        def is_capturing(self):
            return self.capturing

        def synchronize(self):
            log.append(("sync", self.ptr))

    class Array:
        def __init__(self, shape, dtype, ptr, contiguous=True):
            self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
            self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
            self.data = SimpleNamespace(ptr=ptr)
            self.flags = SimpleNamespace(c_contiguous=contiguous)

    ptrs = iter(range(1 << 20, 1 << 30, 1 << 16))
    streams = {0: Stream(0), 7: Stream(7)}
    current = [streams[0]]
    rt = SimpleNamespace(memcpyDeviceToDevice=3,
                         memcpyAsync=lambda dst, src, n, kind, s: log.append(("copy", dst, src, n, s)))
    fake_cp = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: current[0], runtime=rt),
                              empty=lambda shape, dtype: Array(shape, dtype, next(ptrs)))
    monkeypatch.setattr(cuda_ffn, "cupy_module", lambda: fake_cp)
    monkeypatch.setattr(cuda_ffn, "_decode_smem_limit", lambda device_id: 48 * 1024)
    plan = object.__new__(cuda_ffn.FFNPlan)
    attrs = dict(dtype=bfloat16, D=256, H=1024, gated=True, sparse_ok=True, heavy_limit=None, chunk_rows=None,
                 decode_rows=8, config=(4, 1), kb_variant="narrow", l2_hint=False, min_blocks=2, long_rows=True,
                 long_launches=1, split_down=False, two_pass=False, device_id=0, _graphs_on=True,
                 _graphs=cuda_ffn.GraphCache(3), _graph_warned=False, _done=Event(), _calls=0, _check=None,
                 _unreported=[], _last_rows=0, _last_sparse_rows=0, _done_on=None,
                 _ledger=SimpleNamespace(full=False, in_flight=0, collect=lambda done=None: [],
                                         queue=lambda tag: log.append(("publication of call", tag.call))))
    attrs.update(over)
    plan.__dict__.update(attrs)
    captured = []

    def capture(kind, x, M, check, cur):  # what _capture returns, without a device
        captured.append((kind, M, check, cur.ptr))
        xs, ys = Array((M, 256), bfloat16, next(ptrs)), Array((M, 256), bfloat16, next(ptrs))
        graph = SimpleNamespace(launch=lambda stream: log.append(("launch", len(captured), stream.ptr)))
        return cuda_ffn._GraphEntry(graph, xs, ys, kind, "counters", None)

    monkeypatch.setattr(plan, "_capture", capture)
    monkeypatch.setattr(plan, "_graph_unsupported", lambda kind, M: None)
    return plan, SimpleNamespace(log=log, Array=Array, streams=streams, current=current, captured=captured,
                                 ptrs=ptrs)


def test_graph_key_holds_what_the_launches_depend_on(monkeypatch):
    plan, env = _graph_plan(monkeypatch)
    key, kind = plan._graph_key(3, "auto", False, None, False, 0)
    assert kind == "decode"                                    # 3 <= decode_rows
    assert plan._graph_key(3, "sparse", False, None, False, 0) == (key[:2] + ("decode",) + key[3:], "decode")
    k16, kind16 = plan._graph_key(16, "auto", False, None, False, 0)
    assert kind16 == "sparse" and plan._graph_key(16, "dense", False, None, False, 0)[1] == "dense"
    assert plan._graph_key(16, "auto", False, None, True, 0)[0] != k16           # the NaN/Inf count
    assert plan._graph_key(16, "auto", False, None, False, 7)[0] != k16          # another stream
    import threading

    other = []
    t = threading.Thread(target=lambda: other.append(plan._graph_key(16, "auto", False, None, False, 0)))
    t.start()
    t.join()
    assert other[0][1] == "sparse" and other[0][0] != k16                      # another thread
    assert plan._graph_key(16, "auto", False, 0, False, 0)[0] == k16            # chunk_rows 0: the default
    for name, value in (("kb_variant", "wide"), ("l2_hint", True), ("min_blocks", 1), ("long_rows", False),
                        ("long_launches", 3), ("config", (8, 1)), ("split_down", "auto"), ("two_pass", True)):
        old = getattr(plan, name)
        setattr(plan, name, value)
        assert plan._graph_key(16, "auto", False, None, False, 0)[0] != k16, name
        setattr(plan, name, old)
    assert plan._graph_key(16, "auto", False, None, False, 0)[0] == k16
    plan.decode_rows = 16                                      # the same rows now take the decode kernels
    assert plan._graph_key(16, "auto", False, None, False, 0)[1] == "decode"
    plan.decode_rows = 4
    assert plan._graph_key(5, "auto", False, None, False, 0)[1] == "sparse"  # over decode_rows: general
    assert plan._graph_key(16, "auto", False, 8, False, 0) == (None, "chunks of 8 rows (the two-stream pipeline)")
    plan.chunk_rows = 4
    assert plan._graph_key(16, "auto", False, None, False, 0)[0] is None
    assert plan._graph_key(16, "auto", False, 32, False, 0)[1] == "sparse"     # the call's own chunk wins
    plan.chunk_rows, plan.heavy_limit = None, 300
    assert "heavy_limit" in plan._graph_key(16, "auto", False, None, False, 0)[1]
    assert plan._graph_key(16, "dense", False, None, False, 0)[1] == "dense"


def test_graph_key_follows_the_default_chunk(monkeypatch):
    """A call the ordinary path splits into pipeline chunks by default (rows past
    FFNPlan.MAX_CHUNK, default_chunk) is no graph either."""
    from twellpy.backends import cuda_ffn

    plan, env = _graph_plan(monkeypatch)
    assert plan._graph_key(100, "sparse", False, None, False, 0)[1] == "sparse"
    monkeypatch.setattr(cuda_ffn.FFNPlan, "MAX_CHUNK", 64)
    assert plan._graph_key(100, "sparse", False, None, False, 0) == (None, "chunks of 64 rows (the two-stream pipeline)")
    assert plan._graph_key(64, "sparse", False, None, False, 0)[1] == "sparse"
    assert plan._graph_key(100, "sparse", False, 128, False, 0)[1] == "sparse"   # the call's own chunk wins
    assert plan._graph_key(100, "dense", False, None, False, 0)[1] == "dense"    # dense ignores chunks


def test_graph_call_raising_for_its_own_x_leaves_what_the_ordinary_path_leaves(monkeypatch):
    """A waited call whose x holds NaN/Inf raises after its graph ran, as the ordinary path
    does, and a graph of the general sparse path also drops the density copy in flight (the
    ordinary sparse branch does: NaN rows fire every neuron); decode and dense leave it."""
    from twellpy.backends import cuda_ffn

    plan, env = _graph_plan(monkeypatch)
    monkeypatch.setattr(plan, "_read_check", lambda tag, streams, graph=False: graph and tag.call == plan._calls)

    def raising(x, name):
        raise ValueError(f"{name} contains 1 NaN")

    monkeypatch.setattr(cuda_ffn, "raise_nonfinite", raising)
    for M, mode, drops in ((16, "auto", True), (2, "auto", False), (2, "dense", False)):
        x = env.Array((M, 256), bfloat16, 4096)
        assert plan._graph_call(x, M, mode, False, None, True, False) == "warm-up"
        plan._density_copy = "in flight"
        del env.log[:]
        with pytest.raises(ValueError, match="x contains 1 NaN"):
            plan._graph_call(x, M, mode, False, None, True, False)   # captured, launched, its count read
        assert env.captured[-1][:2] == ({16: "sparse"}.get(M, "decode" if mode == "auto" else "dense"), M)
        assert (plan._density_copy is None) == drops, (M, mode)
        # the graph's own publication noted, the call's end recorded, then waited
        assert env.log[-4] == ("publication of call", plan._calls) and env.log[-3][0] == "copy"
        assert env.log[-2:] == [("record", "done", 0), ("sync", 0)]


def test_graph_call_warms_up_captures_then_replays(monkeypatch):
    """The plan's graph bookkeeping without a device: a signature's first call runs the
    ordinary path, its second captures and launches, later ones copy x in, launch, copy
    the output into a fresh array and record the end of the call after that copy."""
    plan, env = _graph_plan(monkeypatch)
    log = env.log
    x = env.Array((16, 256), bfloat16, 4096)
    assert plan._graph_call(x, 16, "auto", False, None, False, False) == "warm-up"
    assert log == [] and len(plan._graphs) == 1
    y, h, info = plan._graph_call(x, 16, "auto", False, None, False, False)
    assert env.captured == [("sparse", 16, False, 0)] and info["graph"] == "capture" and h is None
    assert info["mode"] == "sparse" and "kernel" not in info and info["finite_check"] == "off"
    entry = plan._graphs.get(plan._graph_key(16, "auto", False, None, False, 0)[0])
    del log[:]
    y, _, info = plan._graph_call(x, 16, "sparse", False, None, False, False)  # "auto" and "sparse": one graph
    assert info["graph"] == "replay" and len(env.captured) == 1
    # the previous call ended on this same stream: stream order, no wait on its event
    assert log == [("copy", entry.x_ptr, 4096, 16 * 256 * 2, 0), ("launch", 1, 0),
                   ("copy", y.data.ptr, entry.y_ptr, 16 * 256 * 2, 0), ("record", "done", 0)]
    assert y.data.ptr not in (entry.y_ptr, entry.x_ptr) and y.shape == (16, 256)   # never the graph's buffer
    env.current[0] = env.streams[7]
    plan._graph_call(x, 16, "sparse", False, None, False, False)   # stream 7's own graph: warm-up,
    plan._graph_call(x, 16, "sparse", False, None, False, False)   # capture; the call ends on stream 7
    assert log[-1] == ("record", "done", 7)
    env.current[0] = env.streams[0]
    del log[:]
    plan._graph_call(x, 16, "sparse", False, None, False, False)   # a call on another stream than the
    assert log[0] == ("stream waits", 0, "done")                   # last one's waits for its end
    del log[:]
    plan._graph_call(x, 16, "sparse", False, None, False, False)   # the next one on that stream does not
    assert [e for e in log if e[0] == "stream waits"] == []
    assert (plan._last_rows, plan._last_sparse_rows) == (16, 16)
    # a non-contiguous x is copied by CuPy into the input buffer (on the current stream)
    copied = []
    monkeypatch.setattr(type(entry.x), "__setitem__", lambda self, k, v: copied.append((self.data.ptr, v)),
                        raising=False)
    x_nc = env.Array((16, 256), bfloat16, 8192, contiguous=False)
    plan._graph_call(x_nc, 16, "auto", False, None, False, False)
    assert copied == [(entry.x_ptr, x_nc)]
    # the decode kernels and the dense path get graphs of their own, reported as such
    for M, mode, kind in ((2, "auto", "decode"), (2, "dense", "dense")):
        assert plan._graph_call(env.Array((M, 256), bfloat16, 4096), M, mode, False, None, False, False) == "warm-up"
        _, _, info = plan._graph_call(env.Array((M, 256), bfloat16, 4096), M, mode, False, None, False, False)
        assert env.captured[-1][0] == kind and info["graph"] == "capture"
        assert info.get("kernel") == ("decode" if kind == "decode" else None)
        assert info["mode"] == ("dense" if kind == "dense" else "sparse")
    assert (plan._last_rows, plan._last_sparse_rows) == (2, 2)    # a dense call leaves them, as the ordinary path
    # calls that cannot be graphs say why, and the ordinary path runs them
    for call, why in (((x, 16, "auto", True, None, False, False), "return_activations"),
                      ((env.Array((200, 256), bfloat16, 4096), 200, "auto", False, None, False, False), "200 rows"),
                      ((x, 16, "auto", False, 4, False, False), "chunks of 4 rows"),
                      ((env.Array((16, 256), np.float16, 4096), 16, "auto", False, None, False, False), "dtype")):
        note = plan._graph_call(*call)
        assert note.startswith("fallback: ") and why in note


def test_graph_cache_bound_and_invalidation_wait_for_the_last_call(monkeypatch):
    """Dropping a graph (least recently used past the limit, the workspaces replaced, graphs
    turned off) waits for the plan's last call first: its buffers go back to CuPy's pool."""
    from twellpy.backends import cuda_ffn

    plan, env = _graph_plan(monkeypatch)   # a cache of 3
    log = env.log

    def graph_of(M):
        x = env.Array((M, 256), bfloat16, 4096)
        assert plan._graph_call(x, M, "sparse", False, None, False, False) == "warm-up"
        assert plan._graph_call(x, M, "sparse", False, None, False, False)[2]["graph"] == "capture"

    for M in (9, 10, 11):
        graph_of(M)
    del log[:]
    x = env.Array((12, 256), bfloat16, 4096)
    assert plan._graph_call(x, 12, "sparse", False, None, False, False) == "warm-up"
    assert ("wait", "done") in log                # M = 9's graph dropped: its last launch ended first
    assert plan._graph_call(env.Array((9, 256), bfloat16, 4096), 9, "sparse", False, None, False, False) == "warm-up"
    del log[:]
    before = len(plan._graphs)
    plan._before_replacing_buffers()              # the workspaces grow: every graph goes
    assert log == [("wait", "done")] and len(plan._graphs) == before
    assert not any(type(v) is cuda_ffn._GraphEntry for v in plan._graphs._items.values())
    x = env.Array((11, 256), bfloat16, 4096)      # its signature stays warm: the next call captures
    assert plan._graph_call(x, 11, "sparse", False, None, False, False)[2]["graph"] == "capture"
    del log[:]
    with pytest.raises(TypeError, match="graphs must be True or False"):
        plan.graphs = "off"
    plan.graphs = False
    assert log == [("wait", "done")] and len(plan._graphs) == 0 and plan.graphs is False
    assert plan._graphs_on is False


def test_graph_capture_failures_fall_back_once(monkeypatch):
    """A capture that fails warns once per plan and leaves the signature on the ordinary
    path (no retry per call); a setup without what a capture needs says why, without a
    warning; a caller's stream that is capturing itself gets no graph now, but may later."""
    import warnings

    from twellpy.backends import cuda_ffn

    plan, env = _graph_plan(monkeypatch)

    def broken(kind, x, M, check, cur):
        raise RuntimeError("allocated during a CUDA graph capture")

    monkeypatch.setattr(plan, "_capture", broken)
    x = env.Array((16, 256), bfloat16, 4096)
    plan._graph_call(x, 16, "auto", False, None, False, False)
    with pytest.warns(RuntimeWarning, match="could not be captured.*allocated during"):
        note = plan._graph_call(x, 16, "auto", False, None, False, False)
    assert note.startswith("fallback: capture failed (RuntimeError")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan._graph_call(x, 16, "auto", False, None, False, False) == note   # stored: not retried
        y = env.Array((17, 256), bfloat16, 4096)
        plan._graph_call(y, 17, "auto", False, None, False, False)
        assert plan._graph_call(y, 17, "auto", False, None, False, False).startswith("fallback: capture failed")
    monkeypatch.setattr(plan, "_graph_unsupported", cuda_ffn.FFNPlan._graph_unsupported.__get__(plan))
    monkeypatch.setattr(cuda_ffn, "_capture_blas_lib", lambda: "no libcublas here")
    z = env.Array((20, 256), bfloat16, 4096)
    plan._graph_call(z, 20, "auto", False, None, False, False)
    assert plan._graph_call(z, 20, "auto", False, None, False, False) == "fallback: no libcublas here"
    monkeypatch.setattr(cuda_ffn, "_capture_blas_lib", lambda: object())   # a library, now
    plan.split_down = True                                      # the split step is not captured
    s = env.Array((21, 256), bfloat16, 4096)
    plan._graph_call(s, 21, "auto", False, None, False, False)
    assert "split sparse step" in plan._graph_call(s, 21, "auto", False, None, False, False)
    plan.split_down = False
    monkeypatch.setattr(plan, "_capture", lambda kind, x, M, check, cur: pytest.fail("captured"))
    d = env.Array((2, 256), bfloat16, 4096)                    # decode: no GEMM, no cuBLAS needed
    plan._graph_call(d, 2, "auto", False, None, False, False)
    env.current[0].capturing = True
    assert "capturing a graph itself" in plan._graph_call(d, 2, "auto", False, None, False, False)
    key = plan._graph_key(2, "auto", False, None, False, 0)[0]
    assert plan._graphs.get(key) is cuda_ffn._WARM             # not stored: a later call may capture
