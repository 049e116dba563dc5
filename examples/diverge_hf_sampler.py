"""Hugging Face transformers' own logits warpers (`TopPLogitsWarper`, `TemperatureLogitsWarper`)
as a sampler, on 32k-token logits in bfloat16, under the PyTorch shadow:

    diag diverge examples/diverge_hf_sampler.py:made     # exit 1: the top-p cut in bf16 keeps
                                                         # other tokens than float64 keeps
    diag diverge examples/diverge_hf_sampler.py:forced   # exit 0, a warning: two logits / 0.7
                                                         # closer than bf16 resolves
    diag diverge examples/diverge_hf_sampler.py:clean    # exit 0: float32 logits

Nothing is downloaded: the warpers are plain functions of the logits.
"""

import numpy as np
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

VOCAB = 32_000


def top_p_sampler(logits):
    """Top-p 0.9, then the greedy pick among the kept tokens; returns (scores, token): the
    tokens cut have the score -inf."""
    scores = TopPLogitsWarper(0.9)(None, logits)
    return scores, torch.argmax(scores, dim=-1)


def greedy(logits):
    """Greedy decoding after a temperature, as `generate(do_sample=False)` with a warper."""
    return torch.argmax(TemperatureLogitsWarper(0.7)(None, logits), dim=-1)


def _logits(dtype) -> torch.Tensor:
    return torch.tensor(np.random.default_rng(0).normal(0.0, 1.0, (1, VOCAB))).to(dtype)


def made():
    """A flat distribution: the cumulative probabilities cross 1 - 0.9 among tokens whose
    bf16 cumulative sums and the bf16 rounding of 1 - 0.9 (0.10009765625) decide the cut."""
    return top_p_sampler, (_logits(torch.bfloat16),)


def forced():
    """Two leaders one bf16 step apart (1000, 1004; the larger one later): divided by 0.7
    both round to 1432 in bf16, and the tie picks the first."""
    x = _logits(torch.float64) * 2.0
    x[0, 100], x[0, 200] = 1000.0, 1004.0
    return greedy, (x.to(torch.bfloat16),)


def clean():
    """The same top-p sampler on float32 logits: every cut as float64 takes it."""
    return top_p_sampler, (_logits(torch.float32),)
