"""PyTorch steps that write NaN/Inf, for `diag nan`: a GPT-2 whose fp16 attention overflows and
an RMSE distillation step at loss 0.

A student equal to its teacher has an RMSE loss (`sqrt(mse)`) of exactly 0, a finite number;
backward then divides by 2 sqrt(0) and writes NaN/Inf into every gradient. A Hugging Face GPT-2
(built from a config with random weights: nothing is downloaded) run in fp16 with its attention
weights scaled up overflows in ``query @ key^T`` before the causal mask is added.

Run them:
    diag nan examples/nan_torch_steps.py:rmse_case   # names SqrtBackward0, in backward
    diag nan examples/nan_torch_steps.py:gpt2_case   # names the matmul in modeling_gpt2.py

The tests (tests/test_nan_third_party_torch.py) and benchmarks/bench_nan.py build their steps
here.
"""

from __future__ import annotations

from collections.abc import Callable


def rmse_distillation(make_model: Callable, input_shape: tuple[int, ...], seed: int = 0):
    """A student equal to its teacher (both `make_model()`, the teacher given the student's
    weights) and the step that distills it with an RMSE loss on `torch.randn(*input_shape)`.

    Returns:
      (student, step): `step()` runs forward and backward and returns the (zero) loss.
    """
    import torch

    torch.manual_seed(seed)
    student, teacher = make_model(), make_model()
    teacher.load_state_dict(student.state_dict())
    x = torch.randn(*input_shape)

    def step():
        with torch.no_grad():
            target = teacher(x)
        loss = torch.sqrt(torch.nn.functional.mse_loss(student(x), target))
        loss.backward()
        return loss.detach()

    return student, step


def gpt2(scale: float = 1.0, seed: int = 0):
    """A 2-layer fp16 GPT-2 LM with random weights, its second layer's attention projection
    scaled by `scale` (1000: ``query @ key^T`` overflows)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128,
                                  n_positions=32, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).half().eval()
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight.mul_(scale)
    return model


def gpt2_ids(batch: int = 1, seed: int = 1):
    """16 token ids per row, drawn from their own generator."""
    import torch

    return torch.randint(0, 128, (batch, 16), generator=torch.Generator().manual_seed(seed))


def forward_of(model):
    """The model's logits without autograd: what an inference step runs."""
    import torch

    def forward(ids):
        with torch.no_grad():
            return model(ids).logits

    return forward


def gpt2_case():
    """`diag nan FILE:gpt2_case`: the overflowing GPT-2's forward and its input."""
    return forward_of(gpt2(scale=1000.0)), (gpt2_ids(),)


def rmse_case():
    """`diag nan FILE:rmse_case`: a one-layer student at RMSE loss 0."""
    import torch

    _, step = rmse_distillation(lambda: torch.nn.Linear(4, 3), (8, 4))
    return step, ()
