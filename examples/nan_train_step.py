"""Hunting a "random NaN loss" in a JAX training step with diag.

The step normalises each example (a hand-written layer norm without an epsilon), runs a small
MLP, and accumulates gradients over micro-batches with `lax.scan`. One micro-batch holds an
example whose features are all equal: its variance is 0, the normalisation divides 0 by 0, and
the loss and every gradient turn NaN. The loss curve only says "NaN at step k"; diag says which
op, which line, which micro-batch, forward or backward, and what the op was given.

Run it:
    python examples/nan_train_step.py            # prints the report and the one-line reason
    diag nan examples/nan_train_step.py:bad_step  # the same from the command line (exit 1)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import diag.nan


def normalise(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var)  # no epsilon: a constant row is 0 / 0


def loss_fn(params, x, y):
    h = jnp.tanh(normalise(x) @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
        logits, y[:, None], axis=-1)[:, 0])


@jax.jit
def train_step(params, xs, ys, lr=0.1):
    """One optimizer step over micro-batches xs[i], ys[i] (gradient accumulation in a scan)."""

    def micro(acc, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return jax.tree.map(jnp.add, acc, grads), loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, losses = jax.lax.scan(micro, zeros, (xs, ys))
    new = jax.tree.map(lambda p, g: p - lr * g / xs.shape[0], params, grads)
    return new, jnp.mean(losses)


def make_inputs(bad_micro_batch: int | None = 3):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.2, "b1": jnp.zeros(32),
              "w2": jax.random.normal(k2, (32, 10)) * 0.2}
    xs = jax.random.normal(k3, (6, 8, 16))  # 6 micro-batches of 8 examples
    ys = jax.random.randint(k4, (6, 8), 0, 10)
    if bad_micro_batch is not None:
        xs = xs.at[bad_micro_batch, 5].set(1.0)  # a constant example: variance 0
    return params, xs, ys


def bad_step():
    """What `diag nan examples/nan_train_step.py:bad_step` hunts: (function, arguments)."""
    return train_step, make_inputs(bad_micro_batch=3)


def good_step():
    return train_step, make_inputs(bad_micro_batch=None)


def main() -> None:
    _, loss = train_step(*make_inputs())
    print(f"loss after one step: {float(loss)}")
    report = diag.nan.locate(*bad_step()[:1], *bad_step()[1])
    print(f"report: {diag.nan.reason(report)}")
    print(f"clean inputs: {diag.nan.reason(diag.nan.locate(good_step()[0], *good_step()[1]))}")


if __name__ == "__main__":
    main()
