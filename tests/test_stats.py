"""twellpy.stats: counts, positions, layers, firing tracker, tile occupancy and the overflow model."""
import numpy as np
import pytest

import twellpy as tw
from twellpy import stats


def _acts(m, h, sigma=0.3, target=20, seed=0, d=48):
    """ReLU activations with uneven tokens (lognormal scale) and uneven neurons."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)) * np.exp(sigma * rng.standard_normal((m, 1)))
    w = rng.standard_normal((h, d)) / np.sqrt(d)
    z = x @ w.T
    t = np.quantile(z, 1 - target / h)
    return np.maximum(z - t, 0)


def _brute_occupancy(a, tile):
    m, n = a.shape
    nt = -(-n // tile)
    return np.array([[np.count_nonzero(a[i, j * tile:(j + 1) * tile]) for j in range(nt)] for i in range(m)])


def _containers(a, tile=64, slots=6):
    return {
        "twell": tw.TwELL.from_dense(a, tile=tile, slots=slots),  # small slots: some rows go to backup
        "ell": tw.ELL.from_dense(a),
        "hybrid": tw.Hybrid.from_dense(a, width=8),
    }


def test_nnz_per_token_dense_containers_and_frameworks():
    a = _acts(40, 200)
    a[3] = 0  # an empty token
    a[5, :150] = 1.0  # a very busy token
    want = np.count_nonzero(a, axis=1)
    np.testing.assert_array_equal(stats.nnz_per_token(a), want)
    for name, c in _containers(a).items():
        np.testing.assert_array_equal(stats.nnz_per_token(c), want, err_msg=name)
    assert _containers(a)["twell"].n_backup > 0  # the backup path was exercised
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(stats.nnz_per_token(torch.from_numpy(a).float()), want)
    jnp = pytest.importorskip("jax.numpy")
    np.testing.assert_array_equal(stats.nnz_per_token(jnp.asarray(a, dtype=jnp.bfloat16)), want)
    # (B, T, H) flattens in row-major order
    np.testing.assert_array_equal(stats.nnz_per_token(a.reshape(4, 10, 200)), want)


def test_nan_counts_as_active_and_negative_zero_does_not():
    a = np.zeros((2, 5))
    a[0, 1] = np.nan
    a[1, 2] = -0.0
    np.testing.assert_array_equal(stats.nnz_per_token(a), [1, 0])
    np.testing.assert_array_equal(stats.nnz_per_token(a.astype(np.float16)), [1, 0])
    mask = np.array([[True, False, True], [False, False, False]])
    np.testing.assert_array_equal(stats.nnz_per_token(mask), [2, 0])
    np.testing.assert_array_equal(stats.firing_counts(mask.astype(np.int8)), [1, 0, 1])


def test_nnz_per_position():
    a = _acts(6 * 8, 100).reshape(6, 8, 100)
    ps = stats.nnz_per_position(a)
    counts = np.count_nonzero(a, axis=2)
    np.testing.assert_allclose(ps.mean, counts.mean(axis=0))
    np.testing.assert_allclose(ps.std, counts.std(axis=0))
    np.testing.assert_array_equal(ps.max, counts.max(axis=0))
    np.testing.assert_array_equal(ps.min, counts.min(axis=0))
    np.testing.assert_array_equal(ps.position, np.arange(8))
    assert ps.n_sequences == 6
    flat = stats.nnz_per_position(a.reshape(48, 100), seq_len=8)
    np.testing.assert_allclose(flat.mean, ps.mean)
    from_counts = stats.nnz_per_position(counts.ravel(), seq_len=8)
    np.testing.assert_allclose(from_counts.mean, ps.mean)
    cont = stats.nnz_per_position(tw.ELL.from_dense(a.reshape(48, 100)), seq_len=8)
    np.testing.assert_allclose(cont.mean, ps.mean)
    with pytest.raises(ValueError, match="seq_len is required"):
        stats.nnz_per_position(a.reshape(48, 100))
    with pytest.raises(ValueError, match="not a multiple of seq_len=7"):
        stats.nnz_per_position(a.reshape(48, 100), seq_len=7)
    with pytest.raises(ValueError, match="contradicts"):
        stats.nnz_per_position(a, seq_len=4)


@pytest.mark.parametrize("kind,params", [("power", (300.0, 0.8, 12.0)), ("exp", (200.0, 6.0, 25.0))])
def test_fit_position_trend_recovers_parameters(kind, params):
    p = np.arange(128)
    truth = stats.PositionTrend(kind, *params)
    noise = np.random.default_rng(1).normal(0, 0.2, p.size)
    fit = stats.fit_position_trend(p, truth(p) + noise, kind=kind)
    assert fit.kind == kind
    np.testing.assert_allclose((fit.a, fit.b, fit.c), params, rtol=0.1)
    assert kind[:3] in fit.label() or "p+1" in fit.label()
    with pytest.raises(ValueError, match="kind"):
        stats.fit_position_trend(p, truth(p), kind="linear")


def test_nnz_per_layer():
    layers = {"a": _acts(30, 64, seed=1), "b": _acts(30, 128, target=40, seed=2)}
    layers["b"][0, :100] = 1.0
    ls = stats.nnz_per_layer(layers)
    assert ls.names == ["a", "b"]
    for i, a in enumerate(layers.values()):
        c = np.count_nonzero(a, axis=1)
        assert ls.mean[i] == pytest.approx(c.mean())
        assert ls.max[i] == c.max() and ls.min[i] == c.min()
        assert ls.density[i] == pytest.approx(c.mean() / a.shape[1])
    np.testing.assert_array_equal(ls.n_neurons, [64, 128])
    listed = stats.nnz_per_layer([tw.TwELL.from_dense(layers["a"], tile=32, slots=4), layers["b"]])
    assert listed.names == ["0", "1"]
    np.testing.assert_allclose(listed.mean, ls.mean)
    with pytest.raises(ValueError, match="empty"):
        stats.nnz_per_layer({})


def test_token_ranking():
    toks = ["a", "b", "a", "c", "b", " ", "c"]
    nnz = np.array([10, 2, 20, 5, 4, 100, 7])
    most, fewest = stats.token_ranking(toks, nnz, k=2)
    assert most == [(" ", 100.0, 1), ("a", 15.0, 2)]
    assert fewest == [("b", 3.0, 2), ("c", 6.0, 2)]
    most, _ = stats.token_ranking(toks, nnz, k=5, min_count=2)
    assert [r[0] for r in most] == ["a", "c", "b"]
    with pytest.raises(ValueError, match="7 labels but nnz describes 6"):
        stats.token_ranking(toks, nnz[:6])


def test_firing_counts_and_frequency():
    a = _acts(50, 96)
    a[:, 7] = 0  # a dead neuron
    want = np.count_nonzero(a, axis=0)
    np.testing.assert_array_equal(stats.firing_counts(a), want)
    np.testing.assert_allclose(stats.firing_frequency(a), want / 50)
    for name, c in _containers(a, tile=32, slots=4).items():
        np.testing.assert_array_equal(stats.firing_counts(c), want, err_msg=name)


def test_firing_tracker_window_and_dead_neurons():
    h = 6
    tr = stats.FiringTracker(window=3)
    batches = []
    for step in range(5):
        b = np.zeros((4, h))
        b[:, 0] = 1  # always fires
        if step < 2:
            b[0, 1] = 1  # fires only in the first two steps
        b[step % 4, 2] = 1
        batches.append(b)
        tr.update(b)
    # Window = steps 2, 3, 4.
    assert tr.n_tokens == 12
    np.testing.assert_array_equal(tr.counts, [12, 0, 3, 0, 0, 0])
    np.testing.assert_allclose(tr.frequency, [1, 0, 0.25, 0, 0, 0])
    np.testing.assert_array_equal(tr.dead_neurons(), [1, 3, 4, 5])
    np.testing.assert_array_equal(tr.dead_neurons(threshold=0.3), [1, 2, 3, 4, 5])
    assert tr.dead_fraction() == pytest.approx(4 / 6)
    unbounded = stats.FiringTracker(n_neurons=h)
    for b in batches:
        unbounded.update_counts(np.count_nonzero(b, axis=0), b.shape[0])
    np.testing.assert_array_equal(unbounded.dead_neurons(), [3, 4, 5])
    tr.reset()
    assert tr.n_tokens == 0 and tr.n_updates == 0
    with pytest.raises(ValueError, match="expected 6"):
        unbounded.update(np.zeros((2, 5)))
    with pytest.raises(ValueError, match="n_tokens=1 is smaller"):
        unbounded.update_counts(np.full(h, 2), 1)
    with pytest.raises(ValueError, match="no data"):
        stats.FiringTracker().frequency
    with pytest.raises(ValueError, match="window"):
        stats.FiringTracker(window=0)


def test_firing_tracker_from_training_stats():
    # The per-neuron counts of twellpy's training step feed the tracker directly.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 8))
    wg, wu, wd = rng.standard_normal((32, 8)), rng.standard_normal((32, 8)), rng.standard_normal((8, 32))
    wg[5] = 0  # gate pre-activation 0 -> relu 0: neuron 5 never fires
    _, ctx = tw.ffn.gated_forward_train(x, wg, wu, wd)
    tr = stats.FiringTracker()
    tr.update_counts(ctx.stats["neuron_counts"], x.shape[0])
    ref = np.count_nonzero(np.maximum(x @ wg.T, 0), axis=0)
    np.testing.assert_array_equal(tr.counts, ref)
    assert 5 in tr.dead_neurons()


@pytest.mark.parametrize("tile", [16, 64, 100])
def test_tile_occupancy_matches_brute_force(tile):
    a = _acts(30, 250, target=40)
    a[2, :120] = 3.0
    want = _brute_occupancy(a, tile)
    np.testing.assert_array_equal(stats.tile_occupancy(a, tile), want)
    for name, c in _containers(a, tile=64, slots=5).items():
        np.testing.assert_array_equal(stats.tile_occupancy(c, tile), want, err_msg=name)
    hist = stats.tile_occupancy_histogram(a, tile)
    assert hist.shape == (tile + 1,) and hist.sum() == want.size
    np.testing.assert_array_equal(hist, np.bincount(want.ravel(), minlength=tile + 1))
    with pytest.raises(ValueError, match="tile must be a positive integer"):
        stats.tile_occupancy(a, 0)


def test_empirical_overflow_rate():
    a = _acts(40, 256, target=30)
    occ = _brute_occupancy(a, 64)
    for s in (3, 8, 12):
        assert stats.empirical_overflow_rate(a, s, tile=64) == pytest.approx(np.mean(occ > s))
        assert stats.empirical_overflow_rate(a, s, tile=64, per="row") == pytest.approx(
            np.mean((occ > s).any(axis=1)))
    # The rows TwELL sends to backup are exactly the overflowing rows.
    c = tw.TwELL.from_dense(a, tile=64, slots=8)
    assert c.n_backup == int(round(stats.empirical_overflow_rate(a, 8, tile=64, per="row") * 40))


@pytest.mark.parametrize("sigma", [0.0, 0.3])
def test_overflow_model_predicts_held_out_overflow(sigma):
    """Validation of the documented model: fitted on one half, checked on the other."""
    a = _acts(8000, 1024, sigma=sigma, target=30, d=64, seed=3)
    fit, held = a[:4000], a[4000:]
    model = stats.fit_overflow_model(fit, tile=256)
    checked = 0
    for s in range(8, 60, 2):
        emp = stats.empirical_overflow_rate(held, s, tile=256)
        if emp < 3e-3:  # below that the held-out estimate itself is too noisy
            break
        pred = model.probability(s)
        assert 0.6 < pred / emp < 1.6, (s, pred, emp)
        emp_row = stats.empirical_overflow_rate(held, s, tile=256, per="row")
        assert 0.6 < model.probability(s, per="row") / emp_row < 1.6, (s, emp_row)
        checked += 1
    assert checked >= 3
    # suggest_slots meets its target on held-out data (with sampling slack).
    for target in (1e-2, 3e-3):
        s = stats.suggest_slots(fit, tile=256, target_overflow=target)
        assert stats.empirical_overflow_rate(held, s, tile=256) <= 2 * target
        assert model.probability(s) <= target < model.probability(s - 1)
    s8 = stats.suggest_slots(fit, tile=256, target_overflow=1e-2, multiple_of=8)
    assert s8 % 8 == 0 and s8 >= stats.suggest_slots(fit, tile=256, target_overflow=1e-2)


def test_binomial_model_underestimates_uneven_data():
    # Documented limitation: without the token mixture the tail is far too light.
    a = _acts(4000, 1024, sigma=0.3, target=30, d=64, seed=4)
    mix = stats.fit_overflow_model(a, tile=256, kind="mixture")
    binom = stats.fit_overflow_model(a, tile=256, kind="binomial")
    emp = stats.empirical_overflow_rate(a, 20, tile=256)
    assert binom.probability(20) < 0.1 * emp < mix.probability(20)
    assert binom.suggest_slots(1e-3) < mix.suggest_slots(1e-3)


def test_overflow_model_edge_cases():
    a = np.zeros((5, 40))
    model = stats.fit_overflow_model(a, tile=16)
    assert model.probability(0) == 0.0
    assert model.suggest_slots(1e-3) == 1
    full = np.ones((3, 40))
    assert stats.suggest_slots(full, tile=16, target_overflow=0.0) == 16
    assert stats.overflow_probability(full, 15, tile=16) == pytest.approx(2 / 3)  # last tile is 8 wide
    c = tw.TwELL.from_dense(_acts(50, 128), tile=32, slots=4)
    assert stats.suggest_slots(c, tile=32) == stats.suggest_slots(c.toarray(), tile=32)
    with pytest.raises(ValueError, match="target_overflow"):
        model.suggest_slots(1.5)
    with pytest.raises(ValueError, match="per must be"):
        model.probability(3, per="column")
    with pytest.raises(ValueError, match="kind"):
        stats.fit_overflow_model(a, kind="poisson")
    with pytest.raises(ValueError, match="slots must be"):
        model.probability(-1)


@pytest.mark.gpu
def test_cupy_inputs_and_gpu_containers():
    import cupy

    a = _acts(300, 700, target=40)
    a[7, :500] = 1.0
    ga = cupy.asarray(a)
    np.testing.assert_array_equal(stats.nnz_per_token(ga), np.count_nonzero(a, axis=1))
    np.testing.assert_array_equal(stats.firing_counts(ga), np.count_nonzero(a, axis=0))
    want = _brute_occupancy(a, 128)
    np.testing.assert_array_equal(stats.tile_occupancy(ga, 128), want)
    for name, c in _containers(ga, tile=128, slots=6).items():
        assert c.device.startswith("cuda")
        np.testing.assert_array_equal(stats.tile_occupancy(c, 128), want, err_msg=name)
        np.testing.assert_array_equal(stats.nnz_per_token(c), np.count_nonzero(a, axis=1), err_msg=name)
    assert stats.suggest_slots(ga, tile=128) == stats.suggest_slots(a, tile=128)


def test_row_chunking_gives_the_same_counts(monkeypatch):
    a = _acts(90, 130, target=30)
    a[4, :100] = 1.0
    whole = (stats.nnz_per_token(a), stats.firing_counts(a), stats.tile_occupancy(a, 32))
    c = tw.TwELL.from_dense(a, tile=32, slots=3)
    monkeypatch.setattr(stats._Acts, "CHUNK_ELEMENTS", 7 * 130)  # 7 rows per chunk
    for src in (a, c):
        np.testing.assert_array_equal(stats.nnz_per_token(src), whole[0])
        np.testing.assert_array_equal(stats.firing_counts(src), whole[1])
        np.testing.assert_array_equal(stats.tile_occupancy(src, 32), whole[2])


def test_count_in_range_matches_bincount(backend):
    # the training forward counts neuron firings with it (no host sync on cupy)
    from twellpy._array import count_in_range

    rng = np.random.default_rng(5)
    values = rng.integers(0, 37, size=5000).astype(np.int32)
    values[:100] = 36  # a popular value: many atomics on one counter
    want = np.bincount(values, minlength=40)
    if backend == "cuda":
        import cupy as cp

        got = cp.asnumpy(count_in_range(cp.asarray(values), 40))
        empty = cp.asnumpy(count_in_range(cp.zeros(0, cp.int32), 7))
    else:
        got = count_in_range(values, 40)
        empty = count_in_range(np.zeros(0, np.int32), 7)
    assert got.dtype == np.int32 and got.shape == (40,)
    np.testing.assert_array_equal(got, want)
    assert empty.shape == (7,) and not empty.any()
