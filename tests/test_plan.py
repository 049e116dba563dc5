"""The plan as a value (`diag.plan.plan.Plan`): each (case, backend) pair asked once, and the
runner's cases, the progress count and the pairs owed read from it."""

from __future__ import annotations

import dataclasses

import pytest

import diag.plan.plan as plan_module
from diag.backends import get_spec
from diag.errors import UsageError
from diag.plan.plan import Plan
from diag.plan.suite import load_suite


def _runs_on(backend: str, params: dict) -> bool:
    """Written from the frameworks' documentation, not from diag: torch sets matmul precision
    only globally (torch.set_float32_matmul_precision), so a per-op `argument` case is
    JAX-only; JAX's per-op `precision=` argument has DEFAULT/HIGH/HIGHEST, no 'medium'."""
    via, prec = params.get("precision_via"), params.get("precision")
    if backend == "torch-cpu":
        return via != "argument"
    return not (via == "argument" and prec == "medium")


def test_plan_asks_each_pair_once_and_reads_it_after(monkeypatch):
    suite = load_suite("matmul")
    specs = [get_spec("jax-cpu"), get_spec("torch-cpu")]
    calls = []
    real = plan_module.not_applicable
    monkeypatch.setattr(plan_module, "not_applicable", lambda *a: calls.append(a) or real(*a))
    plan = Plan.of(suite, specs)
    assert len(calls) == len(suite.cases) * len(specs)

    expected = {s.name: [c for c in suite.cases if _runs_on(s.name, c.params)] for s in specs}
    both = [c for c in suite.cases if all(_runs_on(s.name, c.params) for s in specs)]
    assert [plan.cases(s) for s in specs] == [expected[s.name] for s in specs]
    assert plan.records() == sum(map(len, expected.values())) + len(both)
    assert plan.pairs(both[0]) == [("agreement", "jax-cpu", "torch-cpu")]
    argument = next(c for c in suite.cases if c.params.get("precision_via") == "argument")
    assert plan.pairs(argument) == []
    assert plan.why_not[argument.id, "torch-cpu"]  # a reason a person reads
    plan.check()
    assert len(calls) == len(suite.cases) * len(specs)  # nothing asked again


def test_b_sides_run_what_their_a_side_runs():
    suite = load_suite("matmul")
    jax, torch = get_spec("jax-cpu"), get_spec("torch-cpu")
    plan = Plan.of(suite, [jax, torch])
    b = dataclasses.replace(jax, variant="B")
    ab = plan.with_specs([jax, b])
    assert ab.cases(b) == ab.cases(jax)
    case = ab.cases(jax)[0]
    assert ab.pairs(case) == [("ab", "jax-cpu", b.label)]
    assert ab.records() == 3 * len(ab.cases(jax))


def test_a_plan_with_nothing_to_run_is_refused_naming_why():
    suite = load_suite("matmul")
    only_argument = dataclasses.replace(
        suite,
        cases=tuple(c for c in suite.cases if c.params.get("precision_via") == "argument"),
    )
    plan = Plan.of(only_argument, [get_spec("torch-cpu")])
    assert plan.backends_run() == [] and plan.cases_run() == []
    with pytest.raises(UsageError, match="torch-cpu: .*precision only via config"):
        plan.check()
