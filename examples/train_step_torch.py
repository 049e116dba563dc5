"""One training step in PyTorch (a small MLP, `torch.optim.AdamW`), judged against float64.

The step standardises each example's raw features (readings around 1000 with a spread of 1,
as sensors or counters give them), runs a two-layer MLP, takes the cross-entropy loss, and
makes one AdamW update. Outputs: the loss and every updated parameter. The step builds its
optimizer from the parameters it is given, so it computes in their dtype (float64 for the
reference) and can be run again and again with the same result.

* `clean`: the variance in two passes, mean((x - mean)^2).
* `planted`: the variance in one pass, mean(x^2) - mean(x)^2: two values near 1e6 cancel
  in float32 and the standardised features keep only a few correct bits.

    diag run examples/train_step_torch.py:clean      # every output within its allowance
    diag run examples/train_step_torch.py:planted    # fails; names the sub and its line

In a test: ``fn, args = clean(); diag.testing.assert_numerics(fn, *args)``.
"""

from __future__ import annotations

import torch

BATCH, FEATURES, HIDDEN, CLASSES = 32, 64, 32, 10


def standardise_two_pass(x):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5)


def standardise_one_pass(x):
    mean = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mean * mean  # the planted cancellation
    return (x - mean) / torch.sqrt(var + 1e-5)


def _step(standardise, params, x, y):
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.01)
    h = torch.tanh(standardise(x) @ params["w1"] + params["b1"])
    loss = torch.nn.functional.cross_entropy(h @ params["w2"] + params["b2"], y)
    loss.backward()
    opt.step()
    return loss.detach(), {k: v.detach() for k, v in params.items()}


def train_step(params, x, y):
    """One AdamW step with the two-pass standardisation."""
    return _step(standardise_two_pass, params, x, y)


def train_step_one_pass(params, x, y):
    """The planted bug: the same step with a one-pass variance."""
    return _step(standardise_one_pass, params, x, y)


def _inputs():
    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(FEATURES, HIDDEN, generator=g) * FEATURES**-0.5,
        "b1": torch.zeros(HIDDEN),
        "w2": torch.randn(HIDDEN, CLASSES, generator=g) * HIDDEN**-0.5,
        "b2": torch.zeros(CLASSES),
    }
    x = 1000.0 + torch.randn(BATCH, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return params, x, y


def clean():
    return train_step, _inputs()


def planted():
    return train_step_one_pass, _inputs()
