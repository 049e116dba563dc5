"""Planted precision bugs in PyTorch code around transformers models built from tiny configs
(random weights, no download), each with its correct twin and its float64 evaluation.

Every maker returns ``(fn, args)``: the model is an argument, so diag's float64 reference
turns it to float64 itself. The line that holds the planted bug ends in ``# planted: <case>``; its
twin changes that line only. ``<case>_float64()`` evaluates the same math in float64 (the
model `.double()`, the twin's line), which the tests measure both against.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaRMSNorm,
)


def _seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _llama_config() -> LlamaConfig:
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=64,
        max_position_embeddings=4096,
    )
    cfg._attn_implementation = "eager"
    return cfg


# -- 1. rotary angles in bf16 (Llama attention) -------------------------------------------
def rope_bf16(attn, hidden, positions, inv_freq):
    angles = positions[:, None] * inv_freq[None, :]  # planted: rope
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos()[None].to(hidden.dtype), emb.sin()[None].to(hidden.dtype)
    return attn(hidden, position_embeddings=(cos, sin), attention_mask=None)[0]


def rope_fp32(attn, hidden, positions, inv_freq):
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos()[None].to(hidden.dtype), emb.sin()[None].to(hidden.dtype)
    return attn(hidden, position_embeddings=(cos, sin), attention_mask=None)[0]


def _rope_args(dtype):
    _seeded(0)
    attn = LlamaAttention(_llama_config(), layer_idx=0).eval().to(dtype)
    t = 256
    hidden = torch.randn(1, t, 32).to(dtype)
    positions = (torch.arange(t) + 1500).to(dtype)  # a long context: positions past 1500
    inv_freq = (1.0 / 10000 ** (torch.arange(0, 16, 2).double() / 16)).to(dtype)
    return attn, hidden, positions, inv_freq


def rope_planted():
    return rope_bf16, _rope_args(torch.bfloat16)


def rope_twin():
    return rope_fp32, _rope_args(torch.bfloat16)


def rope_float64():
    attn, hidden, positions, inv_freq = _rope_args(torch.bfloat16)
    with torch.no_grad():
        return rope_fp32_64(attn.double(), hidden.double(), positions.double(), inv_freq.double())


def rope_fp32_64(attn, hidden, positions, inv_freq):
    angles = positions[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], -1)
    return attn(hidden, position_embeddings=(emb.cos()[None], emb.sin()[None]))[0]


# -- 2. an fp16 masked sum that overflows (BERT, mean pooling over a batch's tokens) -------
def pool_fp16(model, ids, mask):
    h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    total = (h * mask[..., None]).sum((0, 1))  # planted: pool
    return total / mask.sum()


def pool_fp32(model, ids, mask):
    h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    total = (h.float() * mask[..., None].float()).sum((0, 1))
    return (total / mask.float().sum()).to(h.dtype)


def _bert(dtype, layers: int = 1):
    _seeded(1)
    cfg = BertConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_hidden_layers=layers,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=512,
    )
    cfg._attn_implementation = "eager"
    model = BertModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():  # BERT's outlier dimensions: a few LayerNorm biases near 40
        model.encoder.layer[-1].output.LayerNorm.bias[:3] = 40.0
    return model.to(dtype)


def _pool_args(dtype):
    model = _bert(dtype)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (16, 128), generator=g)
    mask = torch.ones(16, 128, dtype=dtype)
    return model, ids, mask


def pool_planted():
    return pool_fp16, _pool_args(torch.float16)


def pool_twin():
    return pool_fp32, _pool_args(torch.float16)


def pool_float64():
    model, ids, mask = _pool_args(torch.float16)
    with torch.no_grad():
        return pool_fp16(model.double(), ids, mask.double())


# -- 3. log(1 - sigmoid(z)) for large logits (BERT classifier, float32) -------------------
def logsig_naive(model, head, ids):
    z = head(model(input_ids=ids).last_hidden_state[:, 0]).squeeze(-1)
    return torch.log(1 - torch.sigmoid(z))  # planted: logsig


def logsig_stable(model, head, ids):
    z = head(model(input_ids=ids).last_hidden_state[:, 0]).squeeze(-1)
    return F.logsigmoid(-z)


def _logsig_args():
    model = _bert(torch.float32, layers=2)
    with torch.no_grad():
        model.encoder.layer[-1].output.LayerNorm.bias.zero_()
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(32, 1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, 32, generator=g) * 8.0)  # confident logits
    ids = torch.randint(0, 128, (64, 16), generator=g)
    return model, head, ids


def logsig_planted():
    return logsig_naive, _logsig_args()


def logsig_twin():
    return logsig_stable, _logsig_args()


def logsig_float64():
    model, head, ids = _logsig_args()
    with torch.no_grad():
        return logsig_stable(model.double(), head.double(), ids)


# -- 4. fp16 softmax without the max subtraction (GPT-2, attention pooling) ---------------
def attnpool_naive(model, ids, query):
    h = model(input_ids=ids).last_hidden_state
    scores = h @ query
    e = torch.exp(scores)  # planted: attnpool
    w = e / e.sum(-1, keepdim=True)
    return (w[..., None] * h).sum(1)


def attnpool_softmax(model, ids, query):
    h = model(input_ids=ids).last_hidden_state
    w = torch.softmax(h @ query, -1)
    return (w[..., None] * h).sum(1)


def _gpt2(dtype):
    _seeded(4)
    cfg = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=128)
    cfg._attn_implementation = "eager"
    return GPT2Model(cfg).eval().to(dtype)


def _attnpool_args(dtype):
    model = _gpt2(dtype)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (4, 64), generator=g)
    query = (torch.randn(32, generator=g) * 4).to(dtype)
    return model, ids, query


def attnpool_planted():
    return attnpool_naive, _attnpool_args(torch.float16)


def attnpool_twin():
    return attnpool_softmax, _attnpool_args(torch.float16)


def attnpool_float64():
    model, ids, query = _attnpool_args(torch.float16)
    with torch.no_grad():
        return attnpool_softmax(model.double(), ids, query.double())


# -- 5. RMSNorm without the float32 upcast (Llama layer, fp16, massive activations) --------
def _identity_rope(hidden):
    """cos = 1, sin = 0: this case is about the norm, not the rotary embedding."""
    ones = torch.ones(1, hidden.shape[1], 16, dtype=hidden.dtype)
    return ones, torch.zeros_like(ones)


def rmsnorm_fp16(layer, norm_weight, hidden):
    h = layer(hidden, position_embeddings=_identity_rope(hidden))
    var = (h * h).mean(-1, keepdim=True)  # planted: rmsnorm
    return norm_weight * (h * torch.rsqrt(var + 1e-6))


def rmsnorm_llama(layer, norm_weight, hidden):
    h = layer(hidden, position_embeddings=_identity_rope(hidden))
    norm = LlamaRMSNorm(h.shape[-1], eps=1e-6).to(h.dtype)
    with torch.no_grad():
        norm.weight.copy_(norm_weight)
    return norm(h)


def _rmsnorm_args(dtype):
    _seeded(6)
    layer = LlamaDecoderLayer(_llama_config(), layer_idx=0).eval()
    hidden = torch.randn(2, 16, 32) * 300.0  # the massive activations of a large model
    return layer.to(dtype), torch.ones(32, dtype=dtype), hidden.to(dtype)


def rmsnorm_planted():
    return rmsnorm_fp16, _rmsnorm_args(torch.float16)


def rmsnorm_twin():
    return rmsnorm_llama, _rmsnorm_args(torch.float16)


def rmsnorm_float64():
    layer, w, hidden = _rmsnorm_args(torch.float16)
    with torch.no_grad():
        return rmsnorm_fp16(layer.double(), w.double(), hidden.double())


# -- 6. a training step whose module hard-codes its compute dtype (torch.optim) ---------
class Regressor(torch.nn.Module):
    """Two layers that compute in `dtype`, whatever their parameters' dtype (as a module
    with a ``dtype=`` argument does)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        self.dtype = dtype

    def cast(self, *ts):
        return [t.to(self.dtype) for t in ts]  # planted: step

    def forward(self, x):
        x, w1, b1, w2, b2 = self.cast(x, self.l1.weight, self.l1.bias, *self.l2.parameters())
        return F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2).to(self.l1.weight.dtype)


def train_step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.detach(), model.l1.weight.grad


def _step_args(dtype):
    _seeded(7)
    model = Regressor(dtype)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 16, generator=g)
    with torch.no_grad():  # near convergence: targets within 1e-2 of the predictions
        y = _exact(model)(x) + 0.01 * torch.randn(64, 4, generator=g)
    return model, x, y


def _exact(model):
    twin = Regressor(torch.float32)
    twin.load_state_dict(model.state_dict())
    return twin


def step_planted():
    return train_step, _step_args(torch.bfloat16)


def step_twin():
    return train_step, _step_args(torch.float32)


def step_float64():
    model, x, y = _step_args(torch.float64)
    return train_step(model.double(), x.double(), y.double())
