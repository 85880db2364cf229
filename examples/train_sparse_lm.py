"""Train a small byte-level language model with twellpy's sparse FFN step, then serve it sparse.

A decoder-only transformer (default 4 layers, d_model 256, gated ReLU FFN of
1024 neurons, 4 heads, context 256, byte-level tokens) learns the Python
reference documentation that every Python ships (``pydoc_data.topics``) plus
the docstrings of the standard library (read with :mod:`ast`, nothing is
imported). Every 10th block of 4 KiB is held out for validation (10% of the
bytes).

Two runs with the same seed, data order, learning rates and steps (the sparse
run goes first; under ``--time-budget`` it may shorten itself, and the dense
run then replays exactly its steps):

1. **dense**: ReLU-gated FFN, L1 = 0, FFN forward/backward computed densely
   in JAX (jitted);
2. **sparse**: the same model with an L1 penalty on the FFN activations,
   warmed up linearly, and every FFN forward/backward computed by
   ``twellpy.ffn.gated_forward_train`` / ``gated_backward`` (Hybrid path:
   ELL rows plus dense backup rows for busy tokens).

How the step is put together. JAX computes everything but the FFNs: each
transformer block's attention part (``x + attn(norm(x))`` and the FFN input
``norm(h)``), the embedding and the loss are separate ``jax.jit`` functions.
The backward chains the VJPs layer by layer by hand: a jitted ``jax.vjp`` of
each piece (the piece's forward is recomputed inside it, which is cheap next
to the FFN), and twellpy's backward for each FFN. Arrays move between JAX and
twellpy through DLPack (zero-copy on the GPU); twellpy returns JAX arrays
because it is given JAX arrays. twellpy's backward already contains the
gradient of its L1 term ``l1 * sum|h| / M``, so the penalty is never
differentiated here. No PyTorch anywhere.

Reported: validation loss of both models (target: sparse within 3% of the
dense one), active neurons per token per layer (mean, max; target < 1% mean
activity), dead neurons, training-step times, FFN inference time on the
trained weights at M >= 16384 tokens (``twellpy.ffn.gated_forward`` against
the dense FFN, with relative errors), whether the paper's qualitative
findings reproduce (computed from the data), and figures made with
``twellpy.plot``. Results go to ``--out`` (default ``$OUT`` or
``./showcase_out``): ``results.json`` (rewritten after every phase, so a
crash late in the run loses nothing) and ``figures/*.png``.

Run (GPU, about 4 minutes on one H200)::

    PYTHONPATH=. python examples/train_sparse_lm.py --out $OUT

CPU smoke test (tiny model, a few steps, < 1 minute)::

    PYTHONPATH=. python examples/train_sparse_lm.py --smoke --out /tmp/showcase
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sysconfig
import time
from pathlib import Path

# Leave GPU memory to CuPy (twellpy's kernels allocate through it); JAX's
# default preallocation would take 75% of the device.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import numpy as np  # noqa: E402

VOCAB = 256  # byte-level tokens


# ---------------------------------------------------------------------------
# arguments
#: Defaults of the full run (about 4 minutes for both models on one H200).
FULL = dict(steps=1200, layers=4, d_model=256, ffn=1024, heads=4, batch=64, seq=256, lr=2e-3, l1=4e-3,
            eval_batches=4, eval_seqs=64, bench_m="16384,65536", time_budget=180.0)
#: Defaults of --smoke (tiny model, CPU, well under a minute).
SMOKE = dict(steps=8, layers=3, d_model=32, ffn=128, heads=2, batch=4, seq=32, lr=5e-3, l1=5e-3,
             eval_batches=1, eval_seqs=16, bench_m="512", time_budget=0.0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, help="optimizer steps of each model")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--ffn", type=int, help="FFN neurons H")
    ap.add_argument("--heads", type=int)
    ap.add_argument("--batch", type=int, help="sequences per step")
    ap.add_argument("--seq", type=int, help="context length T")
    ap.add_argument("--lr", type=float, help="peak AdamW learning rate")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--l1", type=float,
                    help="final L1 coefficient of the sparse run (twellpy's l1: penalty l1*sum|h|/M "
                         "per layer)")
    ap.add_argument("--l1-warmup", type=float, default=0.3,
                    help="fraction of the steps over which L1 grows linearly from 0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="FFN compute dtype (master weights stay float32); auto = bfloat16 on GPU")
    ap.add_argument("--eval-batches", type=int, help="validation batches of --eval-seqs sequences each")
    ap.add_argument("--eval-seqs", type=int,
                    help="sequences per validation batch (64 x 256 = 16384 tokens)")
    ap.add_argument("--time-budget", type=float,
                    help="seconds of training for the first run (sparse); if spent, it stops and the "
                         "other runs stop at the same step (0: no limit)")
    ap.add_argument("--eval-every", type=int, default=0, help="validation loss every N steps (0: 4 times)")
    ap.add_argument("--bench-m",
                    help="token counts M for the FFN inference timing (comma list)")
    ap.add_argument("--no-docstrings", action="store_true",
                    help="train on pydoc_data.topics only (no standard-library docstrings)")
    ap.add_argument("--runs", default="dense,sparse",
                    help="which models to train (comma list of dense, sparse, sparse-jax); "
                         "sparse-jax = L1 run with the FFN in JAX (a cross-check of twellpy)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, a few steps, CPU, < 60 s (what CI runs)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT or ./showcase_out)")
    ap.add_argument("--figures-dir", default=None,
                    help="also save the figures here (e.g. docs/images/showcase)")
    args = ap.parse_args(argv)
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        args.no_docstrings = True
    for name in ("steps", "layers", "d_model", "ffn", "heads", "batch", "seq", "eval_batches", "eval_seqs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        ap.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if args.l1 < 0 or not math.isfinite(args.l1):
        ap.error(f"--l1 must be a finite number >= 0, got {args.l1}")
    if args.time_budget < 0 or not math.isfinite(args.time_budget):
        ap.error(f"--time-budget must be a finite number >= 0, got {args.time_budget}")
    if not 0 <= args.l1_warmup <= 1:
        ap.error(f"--l1-warmup must be in [0, 1], got {args.l1_warmup}")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in ("dense", "sparse", "sparse-jax")]
    if bad or not runs or len(set(runs)) != len(runs):
        ap.error(f"--runs takes dense, sparse, sparse-jax; got {args.runs!r}")
    args.runs = runs
    try:
        args.bench_m = [int(m) for m in str(args.bench_m).split(",") if m.strip()]
    except ValueError:
        ap.error(f"--bench-m must be a comma list of ints, got {args.bench_m!r}")
    if any(m < 1 for m in args.bench_m):
        ap.error(f"--bench-m values must be >= 1, got {args.bench_m}")
    args.out = Path(args.out or os.environ.get("OUT") or "showcase_out")
    return args


# ---------------------------------------------------------------------------
# data
def stdlib_docstrings():
    """Docstrings of the standard library's top-level modules, read with ast (nothing is imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc)
    return docs


#: Steps after which a run with a time budget checks that it fits.
PROBE_STEPS = 30

#: Bytes per block of the train/validation split.
SPLIT_BLOCK = 4096


def load_corpus(with_docstrings):
    """Train/validation byte arrays: every 10th block of 4 KiB is held out (10% of the bytes).

    Blocks rather than whole documents, because the topics are few and of
    very uneven length; this keeps the share at 10% and spreads the held-out
    text over the whole corpus.
    """
    import pydoc_data.topics

    docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    if with_docstrings:
        docs += stdlib_docstrings()
    text = np.frombuffer("\n\n".join(docs).encode("utf-8"), dtype=np.uint8).astype(np.int32)
    block = np.arange(text.size) // SPLIT_BLOCK
    is_val = block % 10 == 9
    if not is_val.any():  # a corpus under 10 blocks: hold out its last 10%
        is_val = np.arange(text.size) >= int(0.9 * text.size)
    return text[~is_val], text[is_val], len(docs)


def batch_windows(data, starts, seq):
    idx = starts[:, None] + np.arange(seq + 1)[None, :]
    w = data[idx]
    return w[:, :-1], w[:, 1:]


# ---------------------------------------------------------------------------
# model (JAX pieces)
def init_params(args, jax, jnp):
    """Float32 parameters from a numpy RNG: every run starts from the same bits."""
    L, d, H, T = args.layers, args.d_model, args.ffn, args.seq
    rng = np.random.default_rng(args.seed)
    n = lambda shape, std: rng.standard_normal(shape).astype(np.float32) * np.float32(std)  # noqa: E731
    proj_std = 0.02 / math.sqrt(2 * L)
    params = {
        "emb": {"tok": n((VOCAB, d), 0.02), "pos": n((T, d), 0.01)},
        "blocks": [{"norm1": np.ones(d, np.float32), "wqkv": n((d, 3 * d), 0.02),
                    "wo": n((d, d), proj_std), "norm2": np.ones(d, np.float32)} for _ in range(L)],
        "ffn": [{"w_gate": n((H, d), 0.02), "w_up": n((H, d), 0.02), "w_down": n((d, H), proj_std)}
                for _ in range(L)],
        "head": {"norm": np.ones(d, np.float32), "w_out": n((d, VOCAB), 0.02)},
    }
    return jax.tree.map(jnp.asarray, params)


def build_pieces(args, jax, jnp):
    """The jitted pieces of the model (compiled once, shared by every run)."""
    d, nh = args.d_model, args.heads
    cdt = jnp.dtype(args.compute_dtype)

    def rmsnorm(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

    def attention(p, x):
        B, T_, _ = x.shape
        qkv = (rmsnorm(x, p["norm1"]) @ p["wqkv"]).reshape(B, T_, 3, nh, d // nh)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(d // nh)
        causal = jnp.tril(jnp.ones((T_, T_), bool))
        s = jnp.where(causal, s, -1e30)
        a = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhe->bqhe", a, v).reshape(B, T_, d)
        return o @ p["wo"]

    def embed(p, tokens):
        return p["tok"][tokens] + p["pos"][: tokens.shape[1]]

    def block_pre(p, x_prev, y_prev):
        """x = x_prev + y_prev (previous FFN output); h = x + attn(x); z = norm(h) -> FFN input."""
        x = x_prev + y_prev.reshape(x_prev.shape).astype(x_prev.dtype)
        h = x + attention(p, x)
        z = rmsnorm(h, p["norm2"]).reshape(-1, d).astype(cdt)
        return h, z

    def head_loss(p, h, y, targets):
        x = h + y.reshape(h.shape).astype(h.dtype)
        logits = rmsnorm(x, p["norm"]) @ p["w_out"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    def block_pre_vjp(p, x_prev, y_prev, g_h, g_z):
        _, vjp = jax.vjp(block_pre, p, x_prev, y_prev)
        return vjp((g_h, g_z))

    def embed_vjp(p, tokens, g_x):
        _, vjp = jax.vjp(lambda q: embed(q, tokens), p)
        return vjp(g_x)[0]

    def dense_ffn(w, z):
        g = jax.nn.relu(z @ w["w_gate"].T)  # gradient 0 at 0, like twellpy (jnp.maximum splits ties)
        h = g * (z @ w["w_up"].T)
        return h @ w["w_down"].T, h

    def dense_ffn_vjp(w, z, dy, l1):
        """Gradients of sum(y * dy) + l1 * sum|h| / M: the same objective twellpy's backward uses."""
        def obj(w_, z_):
            y, h = dense_ffn(w_, z_)
            M = z_.shape[0]
            return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) + \
                l1 * jnp.sum(jnp.abs(h.astype(jnp.float32))) / M
        return jax.grad(obj, argnums=(0, 1))(w, z)

    def ffn_counts(w_gate, z):
        """Active neurons per token (M,) and tokens per neuron (H,) of the gate."""
        act = (z @ w_gate.T) > 0
        return act.sum(axis=1, dtype=jnp.int32), act.sum(axis=0, dtype=jnp.int32)

    def cast_ffn(ffn):
        return jax.tree.map(lambda a: a.astype(cdt), ffn)

    pieces = {
        "embed": jax.jit(embed),
        "block_pre": jax.jit(block_pre),
        "block_pre_vjp": jax.jit(block_pre_vjp),
        "embed_vjp": jax.jit(embed_vjp),
        "head_loss": jax.jit(head_loss),
        "head_grad": jax.jit(jax.value_and_grad(head_loss, argnums=(0, 1, 2))),
        "dense_ffn": jax.jit(lambda w, z: dense_ffn(w, z)[0]),
        "dense_ffn_vjp": jax.jit(dense_ffn_vjp),
        "ffn_counts": jax.jit(ffn_counts),
        "cast_ffn": jax.jit(cast_ffn),
    }
    return pieces


def make_adamw(args, jax, jnp):
    """Hand-written AdamW with global-norm clipping (optax is not needed; identical on CPU and GPU)."""
    b1, b2, eps, wd = 0.9, 0.95, 1e-8, args.weight_decay

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return {"m": zeros, "v": jax.tree.map(jnp.zeros_like, params), "t": jnp.zeros((), jnp.int32)}

    @jax.jit
    def update(params, grads, state, lr):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        scale = jnp.minimum(1.0, 1.0 / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
        t = state["t"] + 1
        m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, state["m"], grads)
        v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, state["v"], grads)
        c1 = 1 - b1 ** t.astype(jnp.float32)
        c2 = 1 - b2 ** t.astype(jnp.float32)

        def step(p, m_, v_):
            decay = wd * p if p.ndim >= 2 else 0.0  # no decay on norm scales
            return p - lr * ((m_ / c1) / (jnp.sqrt(v_ / c2) + eps) + decay)

        params = jax.tree.map(step, params, m, v)
        return params, {"m": m, "v": v, "t": t}, norm

    return init, update


def lr_at(step, args):
    """Linear warmup (5% of the steps), then cosine decay to 10% of the peak."""
    warm = max(1, int(0.05 * args.steps))
    if step < warm:
        return args.lr * (step + 1) / warm
    frac = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def l1_at(step, args, final_l1):
    """The paper's schedule: L1 grows linearly from 0 over the warmup fraction, then stays."""
    warm = int(args.l1_warmup * args.steps)
    if warm <= 0:
        return final_l1
    return final_l1 * min(1.0, (step + 1) / warm)


# ---------------------------------------------------------------------------
# FFN implementations: the same interface for JAX-dense and twellpy
class DenseJaxFFN:
    """FFN forward/backward in JAX (jitted), densely; ``l1`` adds the penalty's gradient like twellpy."""

    name = "jax-dense"

    def __init__(self, pieces):
        self.p = pieces

    def infer(self, w, z):
        return self.p["dense_ffn"](w, z)

    def forward(self, w, z, l1):
        return self.p["dense_ffn"](w, z), (w, z, l1)

    def backward(self, ctx, dy):
        w, z, l1 = ctx
        gw, dz = self.p["dense_ffn_vjp"](w, z, dy, l1)
        return dz, gw

    def stats(self, ctx):
        return None


class TwellpyFFN:
    """FFN forward/backward by twellpy's training step, called eagerly on the JAX arrays (DLPack)."""

    name = "twellpy-hybrid"

    def __init__(self):
        import twellpy.ffn

        self.ffn = twellpy.ffn

    def infer(self, w, z):
        return self.ffn.gated_forward(z, w["w_gate"], w["w_up"], w["w_down"], check_finite=False)

    def forward(self, w, z, l1):
        y, ctx = self.ffn.gated_forward_train(z, w["w_gate"], w["w_up"], w["w_down"], l1=l1,
                                              width="auto", check_finite=False)
        return y, ctx

    def backward(self, ctx, dy):
        dz, dwg, dwu, dwd = self.ffn.gated_backward(ctx, dy)
        return dz, {"w_gate": dwg, "w_up": dwu, "w_down": dwd}

    def stats(self, ctx):
        return ctx.stats


# ---------------------------------------------------------------------------
# one training step, chained by hand
def forward_chain(params, ffn_w, pieces, ffn, tokens, l1):
    """Forward through every layer; returns what the backward needs and the FFN contexts."""
    x = pieces["embed"](params["emb"], tokens)
    y = None
    saved, ctxs = [], []
    for li, bp in enumerate(params["blocks"]):
        y_in = y if y is not None else zeros_like_ffn_out(x, ffn_w[li])
        h, z = pieces["block_pre"](bp, x, y_in)
        y, ctx = ffn.forward(ffn_w[li], z, l1)
        saved.append((x, y_in))
        ctxs.append(ctx)
        x = h
    return x, y, saved, ctxs


_ZEROS = {}


def zeros_like_ffn_out(x, w):
    import jax.numpy as jnp

    key = (x.shape, str(w["w_down"].dtype))
    if key not in _ZEROS:
        _ZEROS[key] = jnp.zeros((x.shape[0] * x.shape[1], x.shape[2]), w["w_down"].dtype)
    return _ZEROS[key]


def compute_grads(params, pieces, ffn, tokens, targets, l1):
    """Loss and gradients of one batch: jitted JAX pieces chained with the FFN implementation.

    The FFN's backward adds the gradient of its L1 term itself (twellpy's
    contract, mirrored by :class:`DenseJaxFFN`), so ``l1`` is not part of
    the returned loss.
    """
    ffn_w = pieces["cast_ffn"](params["ffn"])
    h_last, y_last, saved, ctxs = forward_chain(params, ffn_w, pieces, ffn, tokens, l1)
    loss, (g_head, g_h, g_y) = pieces["head_grad"](params["head"], h_last, y_last, targets)
    n_layers = len(params["blocks"])
    g_blocks, g_ffn = [None] * n_layers, [None] * n_layers
    for li in reversed(range(n_layers)):
        dz, g_ffn[li] = ffn.backward(ctxs[li], g_y)
        x_prev, y_prev = saved[li]
        # block li computed x = x_prev + y_prev, so both receive the same cotangent
        g_blocks[li], g_h, g_y = pieces["block_pre_vjp"](params["blocks"][li], x_prev, y_prev, g_h, dz)
    g_emb = pieces["embed_vjp"](params["emb"], tokens, g_h)
    grads = {"emb": g_emb, "blocks": g_blocks, "ffn": g_ffn, "head": g_head}
    return loss, grads, [ffn.stats(c) for c in ctxs]


def train_step(params, opt_state, pieces, update, ffn, tokens, targets, lr, l1, jnp):
    loss, grads, stats = compute_grads(params, pieces, ffn, tokens, targets, l1)
    params, opt_state, gnorm = update(params, grads, opt_state, jnp.float32(lr))
    return params, opt_state, loss, gnorm, stats


# ---------------------------------------------------------------------------
# evaluation
def evaluate(params, pieces, ffn, val_batches, collect=False):
    """Mean validation cross-entropy; with ``collect``, per-layer token/neuron counts and activations."""
    ffn_w = pieces["cast_ffn"](params["ffn"])
    losses = []
    L = len(params["blocks"])
    tok_counts = [[] for _ in range(L)]
    neuron_counts = [None] * L
    first_acts, first_z = [None] * L, [None] * L
    for bi, (tokens, targets) in enumerate(val_batches):
        x = pieces["embed"](params["emb"], tokens)
        y = zeros_like_ffn_out(x, ffn_w[0])
        for li, bp in enumerate(params["blocks"]):
            h, z = pieces["block_pre"](bp, x, y)
            if collect and isinstance(ffn, TwellpyFFN):
                y, ctx = ffn.forward(ffn_w[li], z, 0.0)
                tc = np.asarray(_host(ctx.stats["token_counts"]))
                nc = np.asarray(_host(ctx.stats["neuron_counts"])).astype(np.int64)
                if bi == 0:
                    first_acts[li] = ctx.g  # Hybrid: for the per-layer figure
            else:
                y = ffn.infer(ffn_w[li], z)
                if collect:
                    tc_j, nc_j = pieces["ffn_counts"](ffn_w[li]["w_gate"], z)
                    tc, nc = np.asarray(tc_j), np.asarray(nc_j).astype(np.int64)
                    if bi == 0:
                        first_acts[li] = np.asarray(
                            (np.asarray(z, np.float32) @ np.asarray(ffn_w[li]["w_gate"], np.float32).T) > 0)
            if collect:
                tok_counts[li].append(tc)
                neuron_counts[li] = nc if neuron_counts[li] is None else neuron_counts[li] + nc
                if bi == 0:
                    first_z[li] = z
            x = h
        losses.append(float(pieces["head_loss"](params["head"], x, y, targets)))
    out = {"val_loss": float(np.mean(losses))}
    if collect:
        out.update(token_counts=[np.concatenate(t) for t in tok_counts], neuron_counts=neuron_counts,
                   first_acts=first_acts, first_z=first_z)
    return out


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


# ---------------------------------------------------------------------------
# sparsity analysis: the paper's qualitative findings, computed from data
def spearman(a, b):
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    ra -= ra.mean()
    rb -= rb.mean()
    den = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den else float("nan")


def analyse(ev, val_tokens, train_data, args):
    """Per-layer activity, dead neurons and the paper's three qualitative checks."""
    L, H, T = args.layers, args.ffn, args.seq
    counts = ev["token_counts"]
    per_layer = []
    for li in range(L):
        c = counts[li].astype(np.int64)
        per_layer.append({"layer": li, "mean": float(c.mean()), "max": int(c.max()),
                          "activity": float(c.mean() / H),
                          "dead_fraction": float((ev["neuron_counts"][li] == 0).mean())})
    all_counts = np.stack([c.astype(np.int64) for c in counts])  # (L, M_eval)
    mean_tok = all_counts.mean(axis=0)  # mean over layers, per token
    # first tokens: positions 0-3 against the second half of the context
    pos = mean_tok.reshape(-1, T).mean(axis=0)
    first = float(pos[: min(4, T)].mean())
    later = float(pos[T // 2:].mean()) if T >= 2 else first
    # rare bytes: Spearman correlation of a byte's training frequency with its mean activity
    freq = np.bincount(train_data, minlength=VOCAB).astype(np.float64)
    tok = val_tokens.reshape(-1)
    occ = np.bincount(tok, minlength=VOCAB)
    sums = np.bincount(tok, weights=mean_tok, minlength=VOCAB)
    seen = occ >= 5
    rho = spearman(freq[seen], sums[seen] / occ[seen]) if seen.sum() >= 3 else float("nan")
    layer_means = np.array([p["mean"] for p in per_layer])
    top_layer = int(np.argmax(layer_means))
    findings = {
        "first_tokens_fire_more": {
            "mean_nnz_positions_0_3": first, "mean_nnz_second_half": later,
            "ratio": first / later if later else float("inf"), "reproduces": bool(first > later)},
        "rare_bytes_fire_more": {
            "spearman_frequency_vs_nnz": rho, "bytes_compared": int(seen.sum()),
            "reproduces": bool(rho < 0)},
        "middle_layers_most_active": {
            "layer_means": layer_means.tolist(), "most_active_layer": top_layer,
            "reproduces": bool(L >= 3 and 0 < top_layer < L - 1)},
    }
    total_neurons = L * H
    dead = sum(int((nc == 0).sum()) for nc in ev["neuron_counts"])
    summary = {
        "mean_active_per_token": float(layer_means.mean()),
        "mean_activity": float(layer_means.mean() / H),
        "max_active_per_token": int(max(p["max"] for p in per_layer)),
        "dead_fraction": dead / total_neurons,
        "eval_tokens": int(all_counts.shape[1]),
    }
    return {"per_layer": per_layer, "summary": summary, "findings": findings, "position_mean": pos.tolist()}


def save_figures(ev, val_tokens, args, dirs, tag):
    """Figures with twellpy.plot: nnz vs position, nnz per layer, bytes firing the most/fewest neurons."""
    import twellpy.plot as twplot

    saved = []

    def save(fig, name):
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            fig.savefig(d / name, dpi=110)
        saved.append(name)

    L = args.layers
    # integer counts summed over the layers (the stats functions take whole counts)
    total = np.stack([c.astype(np.int64) for c in ev["token_counts"]]).sum(axis=0)
    what = f"active neurons per token, sum of {L} layers"
    try:
        fig = twplot.nnz_vs_position(total, seq_len=args.seq, title=f"{tag}: {what}")
    except (ValueError, RuntimeError):  # a degenerate curve the trend cannot fit (tiny smoke runs)
        fig = twplot.nnz_vs_position(total, seq_len=args.seq, trend=None, title=f"{tag}: {what}")
    save(fig, f"{tag}_nnz_vs_position.png")
    layers = {f"L{li}": ev["first_acts"][li] for li in range(L)}
    save(twplot.layer_summary(layers, title=f"{tag}: active neurons per token by layer"),
         f"{tag}_nnz_per_layer.png")
    labels = [bytes([b]) for b in val_tokens.reshape(-1).tolist()]
    save(twplot.top_tokens(labels, total, k=12, min_count=5,
                           title=f"{tag}: bytes firing the most / fewest neurons ({what})"),
         f"{tag}_top_bytes.png")
    return saved


# ---------------------------------------------------------------------------
# FFN inference timing on the trained weights
def bench_inference(layers, ms, jax, jnp, on_gpu, reps):
    """Prepared twellpy.ffn.GatedFFN against the dense FFN (jitted JAX) in the same dtype, at M tokens.

    ``layers`` is a list of ``(layer, float32 weights, FFN inputs z, mean
    active neurons per token)``; z is repeated to M rows. Errors are against a float32 reference computed
    with ``precision="highest"`` from the same (rounded) inputs.
    """
    import twellpy.ffn as twffn

    dense = jax.jit(lambda z, a, b, c: (jnp.maximum(z @ a.T, 0) * (z @ b.T)) @ c.T)
    ref_fn = jax.jit(lambda z, a, b, c: jnp.dot(jnp.maximum(jnp.dot(z, a.T, precision="highest"), 0)
                                                * jnp.dot(z, b.T, precision="highest"), c.T,
                                                precision="highest"))

    def sync(a):
        if hasattr(a, "block_until_ready"):
            a.block_until_ready()
        if on_gpu:
            import cupy

            cupy.cuda.get_current_stream().synchronize()

    def timeit(fn):
        out = fn()
        sync(out)  # warm-up (compiles)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            sync(out)
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3, out

    rows = []
    for (layer, ffn_w32, z0, active), M in ((lz, M) for lz in layers for M in ms):
        cdt = z0.dtype
        wgc, wuc, wdc = (ffn_w32[k].astype(cdt) for k in ("w_gate", "w_up", "w_down"))
        reps_needed = -(-M // z0.shape[0])
        z = jnp.concatenate([z0] * reps_needed, axis=0)[:M]
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        ref = ref_fn(f32(z), f32(wgc), f32(wuc), f32(wdc))
        t_dense, y_dense = timeit(lambda: dense(z, wgc, wuc, wdc))
        # prepared once, as a server would (the one-shot gated_forward prepares
        # the weights on every call); jax arrays in and out through DLPack
        sparse_ffn = twffn.GatedFFN(wgc, wuc, wdc, mode="sparse", check_finite=False)
        auto_ffn = twffn.GatedFFN(wgc, wuc, wdc, mode="auto", check_finite=False)
        t_sparse, y_sparse = timeit(lambda: sparse_ffn(z))
        t_auto, _ = timeit(lambda: auto_ffn(z))
        native = {}
        if on_gpu:
            # the same prepared objects on cupy arrays, converted once: the
            # library's own time without the per-call jax <-> cupy conversions,
            # next to the dense cuBLAS path of the same object (mode="dense")
            import cupy as cp

            zc = cp.from_dlpack(z)
            native["twellpy_sparse_cupy_ms"] = timeit(lambda: sparse_ffn(zc))[0]
            native["dense_cublas_cupy_ms"] = timeit(lambda: sparse_ffn(zc, mode="dense"))[0]

        def err(y):
            y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
            r = np.asarray(ref, np.float64)
            return float(np.linalg.norm(y - r) / max(np.linalg.norm(r), 1e-300))

        rows.append({"layer": layer, "M": M, "dense_ms": t_dense, "twellpy_sparse_ms": t_sparse,
                     "twellpy_auto_ms": t_auto, "active_per_token": float(active),
                     "speedup_sparse": t_dense / t_sparse, "rel_err_dense": err(y_dense),
                     "rel_err_twellpy": err(y_sparse), **native})
    return rows


# ---------------------------------------------------------------------------
class Results:
    """The results JSON, rewritten atomically after every phase."""

    def __init__(self, path):
        self.path = path
        self.data = {}

    def update(self, **kw):
        self.data.update(kw)
        self.write()

    def write(self):
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        os.replace(tmp, self.path)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def run_model(kind, args, jax, jnp, pieces, optimizer, data, res, log, schedule=None, time_budget=None):
    """Train one model; return its final parameters and a record of the run.

    ``kind``: ``"dense"`` (JAX FFN, L1 = 0), ``"sparse"`` (twellpy FFN, L1 on) or
    ``"sparse-jax"`` (JAX FFN with the same L1: a cross-check of twellpy).
    ``schedule``: the ``(lr, l1_fraction)`` of every step of an earlier run,
    replayed exactly (same steps, same learning rates). Without it the run
    follows ``args.steps``; with a ``time_budget`` (seconds) it measures its
    steady step time after :data:`PROBE_STEPS` steps and, if the run would
    not fit, shortens ``args.steps`` (the schedules adapt) -- and as a last
    guard stops once the budget is spent.
    """
    params = init_params(args, jax, jnp)
    init, update = optimizer
    opt_state = init(params)
    ffn = TwellpyFFN() if kind == "sparse" else DenseJaxFFN(pieces)
    final_l1 = 0.0 if kind == "dense" else args.l1
    train, val_batches = data["train"], data["val_batches"]
    rng = np.random.default_rng(args.seed + 1)  # same batches for every run
    eval_every = args.eval_every or max(1, args.steps // 4)
    history, step_times = [], []
    from twellpy.stats import FiringTracker

    trackers = [FiringTracker(n_neurons=args.ffn, window=50) for _ in range(args.layers)]
    t_start = time.perf_counter()
    used = []  # (lr, l1 fraction of final) of every step: what later runs replay
    log_every = max(1, args.steps // 20)
    stopped_early = False
    step = 0
    while step < (len(schedule) if schedule is not None else args.steps):
        steps = len(schedule) if schedule is not None else args.steps
        starts = rng.integers(0, train.size - args.seq - 1, size=args.batch)
        tokens, targets = batch_windows(train, starts, args.seq)
        if schedule is not None:
            lr, l1_frac = schedule[step]
        else:
            lr, l1_frac = lr_at(step, args), l1_at(step, args, 1.0)
        l1 = final_l1 * l1_frac
        used.append((lr, l1_frac))
        t0 = time.perf_counter()
        params, opt_state, loss, gnorm, stats = train_step(
            params, opt_state, pieces, update, ffn, jnp.asarray(tokens), jnp.asarray(targets), lr, l1, jnp)
        jax.block_until_ready((loss, params))  # the time below is a whole step, optimizer included
        step_times.append(time.perf_counter() - t0)
        last = step == steps - 1
        if stats[0] is not None and step >= steps - trackers[0].window:
            for tr, s in zip(trackers, stats):
                tr.update_counts(_host(s["neuron_counts"]), args.batch * args.seq)
        elapsed = time.perf_counter() - t_start
        over_budget = bool(time_budget) and elapsed > time_budget and not last
        if time_budget and schedule is None and step == PROBE_STEPS:
            per_step = float(np.median(step_times[5:]))
            fit = step + 1 + int((time_budget - elapsed) / per_step)
            if fit < args.steps:
                log(f"[{kind}] {per_step * 1e3:.1f} ms per step: {args.steps} steps would exceed the "
                    f"{time_budget:.0f} s budget; training {fit} steps instead (every run)")
                args.steps = max(fit, step + 2)
                log_every = max(1, args.steps // 20)
        if step % log_every == 0 or last or over_budget:
            loss = float(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"{kind}: loss became {loss} at step {step}")
            rec = {"step": step, "loss": loss, "lr": lr, "l1": l1, "grad_norm": float(gnorm),
                   "step_ms": step_times[-1] * 1e3}
            l0s = ""
            if stats[0] is not None:
                rec["l0_per_layer"] = [float(s["l0"]) for s in stats]
                rec["l1_penalty"] = sum(float(s["l1"]) for s in stats)
                rec["backup_rows"] = [int(s["n_backup_rows"]) for s in stats]
                l0s = f" l0/layer {[round(v, 1) for v in rec['l0_per_layer']]}"
            if step and step % eval_every == 0:
                rec["val_loss"] = evaluate(params, pieces, ffn, val_batches[:1])["val_loss"]
            history.append(rec)
            log(f"[{kind}] step {step:5d} loss {loss:.4f} lr {lr:.2e} l1 {l1:.2e} "
                f"{step_times[-1] * 1e3:7.1f} ms{l0s}")
            res.update(**{f"{kind}_progress": history})
        step += 1
        if over_budget:
            stopped_early = True
            log(f"[{kind}] time budget of {time_budget:.0f} s spent: stopping after {step} of "
                f"{args.steps} steps (the other runs replay the same {step} steps)")
            break
    train_s = time.perf_counter() - t_start
    steady = step_times[min(len(step_times) - 1, max(2, len(step_times) // 10)):]
    last_quarter = step_times[-max(1, len(step_times) // 4):]
    record = {"ffn_impl": ffn.name, "final_l1": final_l1, "train_seconds": train_s,
              "steps_done": len(step_times), "stopped_early": stopped_early, "schedule": used,
              "step_ms_median": float(np.median(steady)) * 1e3,
              # once L1 has made the FFNs sparse: the steady state of the sparse run
              "step_ms_median_last_quarter": float(np.median(last_quarter)) * 1e3,
              "step_ms_first": step_times[0] * 1e3, "history": history}
    if stats[0] is not None:
        if trackers[0].n_updates:
            record["train_dead_fraction_last_steps"] = float(np.mean([tr.dead_fraction() for tr in trackers]))
        record["train_backup_rows_last_step"] = [int(s["n_backup_rows"]) for s in stats]
        record["train_width_last_step"] = [int(s["width"]) for s in stats]
    return params, pieces, ffn, record


def main(argv=None):
    args = parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    fig_dirs = [out / "figures"] + ([Path(args.figures_dir)] if args.figures_dir else [])
    res = Results(out / "results.json")
    logf = open(out / "log.txt", "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    from twellpy import gpu_available

    platform = jax.devices()[0].platform
    on_gpu = platform in ("gpu", "cuda")
    if on_gpu and not gpu_available():
        raise SystemExit("JAX runs on a GPU but CuPy sees none: twellpy would not share the device")
    args.compute_dtype = ("bfloat16" if on_gpu else "float32") if args.dtype == "auto" else args.dtype
    t0 = time.perf_counter()
    train, val, n_docs = load_corpus(not args.no_docstrings)
    # fixed validation batches: consecutive, non-overlapping windows spread over the held-out text
    n_val = args.eval_batches * args.eval_seqs
    span = args.seq + 1
    if val.size < span * 2:
        raise SystemExit(f"validation text has {val.size} bytes, too short for --seq {args.seq}")
    starts = np.linspace(0, val.size - span, n_val).astype(np.int64)
    val_batches_np = [batch_windows(val, starts[i * args.eval_seqs:(i + 1) * args.eval_seqs], args.seq)
                      for i in range(args.eval_batches)]
    val_batches = [(jnp.asarray(a), jnp.asarray(b)) for a, b in val_batches_np]
    val_tokens = np.concatenate([a for a, _ in val_batches_np])
    data = {"train": train, "val_batches": val_batches}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    res.update(config=config, device=str(jax.devices()[0]), jax=jax.__version__,
               corpus={"documents": n_docs, "train_bytes": int(train.size), "val_bytes": int(val.size),
                       "load_seconds": time.perf_counter() - t0})
    log(f"corpus: {n_docs} documents, {train.size} train bytes, {val.size} validation bytes; "
        f"device {jax.devices()[0]}, FFN dtype {args.compute_dtype}")

    runs = {}
    pieces = build_pieces(args, jax, jnp)
    optimizer = make_adamw(args, jax, jnp)
    schedule = None
    # the run whose speed is least known goes first; if it spends its time
    # budget, the others stop at the same step so the comparison stays fair
    order = sorted(args.runs, key=lambda r: r != "sparse")
    for name in order:
        params, pieces, ffn, record = run_model(name, args, jax, jnp, pieces, optimizer, data, res, log,
                                                schedule=schedule,
                                                time_budget=args.time_budget if schedule is None else None)
        schedule = record.pop("schedule")
        res.update(**{name: record})  # the training record is safe before evaluation starts
        try:
            ev = evaluate(params, pieces, ffn, val_batches, collect=True)
            record["val_loss"] = ev["val_loss"]
            record.update(analyse(ev, val_tokens, train, args))
        except Exception as exc:  # keep going: the other runs and the JSON matter more
            record["evaluation_error"] = repr(exc)
            res.update(**{name: record})
            log(f"[{name}] evaluation failed: {exc!r}")
            continue
        runs[name] = {"params": params, "ffn": ffn, "ev": ev}
        res.update(**{name: record})
        try:
            record["figures"] = save_figures(ev, val_tokens, args, fig_dirs, name)
        except Exception as exc:  # figures must never lose the numbers
            record["figures_error"] = repr(exc)
            log(f"[{name}] figures failed: {exc!r}")
        res.update(**{name: record})
        s = record["summary"]
        log(f"[{name}] val loss {ev['val_loss']:.4f}; active/token mean {s['mean_active_per_token']:.1f} "
            f"({100 * s['mean_activity']:.2f}%), max {s['max_active_per_token']}; "
            f"dead {100 * s['dead_fraction']:.1f}%; step {record['step_ms_median']:.1f} ms")

    # inference timing on the trained sparse weights
    bench = None
    if "sparse" in runs:
        sp = runs["sparse"]
        try:
            layers = range(1 if args.smoke else args.layers)
            per_layer = res.data["sparse"]["per_layer"]
            bench = bench_inference([(li, sp["params"]["ffn"][li], sp["ev"]["first_z"][li], per_layer[li]["mean"])
                                     for li in layers],
                                    args.bench_m, jax, jnp, on_gpu, reps=2 if args.smoke else 30)
            res.update(inference=bench)
        except Exception as exc:
            res.update(inference_error=repr(exc))
            log(f"inference timing failed: {exc!r}")

    verdict = summarize(res.data, args, bench, log)
    res.update(verdict=verdict)
    log(f"results: {out / 'results.json'}; figures: {', '.join(str(d) for d in fig_dirs)}")
    logf.close()
    return res.data


def summarize(data, args, bench, log):
    """Print the results table and the verdicts; return them as a dict."""
    log("")
    log("=" * 78)
    hdr = (f"{'model':<12}{'val loss':>10}{'act/tok':>10}{'activity':>10}{'max act':>9}{'dead':>8}"
           f"{'step ms':>10}{'last 1/4':>10}")
    log(hdr)
    for name in ("dense", "sparse", "sparse-jax"):
        r = data.get(name)
        if not r or "summary" not in r:
            continue
        s = r["summary"]
        log(f"{name:<12}{r['val_loss']:>10.4f}{s['mean_active_per_token']:>10.1f}"
            f"{100 * s['mean_activity']:>9.2f}%{s['max_active_per_token']:>9d}"
            f"{100 * s['dead_fraction']:>7.1f}%{r['step_ms_median']:>10.1f}"
            f"{r['step_ms_median_last_quarter']:>10.1f}")
    verdict = {}
    sp, de = data.get("sparse"), data.get("dense")
    if sp and de and "val_loss" in sp and "val_loss" in de:
        gap = sp["val_loss"] / de["val_loss"] - 1
        verdict["val_loss_gap"] = gap
        verdict["within_3_percent"] = bool(gap <= 0.03)
        verdict["activity_below_1_percent"] = bool(sp["summary"]["mean_activity"] < 0.01)
        verdict["sparse_less_active_than_dense"] = bool(
            sp["summary"]["mean_activity"] < de["summary"]["mean_activity"])
        verdict["step_time_ratio_sparse_over_dense"] = sp["step_ms_median"] / de["step_ms_median"]
        verdict["step_time_ratio_last_quarter"] = (sp["step_ms_median_last_quarter"]
                                                   / de["step_ms_median_last_quarter"])
        log(f"sparse val loss is {100 * gap:+.2f}% vs dense (target <= +3%): "
            f"{'OK' if verdict['within_3_percent'] else 'MISSED'}; mean activity "
            f"{100 * sp['summary']['mean_activity']:.2f}% (target < 1%): "
            f"{'OK' if verdict['activity_below_1_percent'] else 'MISSED'}")
    if sp and "per_layer" in sp:
        log("sparse, per layer: " + "; ".join(
            f"L{p['layer']} mean {p['mean']:.1f} max {p['max']} dead {100 * p['dead_fraction']:.1f}%"
            for p in sp["per_layer"]))
        for key, f in sp["findings"].items():
            detail = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in f.items() if k != "reproduces"}
            log(f"paper finding '{key}': {'reproduces' if f['reproduces'] else 'does NOT reproduce'} {detail}")
        verdict["findings"] = {k: f["reproduces"] for k, f in sp["findings"].items()}
    if bench:
        log(f"{'layer':>5}{'act/tok':>9}{'M':>8}{'dense ms':>10}{'twellpy ms':>12}{'auto ms':>9}{'speedup':>9}"
            f"{'err dense':>11}{'err twellpy':>13}")
        for r in bench:
            log(f"{r['layer']:>5}{r['active_per_token']:>9.1f}{r['M']:>8}{r['dense_ms']:>10.3f}{r['twellpy_sparse_ms']:>12.3f}"
                f"{r['twellpy_auto_ms']:>9.3f}{r['speedup_sparse']:>8.2f}x{r['rel_err_dense']:>11.2e}"
                f"{r['rel_err_twellpy']:>13.2e}")
        if "twellpy_sparse_cupy_ms" in bench[0]:
            log("same prepared FFNs on cupy arrays (no per-call jax <-> cupy conversion):")
            for r in bench:
                log(f"  layer {r['layer']} M {r['M']}: dense cuBLAS {r['dense_cublas_cupy_ms']:.3f} ms, "
                    f"twellpy sparse {r['twellpy_sparse_cupy_ms']:.3f} ms "
                    f"({r['dense_cublas_cupy_ms'] / r['twellpy_sparse_cupy_ms']:.2f}x)")
    log("=" * 78)
    return verdict


if __name__ == "__main__":
    main()
