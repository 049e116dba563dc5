"""A small GPT-2 decoder's forward pass in PyTorch, judged by diag against float64.

transformers' `GPT2LMHeadModel` built from a tiny `GPT2Config` with random weights
(`torch.manual_seed`; nothing is downloaded), logits out. The weights are drawn at the scale a
trained model reaches (initializer_range 0.4): attention logits above 11, where `exp`
overflows float16.

* `clean`: the model as transformers ships it (scaled-dot-product attention in float32).
* `planted`: an attention function that computes the softmax in float16 without subtracting
  the row maximum first, a "memory saving" seen in ports of fused kernels. Scores above 11.09
  overflow `exp` to inf, and the rows holding them turn to NaN.

    diag run examples/decoder_torch.py:clean      # every output within its allowance
    diag run examples/decoder_torch.py:planted    # fails; names the exp and its line

In a test: ``fn, args = clean(); diag.testing.assert_numerics(fn, *args)``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel

VOCAB, SEQ = 64, 12


def fp16_softmax_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention with its softmax in float16 and no max-subtraction (the planted bug)."""
    scores = (query @ key.transpose(-1, -2)) * (scaling or query.size(-1) ** -0.5)
    n, m = scores.shape[-2:]
    causal = torch.ones(n, m, dtype=torch.bool).tril(m - n)
    scores = scores.masked_fill(~causal, float("-inf"))
    e = torch.exp(scores.to(torch.float16))  # overflows to inf for scores > 11.09
    weights = (e / e.sum(-1, keepdim=True)).to(value.dtype)
    return (weights @ value).transpose(1, 2), weights


AttentionInterface.register("fp16_softmax", fp16_softmax_attention)


class Logits(torch.nn.Module):
    """The model's logits for a batch of token ids (`.double()` makes the float64 reference)."""

    def __init__(self, model: GPT2LMHeadModel):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def _model(attention: str) -> Logits:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        initializer_range=0.4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attention,
    )
    return Logits(GPT2LMHeadModel(config).eval())


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def clean():
    return _model("sdpa"), (_ids(),)


def planted():
    return _model("fp16_softmax"), (_ids(),)
