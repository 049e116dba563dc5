"""The training run in PyTorch: a torch.nn module, autograd, torch.optim.AdamW.

Imported only where torch runs (a worker, `diag.train.compare_ports`). Same model,
conventions and mixed-precision policy as `diag.train.jax_model` (see its docstring), written
the way a PyTorch port would be: parameters in an `nn.Module`, `torch.nn.functional` ops,
two optimizer parameter groups (decayed matrices, the rest). Where torch has no switch for a
planted porting bug (eps inside the square root), the port carries its own optimizer, as
ports that hand-write Adam do.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from diag.train.config import TrainConfig, decayed, from_case, param_layout, unpack

__all__ = ["run", "op", "TinyGPT"]


class TinyGPT(torch.nn.Module):
    """The decoder-only transformer of `diag.train.config`, parameters named as there."""

    def __init__(self, cfg: TrainConfig, flat: np.ndarray, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.names = [name for name, _ in param_layout(cfg)]
        # ParameterDict keys may not contain dots.
        self.p = torch.nn.ParameterDict(
            {
                name.replace(".", "_"): torch.nn.Parameter(torch.tensor(np.array(v), dtype=dtype))
                for name, v in unpack(cfg, flat).items()
            }
        )

    def param(self, name: str) -> torch.nn.Parameter:
        return self.p[name.replace(".", "_")]

    def forward(self, tokens: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
        cfg = self.cfg
        hi = torch.float64 if cd == torch.float64 else torch.float32
        p = {name: self.param(name).to(cd) for name in self.names}
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        bsz, s = inp.shape
        d, nh, dh = cfg.width, cfg.heads, cfg.head_width
        mask = torch.ones(s, s, dtype=torch.bool).tril()

        def ln(x, g, b):
            return F.layer_norm(x.to(hi), (d,), g.to(hi), b.to(hi), cfg.ln_eps).to(cd)

        h = F.embedding(inp, p["wte"]) + p["wpe"][:s]
        for i in range(cfg.layers):
            q_ = f"h{i}."
            a = ln(h, p[q_ + "ln1.g"], p[q_ + "ln1.b"])
            qkv = a @ p[q_ + "attn.qkv.w"]
            q, k, v = (t.reshape(bsz, s, nh, dh).transpose(1, 2) for t in qkv.split(d, dim=-1))
            scores = q @ k.transpose(-2, -1)
            if cfg.attn_scale:
                scores = scores * torch.tensor(1.0 / np.sqrt(dh), dtype=cd)
            att = torch.softmax(scores.to(hi).masked_fill(~mask, -math.inf), dim=-1).to(cd)
            o = (att @ v).transpose(1, 2).reshape(bsz, s, d)
            h = h + o @ p[q_ + "attn.out.w"] + p[q_ + "attn.out.b"]
            m = ln(h, p[q_ + "ln2.g"], p[q_ + "ln2.b"])
            u = F.gelu(
                m @ p[q_ + "mlp.fc.w"] + p[q_ + "mlp.fc.b"],
                approximate="tanh" if cfg.gelu_tanh else "none",
            )
            h = h + u @ p[q_ + "mlp.proj.w"] + p[q_ + "mlp.proj.b"]
        logits = (ln(h, p["lnf.g"], p["lnf.b"]) @ p["head.w"]).to(hi)
        return F.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))


class _AdamWEpsInside(torch.optim.Optimizer):
    """A hand-written AdamW with eps inside the square root: the planted porting bug
    `adam_eps_inside` (torch.optim has no such switch)."""

    def __init__(self, groups, lr, betas, eps):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["t"] += 1
                t = st["t"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                mh, vh = st["m"] / (1 - b1**t), st["v"] / (1 - b2**t)
                p.add_(mh / (vh + group["eps"]).sqrt(), alpha=-group["lr"])


def _optimizer(cfg: TrainConfig, model: TinyGPT):
    dec = [model.param(n) for n, s in param_layout(cfg) if decayed(n, s)]
    rest = [model.param(n) for n, s in param_layout(cfg) if not decayed(n, s)]
    groups = [
        {"params": dec, "weight_decay": cfg.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.adam_eps_inside:
        if cfg.l2_decay:
            raise ValueError("adam_eps_inside and l2_decay together are not implemented")
        return _AdamWEpsInside(groups, cfg.lr, betas, cfg.adam_eps)
    if cfg.l2_decay:  # torch.optim.Adam's weight_decay is an L2 term on the gradient
        return torch.optim.Adam(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps)


def op(compute: str, case: dict, device=None):
    """The worker's `train` op: (packed parameters, batches) as tensors -> the trajectory as
    CPU tensors (what the worker reads back)."""
    cfg = from_case(case)

    def train(params, batches):
        out = run(
            cfg, params.detach().cpu().numpy(), batches.detach().cpu().numpy(), compute, device
        )
        return {k: torch.from_numpy(v) for k, v in out.items()}

    return train


def run(
    cfg: TrainConfig, flat_params, batches, compute: str = "float32", device=None
) -> dict[str, np.ndarray]:
    """`cfg.steps` AdamW steps; the trajectory (`loss`, `grad/<name>`, `param/<name>`) on the host.

    Args: as `diag.train.jax_model.run` (`device`: a torch device, default CPU).
    """
    cd = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[compute]
    master = torch.float64 if compute == "float64" else torch.float32
    flat = np.asarray(flat_params).astype(np.float64 if compute == "float64" else np.float32)
    model = TinyGPT(cfg, flat, master).to(device or "cpu")
    opt = _optimizer(cfg, model)
    tokens = torch.tensor(np.asarray(batches).astype(np.int64), device=device or "cpu")
    out: dict[str, list] = {"loss": []}
    for t in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        loss = model(tokens[t], cd)
        loss.backward()
        opt.step()
        out["loss"].append(loss.detach().cpu().numpy())
        for name in model.names:
            prm = model.param(name)
            if prm.grad is None:  # every parameter is in the loss: backward() set its grad
                raise RuntimeError(f"backward() left no gradient for {name}")
            out.setdefault(f"grad/{name}", []).append(prm.grad.detach().cpu().numpy().copy())
            out.setdefault(f"param/{name}", []).append(prm.detach().cpu().numpy().copy())
    return {k: np.stack(v) for k, v in out.items()}
