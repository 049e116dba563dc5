"""`diag.nan.locate` on JAX names the op that gave birth to a NaN/Inf, its line and its phase.

Each case plants a known numerical trap; the report must name the primitive that springs it,
the line of this file that wrote it (found by its marker comment, never a hard-coded number),
whether it ran forward or backward, and where it sits (jit, scan iteration, custom_jvp).
Clean functions, including one whose NaN is masked by `where`, must give None.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import marked_line, needs_jax

pytestmark = needs_jax

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from diag import nan  # noqa: E402

HERE = Path(__file__)
ROOT = HERE.parent.parent


def line_of(marker: str, path: Path = HERE) -> int:
    return marked_line(path, marker)


def src(marker: str, function: str) -> str:
    return f"{HERE.name}:{line_of(marker)} ({function})"


def log_loss(x):
    return jnp.sum(jnp.log(x))  # L-log


def ratio(x, y):
    return x / y  # L-div


def masked_softmax(scores, mask):
    return jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)  # L-softmax


def decay(c, x):
    c = c - x
    return c, jnp.log(c)  # L-scan


def run_decay(xs):
    return jax.lax.scan(decay, 3.0, xs)


def norm(x):
    return jnp.sqrt(jnp.sum(x * x))  # L-norm


@jax.custom_jvp
def safe_log(x):
    return jnp.log(x)  # L-cjvp


@safe_log.defjvp
def _safe_log_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return safe_log(x), t / x  # L-cjvp-rule


def test_log_of_a_negative_is_found_forward_with_its_input():
    rep = nan.locate(log_loss, jnp.array([1.0, -2.0, 3.0]))
    assert (rep.primitive, rep.kind, rep.phase, rep.path) == ("log", "NaN", "forward", "")
    assert rep.source == src("L-log", "log_loss")
    assert rep.line == line_of("L-log") and rep.file == str(HERE)
    assert rep.inputs[0].min == -2.0 and rep.inputs[0].negatives == 1
    assert rep.bad_index == (1,) and rep.inputs_at_index == (-2.0,)


def test_zero_over_zero_inside_jit_names_the_jit():
    rep = nan.locate(jax.jit(ratio), jnp.array([1.0, 0.0]), jnp.array([2.0, 0.0]))
    assert (rep.primitive, rep.kind, rep.phase) == ("div", "NaN", "forward")
    assert rep.source == src("L-div", "ratio")
    assert rep.path == "jit[ratio]"
    assert rep.inputs_at_index == (0.0, 0.0)
    assert [s.zeros for s in rep.inputs] == [1, 1]


def test_fully_masked_softmax_row_is_inf_minus_inf():
    mask = jnp.array([[True, False, True], [False, False, False]])
    rep = nan.locate(jax.jit(masked_softmax), jnp.ones((2, 3)), mask)
    # The -inf fill is a constant the user chose; the NaN is born where -inf - (-inf).
    assert (rep.primitive, rep.kind, rep.phase) == ("sub", "NaN", "forward")
    assert rep.source == src("L-softmax", "masked_softmax")
    assert rep.bad_index[0] == 1
    assert rep.inputs[0].infs == 4


def test_nan_born_in_a_scan_reports_the_iteration():
    rep = nan.locate(jax.jit(run_decay), jnp.ones(6))
    # c goes 2, 1, 0, -1: log(0) = -inf at iteration 2 comes first.
    assert (rep.primitive, rep.kind, rep.phase) == ("log", "Inf", "forward")
    assert rep.path == "jit[run_decay]/scan[2]"
    assert rep.source == src("L-scan", "decay")
    assert rep.inputs[0].zeros == 1


def test_reverse_scan_reports_the_index_into_xs():
    rep = nan.locate(lambda xs: jax.lax.scan(decay, 3.0, xs, reverse=True),
                     jnp.array([5.0, 1.0, 1.0, 1.0]))
    # Reversed, iteration 3 runs first (c = 2), then 2 (c = 1), 1 (c = 0: log 0).
    assert rep.path == "scan[1]" and rep.primitive == "log"


def test_gradient_of_a_norm_at_zero_is_born_backward_at_the_forward_line():
    step = jax.jit(jax.value_and_grad(norm))
    value, grad = step(jnp.zeros(3))
    assert value == 0.0 and bool(jnp.isnan(grad).all())  # the trap is real: forward clean
    rep = nan.locate(step, jnp.zeros(3))
    # d sqrt(s) = 0.5 / sqrt(s) = 0.5 / 0: an Inf from finite inputs, then inf * 0 = NaN.
    assert (rep.primitive, rep.kind, rep.phase) == ("div", "Inf", "backward")
    assert rep.source == src("L-norm", "norm")
    assert rep.inputs_at_index == (0.5, 0.0)
    assert rep.births >= 2  # the Inf, then each inf * 0 = NaN in the transposed products


def test_forward_op_of_a_gradient_step_stays_forward():
    rep = nan.locate(jax.value_and_grad(log_loss), jnp.array([1.0, -2.0]))
    assert (rep.primitive, rep.phase) == ("log", "forward")


def test_nan_inside_custom_jvp_primal_names_the_custom_jvp():
    rep = nan.locate(jax.jit(lambda x: 2.0 * safe_log(x)), jnp.array([-1.0]))
    assert (rep.primitive, rep.kind, rep.phase) == ("log", "NaN", "forward")
    assert rep.path == "jit[<lambda>]/custom_jvp"
    assert rep.source == src("L-cjvp", "safe_log")


def test_custom_jvp_rule_dividing_by_zero_is_backward_at_the_rule_line():
    rep = nan.locate(jax.grad(lambda x: jnp.sum(safe_log(x))), jnp.array([0.0, 1.0]))
    assert (rep.primitive, rep.kind, rep.phase) == ("div", "Inf", "backward")
    assert rep.source == src("L-cjvp-rule", "_safe_log_jvp")


def test_custom_vjp_and_remat_and_cond_and_while_are_descended():
    @jax.custom_vjp
    def f(x):
        return jnp.log(x)  # L-cvjp

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g / x,))

    def g(x):
        y = jax.checkpoint(lambda v: jnp.sin(v))(x)
        y = jax.lax.cond(x[0] > 0, lambda v: v + 1.0, lambda v: v - 1.0, y)
        _, y = jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] * 0.5), (0, y))
        return f(y - 10.0)

    rep = nan.locate(jax.jit(g), jnp.ones(2))
    assert rep.primitive == "log" and rep.path == "jit[g]/custom_vjp"
    assert rep.source.endswith(f":{line_of('L-cvjp')} (f)")


def test_shard_map_is_run_whole_and_named_with_its_body_line():
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(jax.devices()[:1], ("i",))
    body = lambda x: jnp.log(x)  # L-shard  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    rep = nan.locate(f, jnp.array([-1.0, 2.0]))
    assert (rep.primitive, rep.phase, rep.path) == ("shard_map", "forward", "jit[<lambda>]")
    assert rep.line == line_of("L-shard  # noqa: E731")


def test_import_diag_nan_loads_no_framework():
    code = ("import sys, diag, diag.nan; diag.nan.reason(None); "
            "assert 'jax' not in sys.modules and 'torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_clean_function_gives_none():
    assert nan.locate(jax.jit(log_loss), jnp.array([1.0, 2.0])) is None
    assert nan.reason(None) == "no NaN/Inf produced"


def test_nan_masked_by_where_is_not_reported():
    # log(-1) is NaN, but where() discards it and the gradient is finite too.
    fn = jax.value_and_grad(lambda x: jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0)))
    assert nan.locate(fn, jnp.array([-1.0, 2.0])) is None


def test_nan_passed_in_is_reported_as_input():
    rep = nan.locate(lambda d: d["w"] * 2.0, {"w": jnp.array([1.0, jnp.nan])})
    assert (rep.primitive, rep.phase, rep.path) == ("input", "input", "args[0]['w']")
    assert "args[0]['w']" in nan.reason(rep)


def test_static_arguments_are_closed_over():
    rep = nan.locate(lambda x, name, k: jnp.log(x - k), jnp.array([1.0]), "label", 3)
    assert rep.primitive == "log" and rep.inputs[0].min == -2.0


def test_reason_is_one_line_for_a_record():
    rep = nan.locate(jax.jit(ratio), jnp.zeros(2), jnp.zeros(2))
    line = nan.reason(rep)
    assert "\n" not in line
    assert line.startswith(f"NaN born in div at {src('L-div', 'ratio')} [jit[ratio]], forward")


def test_report_round_trips_through_json():
    rep = nan.locate(log_loss, jnp.array([-1.0]))
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["primitive"] == "log" and d["inputs"][0]["negatives"] == 1


def test_a_function_that_raises_is_a_hunt_error():
    def boom(x):
        raise ValueError("no good")

    with pytest.raises(nan.NanHuntError, match=r"^diag: boom raised ValueError: no good$"):
        nan.locate(boom, jnp.ones(1))


# --- the command line -----------------------------------------------------------------------

TARGETS = '''
import jax.numpy as jnp


def bad():
    x = jnp.array([1.0, -1.0])
    return lambda v: jnp.sum(jnp.log(v)), (x,)


def clean():
    return jnp.sum(jnp.ones(3))


def raises():
    raise RuntimeError("broken fixture")
'''


def diag_nan(*args: str):
    return subprocess.run([sys.executable, "-m", "diag.cli", "nan", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    path = tmp_path_factory.mktemp("nan") / "targets.py"
    path.write_text(TARGETS)
    return path


def test_cli_found_exits_1_with_json_report(targets):
    out = diag_nan(f"{targets}:bad", "--json")
    assert out.returncode == 1, out.stderr
    d = json.loads(out.stdout)
    assert d["found"] is True
    assert (d["report"]["primitive"], d["report"]["phase"]) == ("log", "forward")
    line = TARGETS.splitlines().index("    return lambda v: jnp.sum(jnp.log(v)), (x,)") + 1
    assert d["report"]["source"] == f"targets.py:{line} (<lambda>)"


def test_cli_prints_the_report_and_clean_exits_0(targets):
    out = diag_nan(f"{targets}:bad")
    assert out.returncode == 1
    line = TARGETS.splitlines().index("    return lambda v: jnp.sum(jnp.log(v)), (x,)") + 1
    assert "log" in out.stdout and f"targets.py:{line}" in out.stdout
    assert "forward" in out.stdout
    out = diag_nan(f"{targets}:clean")
    assert out.returncode == 0 and "no NaN/Inf produced" in out.stdout


@pytest.mark.parametrize("spec,message", [
    ("{d}/missing.py:f", "diag: {d}/missing.py: no such file"),
    ("{t}:nope", "diag: {t}: no function 'nope'"),
    ("{t}", "diag: expected FILE.py:FUNCTION or package.module:function, got '{t}'"),
    ("{t}:raises", "diag: raises raised RuntimeError: broken fixture"),
])
def test_cli_bad_input_exits_2_with_one_line(targets, spec, message):
    fill = {"d": targets.parent, "t": targets}
    out = diag_nan(spec.format(**fill))
    assert out.returncode == 2
    assert out.stderr.strip() == message.format(**fill)


def test_example_hunts_the_nan_in_a_training_step():
    example = ROOT / "examples" / "nan_train_step.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    line = line_of("no epsilon: a constant row is 0 / 0", example)
    lines = out.stdout.splitlines()
    assert lines[0] == "loss after one step: nan"
    assert lines[1].startswith(f"report: NaN born in div at nan_train_step.py:{line} (normalise) "
                               f"[jit[train_step]/scan[3]], forward;")
    assert lines[2] == "clean inputs: no NaN/Inf produced"


def test_a_callers_result_is_the_screen():
    """`diag run`'s worker hands the hunt the result it judged: a finite one ends the hunt
    without calling the function, a non-finite one is hunted without a second eager run."""
    import numpy as np

    calls = []

    def f(x):
        calls.append(1)
        return {"y": jnp.log(x)}

    x = jnp.array([1.0, -1.0, 2.0])
    assert nan.hunt(f, (x,), result={"y": jnp.array([0.0, 1.0, 2.0])}) is None
    assert not calls  # a finite result: the function is neither called nor traced
    bad = {"y": jnp.log(x)}
    got = nan.hunt(f, (x,), result=bad)
    # Independently: log(-1) is NaN in float64 numpy.
    assert np.isnan(np.log(np.float64(-1.0)))
    assert got is not None and got.primitive == "log" and got.kind == "NaN"
    assert nan.reason(got) == nan.reason(nan.hunt(f, (x,)))
