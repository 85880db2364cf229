"""twellpy.plot: every figure built headless (Agg) and its contents checked."""
import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

import twellpy as tw  # noqa: E402
from twellpy import plot, stats  # noqa: E402


@pytest.fixture(scope="module")
def acts3d():
    """(B, T, H) activations whose non-zeros decay with position like a power law."""
    rng = np.random.default_rng(0)
    b, t, h = 8, 48, 512
    scale = 1 + 3 * (np.arange(t) + 1.0) ** -0.7
    return np.maximum(rng.standard_normal((b, t, h)) * scale[None, :, None] - 2.6, 0)


def _legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_nnz_histogram(acts3d, tmp_path):
    fig = plot.nnz_histogram(acts3d, bins=20)
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "active neurons per token" and ax.get_ylabel() == "tokens"
    counts = stats.nnz_per_token(acts3d)
    assert len(ax.patches) == 20
    assert sum(p.get_height() for p in ax.patches) == counts.size
    mean_line = ax.lines[0]
    assert mean_line.get_xdata()[0] == pytest.approx(counts.mean())
    assert any(t.startswith("max ") and t.endswith(str(counts.max())) for t in _legend_texts(ax))
    fig.savefig(tmp_path / "hist.png")
    assert (tmp_path / "hist.png").stat().st_size > 1000
    # From per-token counts and from a container: same bars.
    fig2 = plot.nnz_histogram(counts, bins=20)
    assert [p.get_height() for p in fig2.axes[0].patches] == [p.get_height() for p in ax.patches]
    fig3 = plot.nnz_histogram(tw.ELL.from_dense(acts3d.reshape(-1, 512)), bins=20)
    assert [p.get_height() for p in fig3.axes[0].patches] == [p.get_height() for p in ax.patches]


def test_nnz_vs_position_draws_mean_and_trend(acts3d):
    fig = plot.nnz_vs_position(acts3d, trend="power")
    (ax,) = fig.axes
    mean_line, trend_line = ax.lines
    ps = stats.nnz_per_position(acts3d)
    np.testing.assert_allclose(mean_line.get_ydata(), ps.mean)
    assert len(mean_line.get_xdata()) == 48
    assert ax.get_xlabel() == "position in sequence"
    assert ax.get_ylabel() == "active neurons per token"
    texts = _legend_texts(ax)
    assert "mean" in texts and any(t.startswith("fit: ") for t in texts)
    trend = fig.twellpy_trend
    assert trend.kind == "power" and trend.b > 0  # a decay
    np.testing.assert_allclose(trend_line.get_ydata(), trend(trend_line.get_xdata()))
    # The fitted decay follows the data closely.
    resid = ps.mean - trend(ps.position)
    assert np.sqrt(np.mean(resid ** 2)) < 0.1 * ps.mean.mean()
    flat = plot.nnz_vs_position(acts3d.reshape(-1, 512), seq_len=48, trend=None, band=False)
    assert len(flat.axes[0].lines) == 1 and flat.twellpy_trend is None
    np.testing.assert_allclose(flat.axes[0].lines[0].get_ydata(), ps.mean)
    exp_fig = plot.nnz_vs_position(acts3d, trend="exp")
    assert exp_fig.twellpy_trend.kind == "exp"


def test_layer_summary():
    rng = np.random.default_rng(1)
    layers = {f"layer{i}": np.maximum(rng.standard_normal((40, 128)) - 1.5 + 0.2 * i, 0) for i in range(5)}
    fig = plot.layer_summary(layers)
    (ax,) = fig.axes
    ls = stats.nnz_per_layer(layers)
    from matplotlib.container import BarContainer

    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == 2 and [b.get_label() for b in bars] == ["mean", "max"]
    np.testing.assert_allclose([p.get_height() for p in bars[0]], ls.mean)
    np.testing.assert_allclose([p.get_height() for p in bars[1]], ls.max)
    assert [t.get_text() for t in ax.get_xticklabels()] == list(layers)
    assert ax.get_xlabel() == "layer"


def test_tile_heatmap(acts3d):
    a = acts3d.reshape(-1, 512)
    fig = plot.tile_heatmap(a, tile=128, slots=10, max_rows=100)
    ax = fig.axes[0]
    assert len(fig.axes) == 2  # image + colour bar
    (im,) = ax.images
    np.testing.assert_array_equal(im.get_array(), stats.tile_occupancy(a, 128)[:100])
    assert ax.get_xlabel() == "tile (width 128)" and ax.get_ylabel() == "token"
    assert fig.axes[1].get_ylabel() == "entries in tile"
    assert "100 of 384" in ax.get_title()
    # overflow outline drawn only when something overflows
    assert len(ax.collections) >= 1
    calm = plot.tile_heatmap(a, tile=128, slots=128)
    assert len(calm.axes[0].collections) == 0


def test_tile_occupancy_histogram_with_model(acts3d):
    a = acts3d.reshape(-1, 512)
    fig = plot.tile_occupancy_histogram(a, tile=128, slots=12)
    (ax,) = fig.axes
    hist = stats.tile_occupancy_histogram(a, 128)
    kmax = np.flatnonzero(hist).max()
    assert len(ax.patches) == kmax + 1
    np.testing.assert_allclose([p.get_height() for p in ax.patches], hist[:kmax + 1] / hist.sum())
    model_line = ax.lines[0]
    assert len(model_line.get_ydata()) == kmax + 1
    assert model_line.get_ydata().sum() == pytest.approx(1.0, abs=0.02)
    texts = _legend_texts(ax)
    emp = stats.empirical_overflow_rate(a, 12, tile=128)
    assert any(f"observed overflow {emp:.2e}" in t for t in texts)
    assert ax.get_yscale() == "log"


def test_top_tokens():
    rng = np.random.default_rng(2)
    toks = [bytes([c]) for c in rng.integers(97, 105, 300)]
    nnz = np.array([10 * (t[0] - 96) for t in toks]) + rng.integers(0, 3, 300)
    fig = plot.top_tokens(toks, nnz, k=3, title="bytes")
    most_ax, few_ax = fig.axes
    assert most_ax.get_title() == "most active neurons" and few_ax.get_title() == "fewest active neurons"
    assert [t.get_text() for t in most_ax.get_yticklabels()] == ["b'h'", "b'g'", "b'f'"]
    assert [t.get_text() for t in few_ax.get_yticklabels()] == ["b'a'", "b'b'", "b'c'"]
    assert len(most_ax.patches) == 3
    most, _ = stats.token_ranking(toks, nnz, k=3)
    np.testing.assert_allclose([p.get_width() for p in most_ax.patches], [r[1] for r in most])
    assert fig.get_suptitle() == "bytes"


def test_draw_into_existing_axes(acts3d):
    fig = Figure()
    ax = fig.add_subplot(1, 2, 2)
    out = plot.nnz_histogram(acts3d, ax=ax)
    assert out is fig and ax.get_xlabel() == "active neurons per token"


def test_frameworks_inputs(acts3d):
    torch = pytest.importorskip("torch")
    a = acts3d.reshape(-1, 512).astype(np.float32)
    fig = plot.tile_heatmap(torch.from_numpy(a), tile=128)
    np.testing.assert_array_equal(fig.axes[0].images[0].get_array(), stats.tile_occupancy(a, 128)[:512])


def test_missing_matplotlib_is_a_clear_error(monkeypatch, acts3d):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"twellpy\[plot\]"):
        plot.nnz_histogram(acts3d)


def test_tile_occupancy_histogram_names_its_model_argument(acts3d):
    """A bad ``model`` was reported as "kind must be 'mixture' or 'binomial'", the parameter name
    of stats.fit_overflow_model, not of this function."""
    with pytest.raises(ValueError, match=r"model must be 'mixture', 'binomial' or None, got 'gauss'"):
        plot.tile_occupancy_histogram(acts3d, tile=64, model="gauss")


def test_tile_occupancy_histogram_bad_model_draws_nothing_on_the_callers_axes(acts3d):
    """The model check ran after the "observed" bars were drawn, so a caller's ax kept a
    partial drawing when the call raised."""
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    with pytest.raises(ValueError, match="model must be"):
        plot.tile_occupancy_histogram(acts3d, tile=64, model="gauss", ax=ax)
    assert not ax.patches and not ax.lines
