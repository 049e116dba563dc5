"""How much does `diag.nan.locate` cost next to one eager run, and next to `jax_debug_nans`?

For each function prints, side by side in one run (warm: every variant is run once first so
compilation is not counted; medians of interleaved repeats, with min/max):
  jit      the function as written (jitted), one call
  eager    one call under `jax.disable_jit()` (op by op, what "eager" means in JAX)
  locate   `diag.nan.locate(fn, *args)`: a jitted screen, then (if non-finite) trace + walk
  debug    one call under `jax.debug_nans(True)` until it raises FloatingPointError
and the ratios locate/eager (target <= ~3x) and locate/debug. Also one PyTorch step:
  eager vs locate (dispatch mode + anomaly metadata).

Usage: python benchmarks/bench_nan.py [--repeats N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import diag.nan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import nan_train_step as example  # noqa: E402


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


def _time(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    bench_jax("example train step (NaN in scan[3], forward)", example.train_step,
              example.make_inputs(3), a.repeats)
    bench_jax("8-layer MLP value_and_grad (Inf born backward)", jax.jit(mlp_with_norm_penalty),
              mlp_inputs(), a.repeats)
    bench_jax("clean step (screen only)", jax.jit(clean_step), mlp_inputs(), a.repeats)
    for batch in (128, 2048):
        bench_torch(a.repeats, batch)


if __name__ == "__main__":
    main()
