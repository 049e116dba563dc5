"""How much does `diag.nan.locate` cost next to one eager run, and next to `jax_debug_nans`?

For each function prints, side by side in one run (warm: every variant is run once first so
compilation is not counted; medians of interleaved repeats, with min/max):
  jit      the function as written (jitted), one call
  eager    one call under `jax.disable_jit()` (op by op, what "eager" means in JAX)
  locate   `diag.nan.locate(fn, *args)`: a jitted screen, then (if non-finite) trace + walk
  debug    one call under `jax.debug_nans(True)` until it raises FloatingPointError
and the ratios locate/eager (target <= ~3x) and locate/debug. Also PyTorch steps: eager vs
locate (dispatch mode + autograd node tags).

A small transformer training step in both frameworks (2 pre-norm layers, d=64, 4 heads,
32 tokens x 8, AdamW; PyTorch with foreach=True, JAX with Flax NNX + optax under nnx.jit),
clean and with a NaN planted in the optimizer update (eps=0 and a token never seen: 0/0):
  step     one plain training step as written
  locate   `diag.nan.locate(step, ...)`, which runs the step once
and locate/step (PyTorch target <= 3x). The planted steps are rebuilt (fresh parameters) for
every sample, outside the timed region, so every timed call starts from the same state.

Fresh processes (`--fresh`), what a user waits for: `diag nan` on a real Flax linen + optax
Adam step (eps=0 and a token never seen: 0/0 in the update), from process start to verdict,
next to a fresh process that runs the same step under `jax_debug_nans` until it raises (target:
diag <= 2x); diag once with an empty compilation cache and once with the programs a previous
hunt kept (JAX's persistent cache under $DIAG_CACHE_DIR/jax-ops). And the torch case: an RMSE
distillation step at loss 0 (NaN in every gradient), `diag nan` vs a fresh process under
`torch.autograd.detect_anomaly` until it raises.

The torch transformer rows also time the step under `torch.autograd.detect_anomaly()` (the
peer; it checks backward outputs only, so it never raises on the planted update NaN):
locate/detect_anomaly, target <= 2x.

Usage: python benchmarks/bench_nan.py [--repeats N] [--only transformer|torch-transformer]
       [--fresh]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import diag.nan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import nan_torch_steps  # noqa: E402
import nan_train_step as example  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import machine  # noqa: E402


def mlp_with_norm_penalty(params, x):
    """A deeper MLP step whose NaN is born only in the backward pass (d sqrt at 0)."""

    def loss(p):
        h = x
        for w in p["ws"]:
            h = jnp.tanh(h @ w)
        reg = jnp.sqrt(jnp.sum(p["dead"] ** 2))  # a frozen, all-zero block: grad 0.5/0
        return jnp.mean(h ** 2) + 1e-3 * reg

    return jax.value_and_grad(loss)(params)


def mlp_inputs(layers=8, width=256, batch=128):
    keys = jax.random.split(jax.random.key(1), layers + 1)
    ws = [jax.random.normal(k, (width, width)) / width ** 0.5 for k in keys[:layers]]
    return {"ws": ws, "dead": jnp.zeros((width,))}, jax.random.normal(keys[-1], (batch, width))


def clean_step(params, x):
    return jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["ws"][0]) ** 2))(params)


_CPU: list = []  # CPU time of the last `_time` call, read by the transformer rows


def _time(f) -> float:
    c0, t0 = time.process_time(), time.perf_counter()
    f()
    wall = time.perf_counter() - t0
    _CPU[:] = [time.process_time() - c0]
    return wall


def _debug_run(fn, args):
    # debug_nans prints "... Calling the de-optimized version." on every call.
    with jax.debug_nans(True), contextlib.redirect_stdout(io.StringIO()):
        try:
            jax.block_until_ready(fn(*args))
        except FloatingPointError:
            return "raised"
    return "no error"


def describe(samples):
    med = statistics.median(samples)
    spread = (max(samples) - min(samples)) / med if med else 0.0
    flag = "  (spread > 50%: machine busy?)" if spread > 0.5 else ""
    return med, (f"median {med * 1e3:8.2f} ms  min {min(samples) * 1e3:8.2f}  "
                 f"max {max(samples) * 1e3:8.2f}{flag}")


def bench_jax(name, fn, args, repeats):
    variants = {
        "jit": lambda: jax.block_until_ready(fn(*args)),
        "eager": lambda: _eager(fn, args),
        "locate": lambda: diag.nan.locate(fn, *args),
        "debug": lambda: _debug_run(fn, args),
    }
    for f in variants.values():  # warm-up: compile everything once
        f()
    samples = {k: [] for k in variants}
    for _ in range(repeats):
        for k, f in variants.items():
            samples[k].append(_time(f))
    print(f"{name}:  {diag.nan.reason(diag.nan.locate(fn, *args))[:110]}")
    print(f"  jax_debug_nans outcome: {_debug_run(fn, args)}")
    med = {}
    for k, s in samples.items():
        med[k], text = describe(s)
        print(f"  {k:7s} {text}")
    print(f"  locate / eager = {med['locate'] / med['eager']:.2f}x (target <= 3x)   "
          f"locate / debug_nans = {med['locate'] / med['debug']:.2f}x   "
          f"locate / jit = {med['locate'] / med['jit']:.1f}x")


def _eager(fn, args):
    with jax.disable_jit():
        return jax.block_until_ready(fn(*args))


def bench_torch(repeats, batch):
    try:
        import torch
    except ImportError:
        print("torch: not installed, skipped")
        return
    # One intra-op thread for both variants: on a shared 2-core machine torch's thread pool
    # makes single runs vary 10x, which hides the ratio being measured.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
                                  for _ in range(8)])
    x = torch.randn(batch, 256)
    dead = torch.zeros(256, requires_grad=True)

    def step():
        model.zero_grad()
        loss = model(x).pow(2).mean() + 1e-3 * torch.sqrt((dead * dead).sum())
        loss.backward()
        return loss.detach(), dead.grad

    variants = {"eager": step, "locate": lambda: diag.nan.locate(step)}
    for f in variants.values():
        f()
    samples = {k: [] for k in variants}
    for _ in range(repeats):
        for k, f in variants.items():
            samples[k].append(_time(f))
    print(f"torch 8-layer MLP step, batch {batch}:  {diag.nan.reason(diag.nan.locate(step))[:110]}")
    med = {}
    for k, s in samples.items():
        med[k], text = describe(s)
        print(f"  {k:7s} {text}")
    print(f"  locate / eager = {med['locate'] / med['eager']:.2f}x (target <= 3x)")


def torch_transformer_step(bad: bool):
    """A fresh small PyTorch transformer LM and its AdamW(foreach) step; `bad` plants 0/0."""
    import torch

    torch.manual_seed(0)
    d, T, B, V = 64, 32, 8, 100
    emb = torch.nn.Embedding(V, d)
    layer = torch.nn.TransformerEncoderLayer(d, 4, 128, dropout=0.1, batch_first=True,
                                             norm_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    head = torch.nn.Linear(d, V)
    params = [*emb.parameters(), *enc.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True, eps=0.0 if bad else 1e-8)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(T)  # -inf: not a NaN
    tok = torch.randint(0, V - 1 if bad else V, (B, T))  # bad: token V-1 never seen

    def step():
        opt.zero_grad()
        h = enc(emb(tok), mask=mask, is_causal=True)
        loss = torch.nn.functional.cross_entropy(head(h).flatten(0, 1), tok.flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    return step


_JAX_LM: dict = {}


def _jax_lm(bad: bool):
    """(LM class, optax transform, jitted step), built once: NNX's jit cache is keyed on the
    graph, which holds the classes and the transform, so fresh state must reuse them."""
    if bad in _JAX_LM:
        return _JAX_LM[bad]
    import optax
    from flax import nnx

    d, V = 64, 100

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
            self.att = nnx.MultiHeadAttention(4, d, decode=False, rngs=rngs)
            self.ff1, self.ff2 = nnx.Linear(d, 128, rngs=rngs), nnx.Linear(128, d, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.drop(self.att(self.ln1(x), mask=mask))
            return x + self.drop(self.ff2(jax.nn.relu(self.ff1(self.ln2(x)))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(V, d, rngs=rngs)
            self.blocks = nnx.List([Block(rngs), Block(rngs)])
            self.head = nnx.Linear(d, V, rngs=rngs)

        def __call__(self, tok):
            mask = nnx.make_causal_mask(tok)
            h = self.emb(tok)
            for b in self.blocks:
                h = b(h, mask)
            return self.head(h)

    @nnx.jit
    def step(model, opt, tok):
        def loss_fn(model):
            logits = model(tok)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tok).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    _JAX_LM[bad] = (LM, optax.adamw(1e-3, eps=0.0 if bad else 1e-8), step)
    return _JAX_LM[bad]


def jax_transformer_step(bad: bool):
    """The same model in Flax NNX + optax under nnx.jit: (step, args) with fresh state."""
    from flax import nnx

    LM, tx, step = _jax_lm(bad)
    model = LM(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    tok = jax.random.randint(jax.random.key(2), (8, 32), 0, 99 if bad else 100)
    return step, (model, opt, tok)


def bench_transformer(repeats, torch_only=False):
    """Plain step vs locate, side by side, in both frameworks; fresh state for every sample."""
    rows = []
    try:
        import torch

        torch.set_num_threads(1)
        for bad in (False, True):
            def plain(bad=bad):
                step = torch_transformer_step(bad)
                return _time(step)

            def hunt(bad=bad):
                step = torch_transformer_step(bad)
                return _time(lambda: diag.nan.locate(step))

            def anomaly(bad=bad):  # the peer: checks backward outputs only, so never raises here
                step = torch_transformer_step(bad)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with torch.autograd.detect_anomaly():
                        return _time(step)

            rows.append((f"torch transformer step, {'NaN in AdamW update' if bad else 'clean'}",
                         diag.nan.reason(diag.nan.locate(torch_transformer_step(bad))),
                         plain, hunt, anomaly))
    except ImportError:
        print("torch: not installed, skipped")
    try:
        if torch_only:
            raise ImportError
        import flax.nnx  # noqa: F401

        for bad in (False, True):
            def jplain(bad=bad):
                step, args = jax_transformer_step(bad)
                return _time(lambda: jax.block_until_ready(step(*args)))

            def jhunt(bad=bad):
                step, args = jax_transformer_step(bad)
                return _time(lambda: diag.nan.locate(step, *args))

            step, args = jax_transformer_step(bad)
            rows.append((f"jax/nnx transformer step, {'NaN in AdamW update' if bad else 'clean'}",
                         diag.nan.reason(diag.nan.locate(step, *args)), jplain, jhunt, None))
    except ImportError:
        print("flax: not installed, skipped" if not torch_only else "jax rows skipped (--only)")
    for name, why, plain, hunt, peer in rows:
        variants = {"step": plain, "locate": hunt, **({"anomaly": peer} if peer else {})}
        for f in variants.values():
            f()  # warm-up: compile, first-call imports
        s = {k: [] for k in variants}
        cpu = {k: [] for k in variants}
        for _ in range(repeats):
            for k, f in variants.items():
                s[k].append(f())
                cpu[k].append(_CPU[0])
        print(f"{name}:  {why[:110]}")
        med, mc = {}, {}
        for k, v in s.items():
            med[k], text = describe(v)
            mc[k], ctext = describe(cpu[k])
            print(f"  {k:7s} wall {text}  raw {[round(x * 1e3, 1) for x in v]} ms")
            print(f"  {'':7s} cpu  {ctext}  raw {[round(x * 1e3, 1) for x in cpu[k]]} ms")
        target = " (target <= 3x)" if name.startswith("torch") else ""
        print(f"  locate / step = {med['locate'] / med['step']:.2f}x{target}, by CPU time "
              f"{mc['locate'] / mc['step']:.2f}x")
        if peer:
            print(f"  locate / detect_anomaly = {med['locate'] / med['anomaly']:.2f}x "
                  f"(target <= 2x), by CPU time {mc['locate'] / mc['anomaly']:.2f}x;  "
                  f"detect_anomaly / step = {med['anomaly'] / med['step']:.2f}x")


def flax_optax_case():
    """A Flax linen MLP over an embedding, optax Adam with eps=0, one jitted step; token 99 is
    never seen, so its embedding row's update is 0/0. For `diag nan FILE:flax_optax_case`."""
    import flax.linen as nn
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, tok):
            x = nn.Embed(100, 32)(tok).mean(axis=1)
            for width in (128, 128, 128, 128):
                x = nn.LayerNorm()(nn.relu(nn.Dense(width)(x)))
            return nn.Dense(10)(x)

    model, tx = MLP(), optax.adam(1e-3, eps=0.0)

    def loss_fn(params, tok, y):
        logits = model.apply(params, tok)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, opt_state, tok, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, tok, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tok = jax.random.randint(jax.random.key(0), (64, 8), 0, 99)
    y = jax.random.randint(jax.random.key(1), (64,), 0, 10)
    params = model.init(jax.random.key(2), tok)
    return train_step, (params, tx.init(params), tok, y)


def torch_rmse_case():
    """An 8-layer MLP student equal to its teacher, loss sqrt(mse) = 0: backward writes
    NaN/Inf into every gradient (examples/nan_torch_steps.py). For
    `diag nan FILE:torch_rmse_case`."""
    import torch

    def mlp():
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256),
                                                         torch.nn.Tanh()) for _ in range(8)])

    _, step = nan_torch_steps.rmse_distillation(mlp, (128, 256))
    return step, ()


def _child(which: str) -> None:
    """A fresh process's run of a case under the framework's own tool, until it raises."""
    if which == "debug_nans":
        step, args = flax_optax_case()
        jax.config.update("jax_debug_nans", True)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                jax.block_until_ready(step(*args))
        except FloatingPointError as e:
            print(f"raised: {str(e).splitlines()[0][:90]}")
    else:
        import torch

        step, args = torch_rmse_case()
        try:
            with torch.autograd.detect_anomaly(), contextlib.redirect_stderr(io.StringIO()):
                step(*args)
        except RuntimeError as e:
            print(f"raised: {str(e).splitlines()[0][:90]}")


def bench_fresh(repeats: int) -> None:
    """Wall time from process start to verdict: diag nan vs the framework's own tool."""
    import os
    import subprocess
    import tempfile

    here = Path(__file__).resolve()
    diag_cli = str(Path(sys.executable).parent / "diag")
    cache = tempfile.mkdtemp(prefix="diag-bench-cache-")

    def run(argv, env=None):
        t0 = time.perf_counter()
        p = subprocess.run(argv, capture_output=True, text=True,
                           env={**os.environ, **(env or {})})
        took = time.perf_counter() - t0
        return took, (p.stdout.strip().splitlines() or [p.stderr.strip()[-200:]])[-1]

    def fresh_cache():
        import shutil

        shutil.rmtree(Path(cache) / "jax-ops", ignore_errors=True)
        return {"DIAG_CACHE_DIR": cache}

    variants = {
        "diag nan, cache empty": lambda: run([diag_cli, "nan", f"{here}:flax_optax_case"],
                                             fresh_cache()),
        "diag nan, cache kept": lambda: run([diag_cli, "nan", f"{here}:flax_optax_case"],
                                            {"DIAG_CACHE_DIR": cache}),
        "jax_debug_nans": lambda: run([sys.executable, str(here), "--child", "debug_nans"]),
        "diag nan, torch": lambda: run([diag_cli, "nan", f"{here}:torch_rmse_case"]),
        "detect_anomaly": lambda: run([sys.executable, str(here), "--child", "anomaly"]),
    }
    samples: dict = {k: [] for k in variants}
    said = {}
    for _ in range(repeats):
        for k, f in variants.items():
            took, said[k] = f()
            samples[k].append(took)
    print("fresh processes, start to verdict (wall time; raw samples in s):")
    med = {}
    for k, s in samples.items():
        med[k], text = describe(s)
        print(f"  {k:22s} {text}  raw {[round(x, 2) for x in s]}\n    -> {said[k][:150]}")
    for k in ("diag nan, cache empty", "diag nan, cache kept"):
        print(f"  {k} / jax_debug_nans = {med[k] / med['jax_debug_nans']:.2f}x (target <= 2x)")
    print(f"  diag nan, torch / detect_anomaly = "
          f"{med['diag nan, torch'] / med['detect_anomaly']:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", choices=["transformer", "torch-transformer"], default=None)
    ap.add_argument("--fresh", action="store_true", help="only the fresh-process comparison")
    ap.add_argument("--child", choices=["debug_nans", "anomaly"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _child(a.child)
    if a.fresh:
        return bench_fresh(a.repeats)
    print(f"machine: {machine()}")
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    bench_transformer(a.repeats, torch_only=a.only == "torch-transformer")
    if a.only:
        return
    bench_jax("example train step (NaN in scan[3], forward)", example.train_step,
              example.make_inputs(3), a.repeats)
    bench_jax("8-layer MLP value_and_grad (Inf born backward)", jax.jit(mlp_with_norm_penalty),
              mlp_inputs(), a.repeats)
    bench_jax("clean step (screen only)", jax.jit(clean_step), mlp_inputs(), a.repeats)
    for batch in (128, 2048):
        bench_torch(a.repeats, batch)


if __name__ == "__main__":
    main()
