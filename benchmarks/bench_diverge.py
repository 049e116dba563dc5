"""What do `diag.diverge.shadow` and `diag.diverge.compare` cost next to a plain run?

Prints, per workload (warm: each variant runs once first so compilation is not counted; medians
of interleaved repeats with min/max):
  eager    one plain run: PyTorch eager; JAX under `jax.disable_jit()` (op by op)
  shadow   `diag.diverge.shadow(fn, *args)`: every op run three ways (as written, on the
           float64 shadows, in float64 on its actual inputs: skipped when they equal their
           shadows) plus the figures per op
and the ratio shadow/eager (target <= 5x), of the medians and of the fastest samples (a 3-layer
MLP's forward and backward in each framework, and a bf16 top-p/greedy sampler on 32k logits,
examples/diverge_sampler.py, and transformers' top-p warper on 32k bf16 logits,
examples/diverge_hf_sampler.py, whose decisions are judged too). For the JAX-vs-PyTorch port of
examples/diverge_port.py:
  runs     run_jax() + run_torch() (the jitted JAX block and the eager PyTorch block, at
           width --size, 128 tokens)
  compare  `diag.diverge.compare(run_jax, run_torch)`
and compare/runs (target <= 2x).

Usage: python benchmarks/bench_diverge.py [--repeats N] [--size D]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

import diag.diverge

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import diverge_hf_sampler as hf_sampler  # noqa: E402
import diverge_port as port  # noqa: E402
import diverge_sampler as sampler  # noqa: E402


def torch_step(d: int):
    """A 3-layer tanh MLP forward and backward in float32 (batch 64, width d)."""
    rng = np.random.default_rng(0)
    ws = [torch.nn.Parameter(torch.tensor(rng.normal(0, d ** -0.5, (d, d)), dtype=torch.float32))
          for _ in range(3)]
    x = torch.tensor(rng.normal(0, 1, (64, d)), dtype=torch.float32)

    def step():
        h = x
        for w in ws:
            h = torch.tanh(h @ w)
        loss = (h ** 2).mean()
        loss.backward()
        for w in ws:
            w.grad = None
        return loss

    return step, ()


def jax_step(d: int):
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(0, d ** -0.5, (d, d)), jnp.float32) for _ in range(3)]
    x = jnp.asarray(rng.normal(0, 1, (64, d)), jnp.float32)

    def loss(ws, x):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return (h ** 2).mean()

    return jax.value_and_grad(loss), (ws, x)


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _interleaved(variants: dict, repeats: int) -> dict[str, list[float]]:
    """Each variant run once to warm up, then `repeats` rounds of one call of each in turn,
    so that load on a shared machine falls on every variant alike."""
    for v in variants.values():
        v()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, v in variants.items():
            samples[k] += _time(v, 1)
    return samples


def _row(name: str, samples: dict[str, list[float]], num: str, den: str, target: float):
    med = {k: statistics.median(v) for k, v in samples.items()}
    cells = "  ".join(f"{k} {med[k] * 1e3:8.2f} ms [{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}]"
                      for k, v in samples.items())
    ratio = med[num] / med[den]
    # On a shared machine the medians swing with the load; the ratio of the fastest samples
    # is the steadier figure of the two.
    fastest = min(samples[num]) / min(samples[den])
    print(f"{name:<22} {cells}  {num}/{den} {ratio:6.2f}x median, {fastest:6.2f}x fastest "
          f"(target <= {target:g}x)")
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--size", type=int, default=256)
    a = ap.parse_args()
    # One thread each: on a shared machine torch's thread pool makes single samples swing by
    # 10x; both sides of every ratio run under the same setting.
    torch.set_num_threads(1)
    # The port at the benchmark's width (examples/diverge_port.py is tiny, for reading).
    rng = np.random.default_rng(0)
    port.D = a.size
    port.W = {k: rng.normal(0, a.size ** -0.5, (a.size, a.size)).astype(np.float32)
              for k in port.W}
    port.X = rng.normal(0, 1, (128, a.size)).astype(np.float32)
    print(f"jax {jax.__version__}, torch {torch.__version__}, d={a.size}, "
          f"{a.repeats} repeats (median [min-max])")

    fn, args = torch_step(a.size)
    variants = {"eager": lambda: fn(*args), "shadow": lambda: diag.diverge.shadow(fn, *args)}
    samples = _interleaved(variants, a.repeats)
    _row("torch mlp fwd+bwd", samples, "shadow", "eager", 5)

    fn, args = jax_step(a.size)

    def eager():
        with jax.disable_jit():
            jax.block_until_ready(fn(*args))

    variants = {"eager": eager, "shadow": lambda: diag.diverge.shadow(fn, *args)}
    samples = _interleaved(variants, a.repeats)
    _row("jax mlp value_and_grad", samples, "shadow", "eager", 5)

    # A bf16 top-p/greedy sampler on 32k logits whose cut flips (examples/diverge_sampler.py
    # :made): every comparison, argmax and top_k judged against float64 besides the values.
    fn, args = sampler.made()

    def eager_sampler():
        with jax.disable_jit():
            jax.block_until_ready(fn(*args))

    variants = {"eager": eager_sampler, "shadow": lambda: diag.diverge.shadow(fn, *args)}
    samples = _interleaved(variants, a.repeats)
    _row("jax bf16 sampler 32k", samples, "shadow", "eager", 5)

    # transformers' TopPLogitsWarper then argmax on 32k bf16 logits whose cut flips
    # (examples/diverge_hf_sampler.py:made): the PyTorch shadow with its decisions judged.
    fn, args = hf_sampler.made()
    variants = {"eager": lambda: fn(*args), "shadow": lambda: diag.diverge.shadow(fn, *args)}
    samples = _interleaved(variants, a.repeats)
    _row("torch bf16 hf top-p 32k", samples, "shadow", "eager", 5)

    def runs():
        jax.block_until_ready(port.run_jax())
        port.run_torch()

    variants = {"runs": runs,
                "compare": lambda: diag.diverge.compare(port.run_jax, port.run_torch)}
    samples = _interleaved(variants, a.repeats)
    _row("port compare (jax/torch)", samples, "compare", "runs", 2)


if __name__ == "__main__":
    main()
