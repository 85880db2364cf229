"""The real-data showcase (``examples/train_sparse_lm.py``) on the CPU.

* The ``--smoke`` run end to end: both models train with finite losses, the
  L1 model is less active than the dense one, the results JSON and the
  figures are written.
* One training step's gradients through twellpy's FFN (chained with the
  jitted JAX pieces) equal those of the same step with the FFN and its L1
  penalty differentiated by JAX.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_sparse_lm.py"


def _load_module():
    spec = importlib.util.spec_from_file_location("train_sparse_lm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, MPLBACKEND="Agg", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, f"smoke run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads((out / "results.json").read_text())
    for name in ("dense", "sparse"):
        run = res[name]
        losses = [h["loss"] for h in run["history"]]
        assert losses and all(math.isfinite(v) for v in losses), (name, losses)
        assert math.isfinite(run["val_loss"]) and run["val_loss"] > 0
        assert losses[-1] < losses[0], f"{name} did not learn: {losses}"
        assert len(run["per_layer"]) == res["config"]["layers"]
        assert run["step_ms_median"] > 0
    assert res["dense"]["final_l1"] == 0.0 and res["sparse"]["final_l1"] > 0
    assert res["sparse"]["ffn_impl"] == "twellpy-hybrid" and res["dense"]["ffn_impl"] == "jax-dense"
    dense_act = res["dense"]["summary"]["mean_activity"]
    sparse_act = res["sparse"]["summary"]["mean_activity"]
    assert 0 <= sparse_act < dense_act, (sparse_act, dense_act)
    assert res["verdict"]["sparse_less_active_than_dense"] is True
    for key in ("first_tokens_fire_more", "rare_bytes_fire_more", "middle_layers_most_active"):
        assert isinstance(res["sparse"]["findings"][key]["reproduces"], bool)
    # inference timing: twellpy's FFN output matches the float32 reference
    assert res["inference"], res.get("inference_error")
    for row in res["inference"]:
        assert row["rel_err_twellpy"] < 1e-4, row
    figures = sorted(p.name for p in (out / "figures").glob("*.png"))
    assert figures == sorted(f"{m}_{f}.png" for m in ("dense", "sparse")
                             for f in ("nnz_vs_position", "nnz_per_layer", "top_bytes"))
    for f in figures:
        assert (out / "figures" / f).read_bytes()[:4] == b"\x89PNG"
    assert "paper finding" in r.stdout and "val loss" in r.stdout


def test_twellpy_step_matches_jax_gradients():
    # full float32 matmuls in XLA (a GPU would otherwise use TF32 and miss 1e-4)
    with jax.default_matmul_precision("float32"):
        _check_twellpy_step_matches_jax_gradients()


def _check_twellpy_step_matches_jax_gradients():
    mod = _load_module()
    args = mod.parse_args(["--smoke", "--dtype", "float32", "--layers", "2"])
    args.compute_dtype = "float32"
    params = mod.init_params(args, jax, jnp)
    pieces = mod.build_pieces(args, jax, jnp)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 256, size=(args.batch, args.seq)).astype(np.int32))
    targets = jnp.asarray(rng.integers(0, 256, size=(args.batch, args.seq)).astype(np.int32))
    l1 = 5e-3
    loss_t, grads_t, stats_t = mod.compute_grads(params, pieces, mod.TwellpyFFN(), tokens, targets, l1)
    loss_j, grads_j, stats_j = mod.compute_grads(params, pieces, mod.DenseJaxFFN(pieces), tokens, targets, l1)
    assert stats_j == [None, None] and all(s["l1_coef"] == l1 for s in stats_t)
    assert abs(float(loss_t) - float(loss_j)) < 1e-5 * abs(float(loss_j))
    flat_t, tree_t = jax.tree_util.tree_flatten(grads_t)
    flat_j, tree_j = jax.tree_util.tree_flatten(grads_j)
    assert tree_t == tree_j
    for a, b in zip(flat_t, flat_j):
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        assert a.shape == b.shape
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert err < 1e-4, err
    # the L1 term reached the FFN weights: without it the gate gradient changes
    _, grads_0, _ = mod.compute_grads(params, pieces, mod.TwellpyFFN(), tokens, targets, 0.0)
    diff = np.asarray(grads_t["ffn"][0]["w_up"]) - np.asarray(grads_0["ffn"][0]["w_up"])
    assert np.linalg.norm(diff) > 1e-3 * np.linalg.norm(np.asarray(grads_0["ffn"][0]["w_up"]))


def test_split_holds_out_ten_percent():
    mod = _load_module()
    train, val, n_docs = mod.load_corpus(with_docstrings=False)
    share = val.size / (train.size + val.size)
    assert n_docs > 50 and 0.09 < share < 0.11, share
    assert train.dtype == np.int32 and 0 <= train.min() and train.max() < 256


def test_l1_schedule_is_linear_warmup():
    mod = _load_module()
    args = mod.parse_args(["--smoke", "--steps", "100", "--l1", "1e-3", "--l1-warmup", "0.2"])
    vals = [mod.l1_at(s, args, args.l1) for s in range(100)]
    assert vals[0] == pytest.approx(1e-3 / 20)
    assert vals[9] == pytest.approx(1e-3 / 2)
    assert all(v == pytest.approx(1e-3) for v in vals[19:])
    assert all(b >= a for a, b in zip(vals, vals[1:]))


@pytest.mark.parametrize("argv, fragment", [
    (["--smoke", "--d-model", "30", "--heads", "4"], "multiple of --heads"),
    (["--smoke", "--l1", "-1"], "--l1"),
    (["--smoke", "--runs", "bogus"], "--runs"),
    (["--smoke", "--steps", "0"], "--steps"),
])
def test_bad_arguments(argv, fragment, capsys):
    mod = _load_module()
    with pytest.raises(SystemExit):
        mod.parse_args(argv)
    assert fragment in capsys.readouterr().err
