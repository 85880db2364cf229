"""Review of twellpy.stats / twellpy.plot: wrong numbers and unclear or missing argument checks."""
import warnings

import numpy as np
import pytest

from twellpy import stats

A = np.abs(np.random.default_rng(0).standard_normal((8, 64)))
A[A < 1] = 0


# -- per-token counts given as a 1-D array -------------------------------------

@pytest.mark.parametrize("bad", [[1.5, 2.0, 3.0, 4.0], [-1, 2, 3, 4], [np.nan, 2, 3, 4], [np.inf, 2, 3, 4]])
def test_nnz_per_position_rejects_counts_that_are_not_whole_non_negative(bad):
    # 1.5 was truncated to 1 (a wrong mean), -1 accepted, NaN / Inf cast to garbage
    with pytest.raises(ValueError, match="acts"):
        stats.nnz_per_position(np.array(bad), seq_len=2)


def test_nnz_per_position_whole_float_counts_still_accepted():
    ps = stats.nnz_per_position(np.array([1.0, 2.0, 3.0, 4.0]), seq_len=2)
    np.testing.assert_array_equal(ps.mean, [2.0, 3.0])
    assert ps.min.dtype == np.int64


@pytest.mark.parametrize("bad", [[1.5, 2.0], [-1, 2], [np.nan, 2.0]])
def test_nnz_histogram_rejects_counts_that_are_not_whole_non_negative(bad):
    pytest.importorskip("matplotlib")
    from twellpy import plot

    with pytest.raises(ValueError, match="acts"):
        plot.nnz_histogram(np.array(bad))


# -- fit_position_trend / nnz_vs_position --------------------------------------

@pytest.mark.parametrize("pos", [[0, np.nan, 2, 3], [0, np.inf, 2, 3]])
def test_fit_position_trend_rejects_non_finite_position(pos):
    # was numpy.linalg.LinAlgError ('SVD did not converge') or a RuntimeWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="position"):
            stats.fit_position_trend(pos, [3.0, 2.0, 1.0, 1.0])


def test_nnz_vs_position_bad_trend_names_trend():
    pytest.importorskip("matplotlib")
    from twellpy import plot

    with pytest.raises(ValueError, match="trend"):
        plot.nnz_vs_position(A, seq_len=4, trend="linear")


def test_nnz_vs_position_one_position_with_trend_names_trend_and_seq_len():
    pytest.importorskip("matplotlib")
    from twellpy import plot

    with pytest.raises(ValueError, match="trend.*seq_len|seq_len.*trend"):
        plot.nnz_vs_position(A, seq_len=1)
    fig = plot.nnz_vs_position(A, seq_len=1, trend=None)  # no trend: fine
    assert fig.twellpy_trend is None


# -- token_ranking ---------------------------------------------------------------

@pytest.mark.parametrize("k", [2.5, True, "3", None])
def test_token_ranking_k_must_be_positive_integer(k):
    with pytest.raises(ValueError, match="k must be a positive integer"):
        stats.token_ranking(list("abcdefgh"), A, k=k)


@pytest.mark.parametrize("mc", [0, -3, 1.5, True, "2"])
def test_token_ranking_min_count_must_be_positive_integer(mc):
    with pytest.raises(ValueError, match="min_count must be a positive integer"):
        stats.token_ranking(list("abcdefgh"), A, min_count=mc)


def test_token_ranking_rejects_nan_counts():
    # NaN means sorted arbitrarily: 'b' (NaN) came second in 'most' and in 'fewest'
    with pytest.raises(ValueError, match="nnz"):
        stats.token_ranking(list("abcd"), np.array([1.0, np.nan, 3.0, 2.0]), k=4)


# -- FiringTracker -----------------------------------------------------------------

def test_firing_tracker_rejects_bool_n_neurons():
    with pytest.raises(ValueError, match="n_neurons"):
        stats.FiringTracker(n_neurons=True)


def test_firing_tracker_update_counts_rejects_inf():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="counts"):
            stats.FiringTracker().update_counts(np.array([np.inf, 1.0]), 5)


@pytest.mark.parametrize("n", [2.7, "x", -1, True])
def test_firing_tracker_update_counts_n_tokens_must_be_non_negative_integer(n):
    with pytest.raises(ValueError, match="n_tokens"):
        stats.FiringTracker().update_counts(np.zeros(0, np.int64), n)
    with pytest.raises(ValueError, match="n_tokens"):
        stats.FiringTracker().update_counts(np.zeros(3, np.int64), n)


def test_firing_tracker_update_counts_whole_float_n_tokens_ok():
    tr = stats.FiringTracker().update_counts(np.array([1, 2]), np.int64(4))
    np.testing.assert_allclose(tr.frequency, [0.25, 0.5])


# -- tile_heatmap / suggest_slots argument checks -------------------------------------

@pytest.mark.parametrize("mr", [2.5, "5", True, 0])
def test_tile_heatmap_max_rows_must_be_positive_integer(mr):
    pytest.importorskip("matplotlib")
    from twellpy import plot

    with pytest.raises(ValueError, match="max_rows must be a positive integer"):
        plot.tile_heatmap(A, 16, max_rows=mr)


@pytest.mark.parametrize("t", ["x", None])
def test_suggest_slots_non_number_target_names_target(t):
    m = stats.fit_overflow_model(A, 16)
    with pytest.raises(ValueError, match="target_overflow"):
        m.suggest_slots(t)


# --------------------------------------------------------------------------
# twenty-third session: the stats defects the twenty-second left in its notes
# --------------------------------------------------------------------------
def test_tracker_refuses_an_update_without_neurons():
    """H = 0 used to be taken as n_neurons = 0, and dead_fraction() then divided by zero."""
    tr = stats.FiringTracker()
    with pytest.raises(ValueError, match=r"update has 0 neurons \(H = 0\)"):
        tr.update(np.zeros((3, 0), np.float32))
    with pytest.raises(ValueError, match=r"update has 0 neurons \(H = 0\)"):
        tr.update_counts(np.zeros(0, np.int64), 4)
    assert tr.n_neurons is None and tr.n_updates == 0  # nothing was recorded


@pytest.mark.parametrize("bad, err", [(float("nan"), ValueError), (np.float32("nan"), ValueError),
                                      ("0.1", TypeError), (None, TypeError), (True, TypeError)])
def test_dead_neuron_threshold_must_be_a_real_number(bad, err):
    """threshold=NaN returned an empty list (no comparison with NaN is true): every neuron
    looked alive."""
    tr = stats.FiringTracker().update(np.zeros((4, 3), np.float32))
    with pytest.raises(err, match="threshold"):
        tr.dead_neurons(bad)
    with pytest.raises(err, match="threshold"):
        tr.dead_fraction(bad)
    assert tr.dead_neurons(np.float64(0.0)).tolist() == [0, 1, 2] and tr.dead_fraction(0) == 1.0


@pytest.mark.parametrize("dtype", [np.complex64, object])
def test_statistics_refuse_activations_that_are_not_real(dtype):
    """Complex and object arrays were counted with `!= 0`."""
    acts = np.ones((2, 4)).astype(dtype)
    for fn in (stats.nnz_per_token, stats.firing_counts, stats.tile_occupancy):
        with pytest.raises(TypeError, match=rf"acts has dtype {np.dtype(dtype)}; expected real activations"):
            fn(acts)


def test_seq_len_is_validated_before_it_meets_the_shape():
    """seq_len=2.0 with (B, T, H) data was reported as contradicting the shape."""
    acts = np.ones((2, 3, 4), np.float32)
    for bad in (2.0, True, "3"):
        with pytest.raises(ValueError, match=r"seq_len must be a positive integer or None, got"):
            stats.nnz_per_position(acts, seq_len=bad)
    with pytest.raises(ValueError, match="seq_len=2 contradicts acts of shape"):
        stats.nnz_per_position(acts, seq_len=2)
    assert stats.nnz_per_position(acts, seq_len=3).n_sequences == 2


@pytest.mark.parametrize("make", [lambda v: np.array(v), lambda v: np.float16(v), lambda v: __import__("fractions").Fraction(v).limit_denominator(8)])
def test_dead_neuron_threshold_takes_the_real_scalars_it_took_before(make):
    """The NaN check refused every threshold outside (int, float, np.integer, np.floating):
    a 0-d numpy array (np.asarray(0.5)), a 0-d torch tensor or a Fraction, which the comparison
    with the frequencies took before, raised TypeError; the containers take them as scalars."""
    tr = stats.FiringTracker().update(np.array([[1, 0, 0], [1, 1, 0]], np.float32))
    assert tr.dead_neurons(make(0.5)).tolist() == [1, 2] and tr.dead_fraction(make(0.5)) == pytest.approx(2 / 3)
    assert tr.dead_neurons(10 ** 400).tolist() == [0, 1, 2]  # an int beyond float64 is no OverflowError
    with pytest.raises(ValueError, match="threshold is NaN"):
        tr.dead_neurons(np.array(np.nan))
    with pytest.raises(TypeError, match="threshold must be a real number"):
        tr.dead_neurons(np.array([0.5]))
    torch = pytest.importorskip("torch")
    assert tr.dead_neurons(torch.tensor(0.5)).tolist() == [1, 2]
    with pytest.raises(TypeError, match="threshold must be a real number"):
        tr.dead_neurons(torch.tensor(1 + 0j))


@pytest.mark.parametrize("nnz", [np.array([1 + 1j, 2]), np.array([1, 2], object), np.array(["1", "2"])])
def test_token_ranking_refuses_per_token_counts_that_are_not_real(nnz):
    """1-D counts were cast with astype: a complex count lost its imaginary part (a warning
    only) and strings were parsed as numbers, while 2-D activations of those dtypes raise."""
    with pytest.raises(TypeError, match=r"nnz has dtype .*; expected real per-token counts"):
        stats.token_ranking(["a", "b"], nnz)
