"""The training run in JAX: jax.numpy forward, `jax.value_and_grad`, optax AdamW.

Imported only where JAX runs (a worker, `diag.train.compare_ports`). The model and its
conventions are `diag.train.config`'s; the mixed-precision policy is the one every
implementation keeps (docs/train.md): float32 master weights; under bfloat16 compute
the weights are cast to bfloat16 in the loss, every matmul and elementwise op runs in
bfloat16, layer norm and both softmaxes compute in float32 from bfloat16 inputs and round
back, and the loss is float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diag.train.config import TrainConfig, decayed, from_case, param_layout, unpack

__all__ = ["run", "op"]


def _ln(x, g, b, eps, cd):
    x32 = x.astype(jnp.float32) if cd != jnp.float64 else x
    mu = jnp.mean(x32, axis=-1, keepdims=True)
    xc = x32 - mu
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    y = xc * jax.lax.rsqrt(var + eps) * g.astype(x32.dtype) + b.astype(x32.dtype)
    return y.astype(cd)


def loss_of(params, tokens, cfg: TrainConfig, cd):
    p = {k: v.astype(cd) for k, v in params.items()}
    hi = jnp.float64 if cd == jnp.float64 else jnp.float32
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    bsz, s = inp.shape
    d, nh, dh = cfg.width, cfg.heads, cfg.head_width
    mask = jnp.tril(jnp.ones((s, s), dtype=bool))
    h = p["wte"][inp] + p["wpe"][:s]
    for i in range(cfg.layers):
        q_ = f"h{i}."
        a = _ln(h, p[q_ + "ln1.g"], p[q_ + "ln1.b"], cfg.ln_eps, cd)
        qkv = a @ p[q_ + "attn.qkv.w"]
        q, k, v = (
            qkv[..., j * d : (j + 1) * d].reshape(bsz, s, nh, dh).transpose(0, 2, 1, 3)
            for j in range(3)
        )
        scores = q @ k.transpose(0, 1, 3, 2)
        if cfg.attn_scale:
            scores = scores * jnp.asarray(1.0 / np.sqrt(dh), cd)
        att = jax.nn.softmax(jnp.where(mask, scores.astype(hi), -jnp.inf), axis=-1).astype(cd)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(bsz, s, d)
        h = h + o @ p[q_ + "attn.out.w"] + p[q_ + "attn.out.b"]
        m = _ln(h, p[q_ + "ln2.g"], p[q_ + "ln2.b"], cfg.ln_eps, cd)
        u = jax.nn.gelu(m @ p[q_ + "mlp.fc.w"] + p[q_ + "mlp.fc.b"], approximate=cfg.gelu_tanh)
        h = h + u @ p[q_ + "mlp.proj.w"] + p[q_ + "mlp.proj.b"]
    logits = (_ln(h, p["lnf.g"], p["lnf.b"], cfg.ln_eps, cd) @ p["head.w"]).astype(hi)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))


def _optimizer(cfg: TrainConfig, mask: dict):
    # optax: u = m_hat / (sqrt(v_hat + eps_root) + eps); eps inside the root is eps_root.
    eps, eps_root = (0.0, cfg.adam_eps) if cfg.adam_eps_inside else (cfg.adam_eps, 0.0)
    if cfg.l2_decay:  # Adam with an L2 term: the decay joins the gradient before the moments
        return optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask),
            optax.adam(cfg.lr, cfg.beta1, cfg.beta2, eps=eps, eps_root=eps_root),
        )
    return optax.adamw(
        cfg.lr,
        cfg.beta1,
        cfg.beta2,
        eps=eps,
        eps_root=eps_root,
        weight_decay=cfg.weight_decay,
        mask=mask,
    )


@functools.lru_cache(maxsize=8)
def _step(cfg: TrainConfig, compute: str):
    """The jitted step and its optimizer, compiled once per configuration (a worker times
    the same run several times)."""
    cd = jnp.dtype(compute)
    mask = {name: decayed(name, shape) for name, shape in param_layout(cfg)}
    tx = _optimizer(cfg, mask)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_of)(params, batch, cfg, cd)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, grads

    return step, tx


def op(compute: str, case: dict, device=None):
    """The worker's `train` op: (packed parameters, batches) -> the trajectory. Runs its own
    jitted step per step (`eager`: the worker warms it up instead of jitting the whole)."""
    cfg = from_case(case)

    def train(params, batches):
        return run(cfg, np.asarray(params), np.asarray(batches), compute, device)

    setattr(train, "eager", True)  # noqa: B010 - read as getattr(fn, "eager", False); mypy has no fn attrs
    return train


def run(
    cfg: TrainConfig, flat_params, batches, compute: str = "float32", device=None
) -> dict[str, np.ndarray]:
    """`cfg.steps` AdamW steps; the trajectory (`loss`, `grad/<name>`, `param/<name>`) on the host.

    Args:
      cfg: the model and conventions.
      flat_params: packed initial parameters (float32; float64 for a float64 run).
      batches: [steps, batch, seq + 1] token ids.
      compute: `float32`, `bfloat16` (mixed: float32 master weights) or `float64` (needs
        `jax_enable_x64`; master weights float64).
      device: the JAX device to run on (default: JAX's default device).
    """
    master = np.float64 if compute == "float64" else np.float32
    host = unpack(cfg, np.asarray(flat_params).astype(master))
    params = {k: jax.device_put(np.array(v), device) for k, v in host.items()}
    step, tx = _step(cfg, compute)
    state = tx.init(params)
    tokens = jax.device_put(np.asarray(batches).astype(np.int32), device)
    out: dict[str, list] = {"loss": []}
    for t in range(cfg.steps):
        params, state, loss, grads = step(params, state, tokens[t])
        out["loss"].append(loss)
        for name, _ in param_layout(cfg):
            out.setdefault(f"grad/{name}", []).append(grads[name])
            out.setdefault(f"param/{name}", []).append(params[name])
    return {k: np.asarray(jnp.stack(v)) for k, v in out.items()}
