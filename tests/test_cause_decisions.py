"""A flipped decision's cause through the real `diag diverge`, JAX and PyTorch: a greedy sampler
whose logits are accumulated in bfloat16 takes some argmax the other way than float64; the cause search holds
the sampled token ids to the float64 reference's and names the accumulation line, proven by a
re-run in which every token equals float64's.

The expected flip and the line are decided here with float64 numpy: the bf16 sampler's tokens
differ from the float64 argmax, the same dot product accumulated in float32 gives every float64
token (so promoting the accumulation line repairs it), and the line is the one marked
``# planted``.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from tests.conftest import marked_line, run_diag

JAX_SAMPLER = textwrap.dedent(
    """
    import jax.numpy as jnp
    import numpy as np


    def sample(h, w):
        logits = jnp.zeros((h.shape[0], w.shape[1]), jnp.bfloat16)
        for i in range(h.shape[1]):
            logits = logits + h[:, i : i + 1] * w[i]  # planted
        return jnp.argmax(logits, -1)  # decision


    def inputs():
        r = np.random.default_rng(0)
        h = jnp.asarray(r.normal(size=(64, 48)), jnp.bfloat16)
        w = jnp.asarray(r.normal(size=(48, 500)) * 0.5, jnp.bfloat16)
        return h, w


    def planted():
        return sample, inputs()
    """
)

TORCH_SAMPLER = textwrap.dedent(
    """
    import torch


    def sample(h, w):
        logits = torch.zeros(h.shape[0], w.shape[1], dtype=torch.bfloat16)
        for i in range(h.shape[1]):
            logits = logits + h[:, i : i + 1] * w[i]  # planted
        return torch.argmax(logits, -1)  # decision


    def inputs():
        g = torch.Generator().manual_seed(0)
        h = torch.randn(64, 48, generator=g).to(torch.bfloat16)
        w = (torch.randn(48, 500, generator=g) * 0.5).to(torch.bfloat16)
        return h, w


    def planted():
        return sample, inputs()
    """
)

# framework: (source, the op names the accumulation line writes)
SAMPLERS = {
    "jax": (JAX_SAMPLER, ("mul", "add")),
    "torch": (TORCH_SAMPLER, ("aten.mul", "aten.add")),
}


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().float().numpy()
    return np.asarray(x)


@pytest.fixture(scope="module", params=sorted(SAMPLERS))
def sampler(request, tmp_path_factory):
    pytest.importorskip(request.param)
    source, ops = SAMPLERS[request.param]
    path = tmp_path_factory.mktemp(f"decide_{request.param}") / "sampler.py"
    path.write_text(source)
    namespace: dict = {}
    exec(compile(source, str(path), "exec"), namespace)
    h, w = namespace["inputs"]()
    h64, w64 = _np(h).astype(np.float64), _np(w).astype(np.float64)
    want = np.argmax(h64 @ w64, -1)
    got = np.asarray(_np(namespace["sample"](h, w)))
    flipped = got != want
    assert flipped.any()  # the bf16 accumulation moves some tokens
    f32 = np.argmax(_np(h).astype(np.float32) @ _np(w).astype(np.float32), -1)
    assert (f32 == want).all()  # accumulated in float32 every token is float64's
    return path, flipped.mean(), ops


def test_diag_diverge_names_the_line_whose_rounding_flipped_the_argmax(sampler):
    path, share, ops = sampler
    line = marked_line(path, "planted")
    decision = marked_line(path, "decision")
    r = run_diag("diverge", f"{path}:planted", "--json", env={"COLUMNS": "400"})
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    cause = doc["cause"]
    assert cause["cause"] == f"sampler.py:{line} (sample)"
    op, _, where = cause["cause_ops"][0].partition(" at ")
    assert op in ops and where == f"sampler.py:{line} (sample)"  # the line's ops
    assert cause["cause_confirmed"] is True and 1 <= cause["cause_reruns"] <= 10
    # the share of tokens that differ from float64's: no more than the flips counted here
    # (one rounding of the inputs may already move some), none after the repair
    assert 0 < cause["error_before"] <= share and cause["error_after"] == 0
    assert cause["time_before_s"] > 0 and cause["repair_time_s"] > 0
    made = [d for d in doc["report"]["decisions"] if d["verdict"] == "fail"]
    assert made and made[0]["primitive"] == f"{ops[0].rpartition('.')[0]}.argmax".lstrip(".")
    assert made[0]["source"] == f"sampler.py:{decision} (sample)"
    for d in made:  # each made decision carries the cause; its own `cause` says made/forced
        assert d["cause"] == "made by the computation"
        assert d["cause_line"] == cause["cause"] and d["cause_ops"] == cause["cause_ops"]
        assert d["error_before"] == cause["error_before"] and d["error_after"] == 0
        assert "measured: error" in d["repair"]

    text = run_diag("diverge", f"{path}:planted", env={"COLUMNS": "400"})
    assert text.returncode == 1
    assert (
        f"diag diverge: the flipped {made[0]['primitive']} at sampler.py:{decision} (sample): "
        f"cause: {op} at sampler.py:{line} (sample)"
    ) in text.stdout
    assert "values that differ from the reference goes from" in text.stdout
