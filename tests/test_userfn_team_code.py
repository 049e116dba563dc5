"""A team's code as written, through the real `diag` script: models held as module globals and
closures, odd outputs (ints, bools, None, dataclasses), an optimizer passed beside its model,
a training step that donates its own module-level optax state, and transformers' Llama with
its rotary embedding patched to compute positions in bfloat16.

Every expected verdict is decided here, independently of diag: the function's own output is
computed in this process, and its normwise error against a float64 evaluation written in the
test (numpy, or torch in float64 on copies made here) is compared with sqrt(u) of the output's
dtype; integer outputs must equal the float64 ones.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys

import numpy as np
import pytest

from tests.conftest import marked_line, run_diag

torch = pytest.importorskip("torch")

SQRT_U = {"float32": 2.0**-12, "bfloat16": 2.0**-4}

TEAM = '''
import dataclasses

import torch
from torch import nn

torch.manual_seed(0)
norm = nn.LayerNorm(32)
fc1 = nn.Linear(32, 64)
fc2 = nn.Linear(64, 32)
x = torch.randn(8, 32)


def block(x):
    return x + fc2(torch.relu(fc1(norm(x))))


def block_probe():
    return block, (x,)


def one_pass_block(x):
    h = x + 300.0
    mean = h.mean(-1, keepdim=True)
    var = (h * h).mean(-1, keepdim=True) - mean * mean
    return fc2(torch.relu(fc1((h - mean) / torch.sqrt(var + 1e-5))))


def one_pass_probe():
    return one_pass_block, (x,)


def count_above(x):
    s = (x + 1000.0).sum() - 1000.0 * x.numel()
    return int(torch.floor(s / 0.01))


def count_probe():
    return count_above, (torch.randn(4096),)


@dataclasses.dataclass
class Out:
    hidden: object
    token: object
    steps: int
    finite: bool
    cache: object = None


def mixed(x):
    h = fc1(norm(x))
    return Out(h, int(h[0].argmax()), 3, bool(torch.isfinite(h).all())), None


def mixed_probe():
    return mixed, (x,)


def sgd_step(model, opt, x, y):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.detach(), model.weight.detach().clone()


def optimizer_probe():
    model = nn.Linear(16, 8)
    return sgd_step, (model, torch.optim.Adam(model.parameters(), lr=0.05), torch.randn(32, 16),
                      torch.randn(32, 8))


def names(x):
    return x * 2, "label"


def names_probe():
    return names, (x,)
'''

JAX_TEAM = '''
from functools import partial

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((8, 16)).astype(np.float32))


class Mlp(linen.Module):
    @linen.compact
    def __call__(self, h):
        h = jnp.tanh(linen.Dense(32, name="inner")(h))
        return linen.Dense(8, name="outer")(h)


def closure_probe():
    model = Mlp()
    params = model.init(jax.random.key(0), x)

    @jax.jit
    def forward(h):
        return model.apply(params, h)

    return forward, (x,)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, h):
        return self.l2(jax.nn.gelu(self.l1(h)))


net = Net(nnx.Rngs(0))


def nnx_forward(h):
    return net(h)


def nnx_probe():
    return nnx_forward, (x,)


w = {"w": jnp.asarray(rng.standard_normal((16, 4)).astype(np.float32))}
opt = optax.adam(1e-2)
state = opt.init(w)


@partial(jax.jit, donate_argnums=(0, 1))
def _update(p, s):
    loss, g = jax.value_and_grad(lambda q: jnp.mean((x @ q["w"]) ** 2))(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


def train_step():
    global w, state
    w, state, loss = _update(w, state)
    return loss, w["w"]
'''


def _load(path, name: str):
    spec = importlib.util.spec_from_file_location(f"team_{path.stem}_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _err(y, r) -> float:
    y, r = np.atleast_1d(np.asarray(y, np.float64)), np.atleast_1d(np.asarray(r, np.float64))
    return float(np.abs(y - r).max() / np.abs(r).max())


def _float_verdict(y, r, dtype="float32") -> str:
    return "pass" if _err(y, r) <= SQRT_U[dtype] else "fail"


def _np(t) -> np.ndarray:
    return t.detach().double().numpy()


def _ln(h: np.ndarray, m) -> np.ndarray:
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return (h - mean) / np.sqrt(var + 1e-5) * _np(m.weight) + _np(m.bias)


def _lin(h: np.ndarray, m) -> np.ndarray:
    return h @ _np(m.weight).T + _np(m.bias)


def _torch_expected(mod) -> dict[str, str]:
    """Each entry's verdict, from float64 evaluations written here."""
    x = _np(mod.x)
    want = {}
    y = mod.block(mod.x).detach()
    r = x + _lin(np.maximum(_lin(_ln(x, mod.norm), mod.fc1), 0), mod.fc2)
    want["block"] = _float_verdict(y, r)
    y = mod.one_pass_block(mod.x).detach()
    h = x + 300.0
    r = _lin(np.maximum(_lin((h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True)
                                                                      + 1e-5), mod.fc1), 0),
             mod.fc2)
    want["one_pass"] = _float_verdict(y, r)
    torch.manual_seed(0)  # count_probe draws with the generator diag seeds with 0
    (v,) = mod.count_probe()[1]
    got = mod.count_above(v)
    s64 = float(np.sum(_np(v) + 1000.0) - 1000.0 * v.numel())
    moved = 2.0**-24 * float(np.abs(_np(v)).sum())  # one rounding of each input
    if got == int(np.floor(s64 / 0.01)):
        want["count"] = "pass"
    elif all(int(np.floor((s64 + d) / 0.01)) == int(np.floor(s64 / 0.01)) for d in (-moved, moved)):
        want["count"] = "fail"  # not forced by rounding the inputs
    else:
        want["count"] = "warn"
    h = _lin(_ln(x, mod.norm), mod.fc1)
    out, _ = mod.mixed(mod.x)
    ints_equal = out.token == int(h[0].argmax()) and out.steps == 3 and out.finite
    floats_pass = _float_verdict(out.hidden.detach(), h) == "pass"
    want["mixed"] = "pass" if ints_equal and floats_pass else "fail"
    return want


def _suite(tmp_path, entries: list[tuple[str, str]]):
    lines = []
    for name, fn in entries:
        lines += ["[[probe]]", f'name = "{name}"', f'fn = "{fn}"', ""]
    path = tmp_path / "team.toml"
    path.write_text("\n".join(lines))
    return path


def _records(proc) -> dict[str, dict]:
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    return {r["probe"].partition(".")[2]: r for r in data["records"] if r["kind"] == "probe"}


def test_torch_team_code_is_judged_right_through_the_diag_script(tmp_path):
    path = tmp_path / "team.py"
    path.write_text(TEAM)
    mod = _load(path, "torch")
    want = _torch_expected(mod)
    # the optimizer step: the same Adam step in float64 on copies made here
    torch.manual_seed(0)  # as diag seeds before calling FUNCTION
    fn, args = mod.optimizer_probe()
    m64 = copy.deepcopy(args[0]).double()
    xs, ys = args[2].double(), args[3].double()
    loss64, w64 = fn(m64, torch.optim.Adam(m64.parameters(), lr=0.05), xs, ys)
    loss, w = fn(*args)
    want["optimizer"] = max(_float_verdict(loss, loss64), _float_verdict(w, w64))
    suite = _suite(tmp_path, [(n, f"team.py:{n}_probe") for n in want])
    proc = run_diag("run", "--suite", str(suite), "-b", "torch-cpu", "--no-report", "--json",
                    cwd=tmp_path)
    records = _records(proc)
    assert {n: records[n]["status"] for n in want} == want
    assert want["block"] == "pass" and want["one_pass"] == "fail"  # the cases mean something
    lifted = records["block"]["metrics"]["reference_lifted"]
    assert lifted == ["global fc1 (Linear)", "global fc2 (Linear)", "global norm (LayerNorm)"]
    assert "first divergent op: aten.sub at team.py:" in records["one_pass"]["reason"]
    mixed = records["mixed"]["metrics"]
    assert [o["path"] for o in mixed["outputs"]] == ["[0].hidden", "[0].token", "[0].steps",
                                                     "[0].finite"]
    assert mixed["outputs_left_out"] == ["[0].cache", "[1]"]
    assert "output[0].cache, output[1] (None) left out" in records["mixed"]["reason"]
    assert proc.returncode == (1 if "fail" in want.values() else 0)


def test_a_non_number_among_the_outputs_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "team.py"
    path.write_text(TEAM)
    proc = run_diag("run", f"{path}:names_probe", "-b", "torch-cpu", "--no-report")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == (
        "diag: the function returned a str at output[1], not an array: return arrays, or a "
        "tuple, list or dict of them"
    )


def test_jax_team_code_is_judged_right_through_the_diag_script(tmp_path):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    path = tmp_path / "jteam.py"
    path.write_text(JAX_TEAM)
    mod = _load(path, "jax")
    x = np.asarray(mod.x, np.float64)
    want = {}
    import jax

    fwd, _ = mod.closure_probe()
    params = mod.Mlp().init(jax.random.key(0), mod.x)["params"]
    k = {n: {m: np.asarray(a, np.float64) for m, a in v.items()} for n, v in params.items()}
    r = np.tanh(x @ k["inner"]["kernel"] + k["inner"]["bias"]) @ k["outer"]["kernel"]
    want["closure"] = _float_verdict(fwd(mod.x), r + k["outer"]["bias"])

    def gelu_tanh(h):
        return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))

    l1, l2 = mod.net.l1, mod.net.l2
    h = x @ np.asarray(l1.kernel[...], np.float64) + np.asarray(l1.bias[...], np.float64)
    r = gelu_tanh(h) @ np.asarray(l2.kernel[...], np.float64) + np.asarray(l2.bias[...], np.float64)
    want["nnx"] = _float_verdict(mod.nnx_forward(mod.x), r)
    w64 = np.asarray(mod.w["w"], np.float64)
    g = 2.0 * x.T @ (x @ w64) / (x.shape[0] * w64.shape[1])
    loss64, new64 = np.mean((x @ w64) ** 2), w64 - 1e-2 * g / (np.abs(g) + 1e-8)
    loss, new = mod.train_step()  # the first step, as every worker's first call takes it
    want["train"] = max(_float_verdict(loss, loss64), _float_verdict(new, new64))
    suite = _suite(tmp_path, [("closure", "jteam.py:closure_probe"),
                              ("nnx", "jteam.py:nnx_probe"), ("train", "jteam.py:train_step")])
    proc = run_diag("run", "--suite", str(suite), "-b", "jax-cpu", "--no-report", "--json",
                    cwd=tmp_path)
    records = _records(proc)
    assert {n: records[n]["status"] for n in want} == want
    lifted = {n: records[n]["metrics"].get("reference_lifted") for n in want}
    assert lifted == {
        "closure": ["closure params (dict, 4 arrays)"],
        "nnx": ["global net (Net, 4 arrays)"],
        "train": ["global state (tuple, 2 arrays)", "global w (dict, 1 array)", "global x (array)"],
    }
    assert {records[n]["metrics"]["reference_kind"] for n in want} == {"float64"}


LLAMA = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

PATCHED = True


@torch.no_grad()
def _rotary_forward(self, x, position_ids):
    # positions in the activations' dtype, as teams patched it before transformers computed
    # the rotary embedding in float32
    freqs = position_ids.to(x.dtype)[:, :, None] * self.inv_freq.to(x.dtype)[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # marker: rotary
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


if PATCHED:
    modeling_llama.LlamaRotaryEmbedding.forward = _rotary_forward

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     initializer_range=0.3)
model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
ids = torch.randint(0, 64, (1, 8))
positions = torch.arange(2000, 2008)[None]


def logits(ids, positions):
    return model(input_ids=ids, position_ids=positions).logits


def probe():
    return logits, (ids, positions)
'''


def _llama_expected(mod) -> tuple[str, float]:
    """The verdict and error of the bf16 logits against the intended model in float64: the
    same weights, rotary angles from exact positions and the model's own inverse frequencies."""
    rotary = mod.modeling_llama.LlamaRotaryEmbedding
    got = mod.logits(mod.ids, mod.positions).detach().float()

    def exact(self, x, position_ids):
        freqs = position_ids.double()[:, :, None] * self.inv_freq.double()[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    patched, rotary.forward = rotary.forward, exact
    try:
        want = copy.deepcopy(mod.model).double()(input_ids=mod.ids, position_ids=mod.positions)
    finally:
        rotary.forward = patched
    err = _err(got, want.logits.detach())
    return ("pass" if err <= SQRT_U["bfloat16"] else "fail"), err


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False])
def test_llama_with_rotary_positions_in_bf16_is_judged_against_the_intended_model(
    tmp_path, patched
):
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    path = tmp_path / "llama_rope.py"
    path.write_text(LLAMA.replace("PATCHED = True", f"PATCHED = {patched}"))
    own = modeling_llama.LlamaRotaryEmbedding.forward
    try:
        want, err = _llama_expected(_load(path, f"llama{patched}"))
    finally:  # transformers' own class, as this process had it
        modeling_llama.LlamaRotaryEmbedding.forward = own
    proc = run_diag("run", f"{path}:probe", "-b", "torch-cpu", "--no-report", "--json",
                    env={"HF_HUB_OFFLINE": "1"})
    (rec,) = _records(proc).values()
    assert rec["status"] == want, (rec["reason"], err)
    assert want == ("fail" if patched else "pass")  # bf16 positions ~2000 move the angles
    if patched:
        line = marked_line(path, "marker: rotary") + 1
        assert f"first divergent op: aten.cos at llama_rope.py:{line} (_rotary_forward)" in (
            rec["reason"]
        )
