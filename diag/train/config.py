"""The training run's model, hyper-parameters and data, as data shared by every implementation.

A port between frameworks goes wrong in the details nobody writes down: where Adam's eps sits,
whether weight decay is decoupled, the layer-norm eps, which GELU, the attention scale. So
every such detail is one field of `TrainConfig`, read by all three implementations (JAX,
PyTorch, and the float64 reference of `diag.train.reference`), and each porting bug diag
detects is one field set to the wrong value (`PORT_BUGS`).

The initial weights and the token batches are drawn once on the host with numpy from a seed
and handed bit-identical to every implementation: parameters are packed into one float32
vector in `param_layout` order, batches are float32 token ids (exact below 2^24).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

__all__ = [
    "TrainConfig",
    "PORT_BUGS",
    "param_layout",
    "init_params",
    "make_batches",
    "pack",
    "unpack",
    "with_bug",
    "decayed",
]


@dataclass(frozen=True)
class TrainConfig:
    """A small decoder-only transformer and its AdamW run, every convention spelled out.

    Attributes:
      layers, width, heads, vocab, seq, batch, steps: the model and run sizes (batches are
        `batch` sequences of `seq + 1` tokens: inputs and next-token targets).
      lr, beta1, beta2, adam_eps, weight_decay: AdamW (bias-corrected moments; decay applied
        to the 2-D weight matrices only, as GPT-style recipes do).
      ln_eps: layer-norm eps (added to the biased variance, inside the square root).
      adam_eps_inside: eps inside the square root, `m / sqrt(v + eps)` (a porting bug
        when the original has it outside, `m / (sqrt(v) + eps)`).
      l2_decay: weight decay as an L2 term added to the gradient before Adam
        (`torch.optim.Adam(weight_decay=...)`) instead of decoupled (`AdamW`).
      gelu_tanh: GELU by its tanh approximation (`jax.nn.gelu`'s default) instead of the
        exact erf form (`torch.nn.functional.gelu`'s default).
      attn_scale: whether attention logits are scaled by 1/sqrt(head width).
    """

    layers: int = 2
    width: int = 64
    heads: int = 4
    vocab: int = 256
    seq: int = 64
    batch: int = 8
    steps: int = 8
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.1
    ln_eps: float = 1e-5
    adam_eps_inside: bool = False
    l2_decay: bool = False
    gelu_tanh: bool = False
    attn_scale: bool = True

    @property
    def head_width(self) -> int:
        return self.width // self.heads

    def problem(self) -> str | None:
        """Why the sizes do not make a model, or None."""
        for name in ("layers", "width", "heads", "vocab", "seq", "batch", "steps"):
            if getattr(self, name) < 1:
                return f"{name} must be >= 1, got {getattr(self, name)}"
        if self.width % self.heads:
            return f"width ({self.width}) must be a multiple of heads ({self.heads})"
        if self.vocab > 2**24:
            return f"vocab must be <= 2^24 (token ids travel as float32), got {self.vocab}"
        return None


#: The porting bugs diag plants and detects: name -> (the field a port gets wrong, its wrong
#: value, what the bug is, in words).
PORT_BUGS: dict[str, tuple[str, object, str]] = {
    "adam_eps_inside": (
        "adam_eps_inside",
        True,
        "Adam eps inside the square root (m / sqrt(v + eps)) instead of "
        "outside (m / (sqrt(v) + eps))",
    ),
    "l2_weight_decay": (
        "l2_decay",
        True,
        "weight decay as an L2 gradient term (Adam) instead of decoupled (AdamW)",
    ),
    "ln_eps_1e-6": (
        "ln_eps",
        1e-6,
        "layer-norm eps 1e-6 (flax's default) instead of 1e-5 (torch's default)",
    ),
    "gelu_tanh": (
        "gelu_tanh",
        True,
        "GELU by its tanh approximation (jax.nn.gelu's default) instead of the exact erf form",
    ),
    "no_attn_scale": ("attn_scale", False, "attention logits not scaled by 1/sqrt(head width)"),
}


def with_bug(cfg: TrainConfig, bug: str | None) -> TrainConfig:
    """`cfg` with one porting bug planted (`PORT_BUGS`), or `cfg` itself for None."""
    if bug is None:
        return cfg
    if bug not in PORT_BUGS:
        from diag.errors import UsageError

        raise UsageError(f"unknown porting bug {bug!r}; known: {', '.join(PORT_BUGS)}")
    name, value, _ = PORT_BUGS[bug]
    changes: dict[str, Any] = {name: value}  # PORT_BUGS's values have the field's type
    return replace(cfg, **changes)


def param_layout(cfg: TrainConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in the order they are packed and reported.

    Weight matrices are stored [in, out] (x @ w), in every implementation alike.
    """
    d, v = cfg.width, cfg.vocab
    out: list[tuple[str, tuple[int, ...]]] = [("wte", (v, d)), ("wpe", (cfg.seq, d))]
    for i in range(cfg.layers):
        p = f"h{i}."
        out += [
            (p + "ln1.g", (d,)),
            (p + "ln1.b", (d,)),
            (p + "attn.qkv.w", (d, 3 * d)),
            (p + "attn.out.w", (d, d)),
            (p + "attn.out.b", (d,)),
            (p + "ln2.g", (d,)),
            (p + "ln2.b", (d,)),
            (p + "mlp.fc.w", (d, 4 * d)),
            (p + "mlp.fc.b", (4 * d,)),
            (p + "mlp.proj.w", (4 * d, d)),
            (p + "mlp.proj.b", (d,)),
        ]
    out += [("lnf.g", (d,)), ("lnf.b", (d,)), ("head.w", (d, v))]
    return out


def decayed(name: str, shape: tuple[int, ...]) -> bool:
    """Whether weight decay applies to a parameter: the 2-D weight matrices, not the
    embeddings' position table, biases or layer-norm gains."""
    return len(shape) == 2 and name != "wpe"


def n_params(cfg: TrainConfig) -> int:
    return sum(math.prod(s) for _, s in param_layout(cfg))


def init_params(cfg: TrainConfig, rng: np.random.Generator) -> np.ndarray:
    """Initial weights, packed float32: embeddings N(0, 0.02^2) (GPT-2's), weight matrices
    N(0, 1/fan_in) (LeCun's: pre-activations O(1), where GELU's tanh form and the exact one
    differ measurably; output projections also scaled by 1/sqrt(2 layers)), gains 1, biases
    small N(0, 0.01^2) so that no gradient is exactly zero by construction. The small
    embeddings make the residual stream's variance ~1e-3, where a layer-norm eps of 1e-5
    against 1e-6 matters, as it does early in real training."""
    parts = []
    for name, shape in param_layout(cfg):
        if name.endswith(".g"):
            parts.append(np.ones(shape))
        elif name.endswith(".b"):
            parts.append(0.01 * rng.standard_normal(shape))
        else:
            fan_in = shape[0] if name not in ("wte", "wpe") else None
            std = 0.02 if fan_in is None else 1.0 / math.sqrt(fan_in)
            if name.endswith(("out.w", "proj.w")):
                std /= math.sqrt(2 * cfg.layers)
            parts.append(std * rng.standard_normal(shape))
    return np.concatenate([p.ravel() for p in parts]).astype(np.float32)


def make_batches(cfg: TrainConfig, rng: np.random.Generator) -> np.ndarray:
    """[steps, batch, seq + 1] token ids (float32) of a seeded synthetic corpus.

    A first-order Markov chain over the vocabulary where each token has 4 likely successors:
    a corpus with structure a model can learn in a few steps (the loss falls), unlike uniform
    noise.
    """
    v = cfg.vocab
    succ = rng.integers(0, v, size=(v, 4))
    n = cfg.steps * cfg.batch
    tokens = np.empty((n, cfg.seq + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, v, size=n)
    for t in range(1, cfg.seq + 1):
        pick = rng.integers(0, 4, size=n)
        noise = rng.random(n) < 0.1
        nxt = succ[tokens[:, t - 1], pick]
        tokens[:, t] = np.where(noise, rng.integers(0, v, size=n), nxt)
    return tokens.reshape(cfg.steps, cfg.batch, cfg.seq + 1).astype(np.float32)


def unpack(cfg: TrainConfig, flat: np.ndarray) -> dict[str, np.ndarray]:
    """The packed vector as {name: array}, in `param_layout` order (views, no copies)."""
    out, i = {}, 0
    for name, shape in param_layout(cfg):
        size = math.prod(shape)
        out[name] = flat[i : i + size].reshape(shape)
        i += size
    if i != flat.size:
        raise ValueError(f"packed parameters hold {flat.size} values, the model has {i}")
    return out


def pack(cfg: TrainConfig, params: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(params[name]).ravel() for name, _ in param_layout(cfg)])


#: The case parameters of the `train` probe that shape a `TrainConfig` (suite dims and
#: parameters; the rest of the conventions are the defaults above).
CASE_FIELDS = ("layers", "width", "vocab", "seq", "batch", "steps", "heads", "lr")


def from_case(params: dict) -> TrainConfig:
    """The `TrainConfig` of a `train` probe case (its parameters, `CASE_FIELDS`)."""
    return TrainConfig(**{k: params[k] for k in CASE_FIELDS if k in params})
