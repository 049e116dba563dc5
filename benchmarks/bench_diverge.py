"""What do `diag.diverge.shadow` and `diag.diverge.compare` cost next to a plain run?

Prints the machine, then per workload (warm: each variant runs once first so compilation is not
counted; medians of interleaved repeats with min/max, in CPU time of this process and in wall
time, and the raw samples):
  eager    one plain run: PyTorch eager; JAX under `jax.disable_jit()` (op by op)
  noop     PyTorch only: the run under a `TorchDispatchMode` that only calls each op (the floor
           of any dispatch-mode instrumentation)
  nofig    PyTorch only: the shadow with the per-op figures switched off (`Ledger.measure`
           replaced by a stub that still reports a carried error, so every reference runs):
           the three evaluations of each op and the bookkeeping
  before   PyTorch only: the shadow as it was before its one-pass figures: the figures by
           numpy passes over each output (`diag.diverge.chunked`), a matrix product's
           sum|terms| in float64 on float64 copies of its operands, a parameter widened to
           float64 at each read (the same verdicts; the sum|terms| ratios differ in their
           last bits, see docs/diverge.md)
  shadow   `diag.diverge.shadow(fn, *args)`: every op run three ways (as written, on the
           float64 shadows, in float64 on its actual inputs: skipped when they equal their
           shadows) plus the figures per op
and the ratio shadow/eager (target <= 5x), of the medians and of the fastest samples, in CPU
time (the steadier figure on a shared machine: another process's load does not count) and wall
time (a 3-layer MLP's forward and backward in each framework, the PyTorch one at --size and at
--torch-size, transformers' GPT-2 forward built from a config (4 layers, width 256, 2 x 128
tokens, float32, no gradients), and a bf16 top-p/greedy sampler on 32k logits,
examples/diverge_sampler.py, and transformers' top-p warper on 32k bf16 logits,
examples/diverge_hf_sampler.py, whose decisions are judged too). For the JAX-vs-PyTorch port of
examples/diverge_port.py:
  runs     run_jax() + run_torch() (the jitted JAX block and the eager PyTorch block, at
           width --size, 128 tokens)
  compare  `diag.diverge.compare(run_jax, run_torch)`
and compare/runs (target <= 2x).

Usage: python benchmarks/bench_diverge.py [--repeats N] [--size D] [--torch-size D2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import diag.diverge
import diag.diverge.ledger
from diag.diverge import ledger, torch_copies, torch_facts

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


def gpt2_forward():
    """transformers' GPT-2 (4 layers, width 256, 4 heads, 8192 tokens) built from a config,
    nothing downloaded; its logits for 2 x 128 tokens, float32, without gradients."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=8192, n_positions=256, n_embd=256, n_layer=4,
                                  n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 128))

    def forward():
        with torch.no_grad():
            return model(input_ids=ids).logits

    return forward, ()


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


class _Noop(TorchDispatchMode):
    """The floor of a dispatch mode: every aten op called as it came, nothing else."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _noop(fn, args):
    def run():
        with torch.autograd.set_multithreading_enabled(False), _Noop():
            fn(*args)

    return run


def _stub_measure(self, *a, **k) -> float:
    """`Ledger.measure` without the figures: no pass over the output and no sum|terms|, but a
    carried error above 0, so that every later op still runs its float64 reference (a stub
    returning 0 makes every value equal its shadow, and the references are skipped)."""
    self.own_diff = self.came_diff = self.carried_diff = 0.0
    return 5e-324


def _nofig(fn, args):
    """The shadow without its figures: what the evaluations and bookkeeping cost alone."""
    def run():
        measure = diag.diverge.ledger.Ledger.measure
        diag.diverge.ledger.Ledger.measure = _stub_measure
        try:
            diag.diverge.shadow(fn, *args)
        finally:
            diag.diverge.ledger.Ledger.measure = measure

    return run


def _before(fn, args):
    """The shadow as it was before its one-pass figures (`diag.diverge.onepass`), float32
    sum|terms| (`torch_facts.Float32Terms`) and kept copies of parameters
    (`torch_copies.Copies`), so the gain shows side by side."""
    def run():
        saved = (ledger.op_figures, torch_facts.Float32Terms.takes, torch_copies.Copies.of)
        ledger.op_figures = lambda *a, **k: None
        torch_facts.Float32Terms.takes = classmethod(lambda cls, func, low: False)
        torch_copies.Copies.of = lambda self, t: t.detach().to(torch.float64, copy=True)
        try:
            diag.diverge.shadow(fn, *args)
        finally:
            (ledger.op_figures, torch_facts.Float32Terms.takes, torch_copies.Copies.of) = saved

    return run


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def _interleaved(variants: dict, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Each variant run once to warm up, then `repeats` rounds of one call of each in turn,
    so that load on a shared machine falls on every variant alike; per variant the CPU time
    of this process and the wall time of each call."""
    for v in variants.values():
        v()
    samples: dict[str, dict[str, list[float]]] = {
        k: {"cpu": [], "wall": []} for k in variants
    }
    for _ in range(repeats):
        for k, v in variants.items():
            c, w = time.process_time(), time.perf_counter()
            v()
            samples[k]["wall"].append(time.perf_counter() - w)
            samples[k]["cpu"].append(time.process_time() - c)
    return samples


def _row(name: str, samples: dict, num: str, den: str, target: float) -> float:
    """Print one workload: per clock the medians [min-max] and the ratios num/den (and
    noop/den when measured), then the raw samples; return the CPU-time median ratio."""
    out = 0.0
    for clock in ("cpu", "wall"):
        sm = {k: v[clock] for k, v in samples.items()}
        med = {k: statistics.median(v) for k, v in sm.items()}
        cells = "  ".join(f"{k} {med[k] * 1e3:8.2f} ms [{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}]"
                          for k, v in sm.items())
        ratio = med[num] / med[den]
        fastest = min(sm[num]) / min(sm[den])
        floor = "".join(f"  {k}/{den} {med[k] / med[den]:5.2f}x" for k in ("noop", "nofig", "before")
                        if k in sm)
        print(f"{name:<24} {clock:<4} {cells}  {num}/{den} {ratio:6.2f}x median, "
              f"{fastest:6.2f}x fastest (target <= {target:g}x){floor}")
        out = out or ratio
    for k, v in samples.items():
        print(f"{'':<24} raw {k} cpu ms: {' '.join(f'{x * 1e3:.2f}' for x in v['cpu'])}; "
              f"wall ms: {' '.join(f'{x * 1e3:.2f}' for x in v['wall'])}")
    return out


def _torch_row(name: str, fn, args, repeats: int) -> None:
    variants = {"eager": lambda: fn(*args), "noop": _noop(fn, args), "nofig": _nofig(fn, args),
                "before": _before(fn, args), "shadow": lambda: diag.diverge.shadow(fn, *args)}
    _row(name, _interleaved(variants, repeats), "shadow", "eager", 5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--torch-size", type=int, default=1024,
                    help="a second width for the PyTorch MLP (0: none)")
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
    print(f"{_machine()}; jax {jax.__version__}, torch {torch.__version__} (1 thread), "
          f"d={a.size}, {a.repeats} interleaved repeats (median [min-max])")

    for d in dict.fromkeys(x for x in (a.size, a.torch_size) if x):
        _torch_row(f"torch mlp fwd+bwd d={d}", *torch_step(d), a.repeats)

    fn, args = jax_step(a.size)

    def eager():
        with jax.disable_jit():
            jax.block_until_ready(fn(*args))

    variants = {"eager": eager, "shadow": lambda: diag.diverge.shadow(fn, *args)}
    samples = _interleaved(variants, a.repeats)
    _row("jax mlp value_and_grad", samples, "shadow", "eager", 3)

    # A bf16 top-p/greedy sampler on 32k logits whose cut flips (examples/diverge_sampler.py
    # :made): every comparison, argmax and top_k judged against float64 besides the values.
    fn, args = sampler.made()

    def eager_sampler():
        with jax.disable_jit():
            jax.block_until_ready(fn(*args))

    variants = {"eager": eager_sampler, "shadow": lambda: diag.diverge.shadow(fn, *args)}
    samples = _interleaved(variants, a.repeats)
    _row("jax bf16 sampler 32k", samples, "shadow", "eager", 3)

    # transformers' GPT-2 forward from a config: attention (PyTorch's fused kernel),
    # layer norms, GELU, the tied output projection onto an 8192-token vocabulary.
    _torch_row("torch gpt2 forward", *gpt2_forward(), a.repeats)

    # transformers' TopPLogitsWarper then argmax on 32k bf16 logits whose cut flips
    # (examples/diverge_hf_sampler.py:made): the PyTorch shadow with its decisions judged.
    _torch_row("torch bf16 hf top-p 32k", *hf_sampler.made(), a.repeats)

    def runs():
        jax.block_until_ready(port.run_jax())
        port.run_torch()

    variants = {"runs": runs,
                "compare": lambda: diag.diverge.compare(port.run_jax, port.run_torch)}
    samples = _interleaved(variants, a.repeats)
    _row("port compare (jax/torch)", samples, "compare", "runs", 2)


if __name__ == "__main__":
    main()
