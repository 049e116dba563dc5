"""The float64 reference of a training run: forward, backward and AdamW written out in numpy.

Why by hand: the reference must not share code with either framework under test (a bug in
autograd or in optax would otherwise be in the truth too), and the same code must run on
mpmath numbers, so that the reference's own error can be measured on a tiny configuration
(tests/test_train_reference.py). Every function here takes an `Arith` (the elementary
functions for float64 or for mpmath object arrays) and does nothing else numerical.

How far the float64 reference can be trusted: its rounding per step is ~u64 = 1.1e-16
relative, against ~u32 = 6e-8 for a float32 run, and a training run amplifies a perturbation
the same way whichever arithmetic made it (as long as it stays small). So after N steps the
reference is off by about u64/u32 = 2^-29 times what a float32 run is off: a float32 run
that drifts to 1e-3 relative leaves the reference at ~2e-12, far below anything judged.
Each float32 `train` record keeps that estimate per step (`reference_error_estimate`). The mpmath
test
checks the premise directly: on a tiny model, 3 steps in float64 stay within 1e-13 relative
of the same steps at 50 digits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from diag.train.config import TrainConfig, decayed, param_layout, unpack

__all__ = ["Arith", "FLOAT64", "mp_arith", "run_reference", "loss_and_grads"]


@dataclass(frozen=True)
class Arith:
    """The elementary functions of one arithmetic, applied elementwise to arrays."""

    exp: Callable
    sqrt: Callable
    log: Callable
    tanh: Callable
    erf: Callable
    num: Callable  # a Python float as a number of this arithmetic
    dtype: DTypeLike


FLOAT64 = Arith(
    exp=np.exp,
    sqrt=np.sqrt,
    log=np.log,
    tanh=np.tanh,
    erf=np.vectorize(math.erf, otypes=[np.float64]),
    num=np.float64,
    dtype=np.float64,
)


def mp_arith(digits: int = 50) -> Arith:
    """The same functions on mpmath numbers (object arrays), at `digits` decimal digits.

    mpmath's precision is global (`mpmath.mp.dps`): the caller sets it for the duration of a
    run (`with mpmath.workdps(digits)`)."""
    import mpmath

    def vec(f):
        return np.vectorize(f, otypes=[object])

    return Arith(
        exp=vec(mpmath.exp),
        sqrt=vec(mpmath.sqrt),
        log=vec(mpmath.log),
        tanh=vec(mpmath.tanh),
        erf=vec(mpmath.erf),
        num=mpmath.mpf,
        dtype=object,
    )


def _ln(x, g, b, eps, A: Arith):
    d = x.shape[-1]
    mu = x.sum(axis=-1, keepdims=True) / A.num(d)
    xc = x - mu
    var = (xc * xc).sum(axis=-1, keepdims=True) / A.num(d)
    rstd = 1 / A.sqrt(var + A.num(eps))
    xhat = xc * rstd
    return xhat * g + b, (xhat, rstd, g)


def _ln_back(dy, cache, A: Arith):
    xhat, rstd, g = cache
    d = xhat.shape[-1]
    dg = (dy * xhat).reshape(-1, d).sum(axis=0)
    db = dy.reshape(-1, d).sum(axis=0)
    dxh = dy * g
    dx = rstd * (
        dxh
        - dxh.sum(axis=-1, keepdims=True) / A.num(d)
        - xhat * (dxh * xhat).sum(axis=-1, keepdims=True) / A.num(d)
    )
    return dx, dg, db


_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def _gelu(u, tanh_form: bool, A: Arith):
    if tanh_form:
        t = A.tanh(A.num(_GELU_K) * (u + A.num(_GELU_C) * u * u * u))
        return A.num(0.5) * u * (1 + t), t
    e = A.erf(u / A.sqrt(A.num(2.0)))
    return A.num(0.5) * u * (1 + e), e


def _gelu_back(du, u, aux, tanh_form: bool, A: Arith):
    if tanh_form:
        t = aux
        inner = A.num(_GELU_K) * (1 + A.num(3 * _GELU_C) * u * u)
        return du * (A.num(0.5) * (1 + t) + A.num(0.5) * u * (1 - t * t) * inner)
    pdf = A.exp(-(u * u) / A.num(2.0)) / A.sqrt(A.num(2.0) * A.num(math.pi))
    return du * (A.num(0.5) * (1 + aux) + u * pdf)


def _masked_softmax(s, mask, A: Arith):
    # Masked entries are dropped by a 0/1 factor (no -inf: mpmath numbers stay finite).
    big = np.where(mask, s, s.min(axis=-1, keepdims=True))
    m = big.max(axis=-1, keepdims=True)
    e = A.exp(np.where(mask, s - m, 0 * m)) * mask  # masked s - m may overflow: not taken
    return e / e.sum(axis=-1, keepdims=True)


def loss_and_grads(cfg: TrainConfig, p: dict, tokens: np.ndarray, A: Arith = FLOAT64):
    """The mean next-token cross-entropy of one batch and its gradient for every parameter.

    Args:
      cfg: the model and its conventions (`gelu_tanh`, `attn_scale`, `ln_eps`).
      p: parameters by name (arrays of `A`'s numbers).
      tokens: [batch, seq + 1] integer token ids.
      A: the arithmetic.

    Returns:
      (loss, {name: gradient}).
    """
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    bsz, s = inp.shape
    d, nh, hw = cfg.width, cfg.heads, cfg.head_width
    scale = A.num(1.0) / A.sqrt(A.num(hw)) if cfg.attn_scale else A.num(1.0)
    mask = np.tril(np.ones((s, s)))  # causal: position i sees 0 ... i
    h = p["wte"][inp] + p["wpe"][None, :s]
    caches = []
    for i in range(cfg.layers):
        q_ = f"h{i}."
        a, c1 = _ln(h, p[q_ + "ln1.g"], p[q_ + "ln1.b"], cfg.ln_eps, A)
        qkv = a @ p[q_ + "attn.qkv.w"]
        q, k, v = (
            qkv[..., j * d : (j + 1) * d].reshape(bsz, s, nh, hw).transpose(0, 2, 1, 3)
            for j in range(3)
        )
        att = _masked_softmax((q @ k.transpose(0, 1, 3, 2)) * scale, mask, A)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(bsz, s, d)
        h1 = h + o @ p[q_ + "attn.out.w"] + p[q_ + "attn.out.b"]
        m, c2 = _ln(h1, p[q_ + "ln2.g"], p[q_ + "ln2.b"], cfg.ln_eps, A)
        u = m @ p[q_ + "mlp.fc.w"] + p[q_ + "mlp.fc.b"]
        gu, aux = _gelu(u, cfg.gelu_tanh, A)
        h2 = h1 + gu @ p[q_ + "mlp.proj.w"] + p[q_ + "mlp.proj.b"]
        caches.append((a, c1, q, k, v, att, o, m, c2, u, gu, aux))
        h = h2
    f, cf = _ln(h, p["lnf.g"], p["lnf.b"], cfg.ln_eps, A)
    logits = f @ p["head.w"]
    lm = logits.max(axis=-1, keepdims=True)
    e = A.exp(logits - lm)
    se = e.sum(axis=-1, keepdims=True)
    rows = np.arange(bsz)[:, None], np.arange(s)[None, :]
    n = A.num(bsz * s)
    loss = (lm[..., 0] + A.log(se[..., 0]) - logits[rows[0], rows[1], tgt]).sum() / n

    g: dict = {}
    dlogits = e / se
    dlogits[rows[0], rows[1], tgt] -= 1
    dlogits = dlogits / n
    g["head.w"] = f.reshape(-1, d).T @ dlogits.reshape(-1, cfg.vocab)
    dh, g["lnf.g"], g["lnf.b"] = _ln_back(dlogits @ p["head.w"].T, cf, A)
    for i in reversed(range(cfg.layers)):
        q_ = f"h{i}."
        a, c1, q, k, v, att, o, m, c2, u, gu, aux = caches[i]
        g[q_ + "mlp.proj.w"] = gu.reshape(-1, 4 * d).T @ dh.reshape(-1, d)
        g[q_ + "mlp.proj.b"] = dh.reshape(-1, d).sum(axis=0)
        du = _gelu_back(dh @ p[q_ + "mlp.proj.w"].T, u, aux, cfg.gelu_tanh, A)
        g[q_ + "mlp.fc.w"] = m.reshape(-1, d).T @ du.reshape(-1, 4 * d)
        g[q_ + "mlp.fc.b"] = du.reshape(-1, 4 * d).sum(axis=0)
        dm, g[q_ + "ln2.g"], g[q_ + "ln2.b"] = _ln_back(du @ p[q_ + "mlp.fc.w"].T, c2, A)
        dh1 = dh + dm
        g[q_ + "attn.out.w"] = o.reshape(-1, d).T @ dh1.reshape(-1, d)
        g[q_ + "attn.out.b"] = dh1.reshape(-1, d).sum(axis=0)
        do = (dh1 @ p[q_ + "attn.out.w"].T).reshape(bsz, s, nh, hw).transpose(0, 2, 1, 3)
        datt = do @ v.transpose(0, 1, 3, 2)
        dv = att.transpose(0, 1, 3, 2) @ do
        ds = att * (datt - (datt * att).sum(axis=-1, keepdims=True)) * scale
        dq = ds @ k
        dk = ds.transpose(0, 1, 3, 2) @ q
        dqkv = np.concatenate(
            [t.transpose(0, 2, 1, 3).reshape(bsz, s, d) for t in (dq, dk, dv)], axis=-1
        )
        g[q_ + "attn.qkv.w"] = a.reshape(-1, d).T @ dqkv.reshape(-1, 3 * d)
        da, g[q_ + "ln1.g"], g[q_ + "ln1.b"] = _ln_back(dqkv @ p[q_ + "attn.qkv.w"].T, c1, A)
        dh = dh1 + da
    g["wpe"] = np.zeros_like(p["wpe"])
    g["wpe"][:s] = dh.sum(axis=0)
    g["wte"] = np.zeros_like(p["wte"])
    np.add.at(g["wte"], inp.reshape(-1), dh.reshape(-1, d))
    return loss, g


def adamw_update(
    cfg: TrainConfig, p: dict, g: dict, m: dict, v: dict, t: int, A: Arith = FLOAT64
) -> None:
    """One AdamW step in place (optax's form; torch's is the same math, rounded otherwise).

    Decoupled: u = m_hat / (sqrt(v_hat) + eps) + wd * p, p -= lr * u. `cfg.l2_decay` adds
    wd * p to the gradient before the moments instead; `cfg.adam_eps_inside` takes
    sqrt(v_hat + eps)."""
    b1, b2 = A.num(cfg.beta1), A.num(cfg.beta2)
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    wd, lr, eps = A.num(cfg.weight_decay), A.num(cfg.lr), A.num(cfg.adam_eps)
    for name, shape in param_layout(cfg):
        decay = decayed(name, shape)
        grad = g[name] + wd * p[name] if (cfg.l2_decay and decay) else g[name]
        m[name] = b1 * m[name] + (1 - b1) * grad
        v[name] = b2 * v[name] + (1 - b2) * grad * grad
        mh, vh = m[name] / bc1, v[name] / bc2
        u = mh / A.sqrt(vh + eps) if cfg.adam_eps_inside else mh / (A.sqrt(vh) + eps)
        if decay and not cfg.l2_decay:
            u = u + wd * p[name]
        p[name] = p[name] - lr * u


def run_reference(
    cfg: TrainConfig, flat_params: np.ndarray, batches: np.ndarray, A: Arith = FLOAT64
) -> dict[str, np.ndarray]:
    """`cfg.steps` AdamW steps from the packed initial parameters, in arithmetic `A`.

    Returns:
      {"loss": [steps], "grad/<name>": [steps, *shape] (the gradient at step t's
      parameters), "param/<name>": [steps, *shape] (the parameters after step t)}: the same
      names and layout every implementation returns.
    """
    init = np.asarray(flat_params).astype(np.float64)
    if A.dtype is object:
        init = np.array([A.num(float(x)) for x in init], dtype=object)
    p = {k: np.array(x) for k, x in unpack(cfg, init).items()}
    zero = {k: x * 0 for k, x in p.items()}
    m, v = dict(zero), dict(zero)
    tokens = np.asarray(batches).astype(np.int64)
    out: dict[str, list] = {"loss": []}
    for t in range(cfg.steps):
        loss, g = loss_and_grads(cfg, p, tokens[t], A)
        adamw_update(cfg, p, g, m, v, t + 1, A)
        out["loss"].append(loss)
        for name, _ in param_layout(cfg):
            out.setdefault(f"grad/{name}", []).append(g[name])
            out.setdefault(f"param/{name}", []).append(p[name])
    return {k: np.array(x, dtype=A.dtype) for k, x in out.items()}
