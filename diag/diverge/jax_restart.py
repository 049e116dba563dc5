"""The JAX cause search's re-runs start downstream of the promoted ops, from kept values.

A candidate op computed in a wider dtype changes nothing before it: every equation before the
first one that holds a promoted op computes what it computed in the run as written, bit for
bit (the same ops on the same values). So the run as written (the search's baseline) keeps the
value of every variable of the jaxpr, and a promoted run starts at that first equation with
the kept values of the variables it reads: the rest of the jaxpr is evaluated as a jaxpr of
its own (its equations from there on, the live variables as its inputs), which is what
`Evaluator.eval` runs anyway. The same holds inside a call that runs its body once (a
``jit``, a custom derivative's primal, a remat): when the first promoted op is inside one, the
re-run enters it and starts again at the first equation there that holds one. A loop body
(scan, while) and a cond branch run many times or by value: a re-run runs them whole.

Which equation holds a promoted op is known from the baseline: it notes each op it runs once
(an op of a loop body once for all iterations) with where it sits on that path, and a re-run
finds the first op of each promoted site (its primitive, lines and phase, as the re-runner
names it). A site the baseline never ran (a branch it did not take) changes nothing before the
others' first ops. A body that the baseline evaluated more than once (the same jitted function
called twice) is not entered.

PyTorch has no such restart: an eager function is Python, and the state a line leaves
(the stack's locals, the modules' buffers, the generator) cannot be rebuilt mid-function; its
re-runs run the whole function.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from diag.interp.jax_source import Literal

#: Call-like primitives whose body runs once per equation: a re-run may start inside one.
CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}


def _body(e) -> Any:
    """The jaxpr a call-like equation runs once (None for any other equation)."""
    param = CALLS.get(e.primitive.name)
    sub = e.params.get(param) if param else None
    return getattr(sub, "jaxpr", sub)


def _is_var(v) -> bool:
    return not isinstance(v, Literal) and type(v).__name__ != "DropVar"


class Kept:
    """What the baseline run left for the re-runs: per jaxpr on the once-run path (the top
    jaxpr, the bodies of call-like equations on it), the value of each variable; each op it
    ran (a loop body's once) with the equations holding it on that path; and when the
    baseline first reached each of those equations."""

    def __init__(self) -> None:
        self.top: int | None = None
        self.jaxprs: dict[int, Any] = {}  # id -> jaxpr (kept alive: ids stay unique)
        self.runs: dict[int, int] = {}  # id -> how many times the baseline evaluated it
        self.values: dict[int, dict] = {}  # id -> {var: the baseline's Value}
        self.where: dict[int, tuple[int, int]] = {}  # id(equation) -> (id(jaxpr), index)
        # primitive -> the ops the baseline ran, in order: (equation, the equations it is in,
        # backward, {id(jaxpr): index} of the equation holding it at each level of the path)
        self.ops: dict[str, list[tuple[Any, tuple, bool, dict[int, int]]]] = {}
        self._noted: set[tuple] = set()
        self.reached: dict[tuple[int, int], float] = {}  # (id(jaxpr), index) -> seconds
        self.start = 0.0
        self._derived: dict[tuple[int, int], tuple[Any, list]] = {}

    # -- the baseline run -------------------------------------------------------------------
    def on_path(self, jaxpr, outer: list) -> bool:
        """Whether `jaxpr` is evaluated on the once-run path (the top one, or the body of a
        call-like equation of a jaxpr on it)."""
        if not outer:
            return self.top is None or self.top == id(jaxpr)
        parent = outer[-1]
        return parent.primitive.name in CALLS and id(parent) in self.where

    def record(self, run_eval, jaxpr, consts, args, *rest) -> list:
        """Evaluate `jaxpr` (on the path) as the baseline does, keeping its variables."""
        key = id(jaxpr)
        if self.top is None:
            self.top, self.start = key, time.perf_counter()
        self.jaxprs[key] = jaxpr
        self.runs[key] = self.runs.get(key, 0) + 1
        for k, e in enumerate(jaxpr.eqns):
            self.where[id(e)] = (key, k)
        wide, names = self._derive(jaxpr, -1)
        out_bwd, more = rest[1], rest[2:]
        # the kept variables count as used only for a gradient: the phases stay as they were
        got = run_eval(wide, consts, args, rest[0], out_bwd + (True,) * len(names), *more)
        n = len(jaxpr.outvars)
        self.values[key] = dict(zip(names, got[n:]))
        return got[:n]

    def note(self, e, outer: list, backward: bool) -> None:
        """The baseline is about to run first-order equation `e` under `outer`."""
        now = time.perf_counter() - self.start
        path: dict[int, int] = {}
        for x in (*outer, e):
            at = self.where.get(id(x))
            if at is None:
                break
            path[at[0]] = at[1]
            self.reached.setdefault(at, now)
        memo = (id(e), *map(id, outer), backward)
        if memo not in self._noted:
            self._noted.add(memo)
            self.ops.setdefault(e.primitive.name, []).append((e, tuple(outer), backward, path))

    # -- the re-runs ------------------------------------------------------------------------
    def plan(self, sites: frozenset, site_of: Callable) -> tuple[dict[int, int], float]:
        """Where a re-run promoting `sites` starts, per jaxpr on the path ({} when it runs
        whole), and the baseline's seconds up to there.

        Args:
            sites: the promoted sites' keys (their primitive first).
            site_of: (equation, the equations it is in, backward) -> its site key.
        """
        firsts = []
        for site in sites:
            for e, outer, backward, path in self.ops.get(site[0], ()):
                if site_of(e, outer, backward) == site:
                    firsts.append(path)
                    break
        starts: dict[int, int] = {}
        key, at = self.top, None
        while key is not None and self.runs.get(key) == 1:
            found = [path[key] for path in firsts if key in path]
            if not found:
                break
            starts[key] = k = min(found)
            at = (key, k)
            sub = _body(self.jaxprs[key].eqns[k])
            key = id(sub) if sub is not None and id(sub) in self.values else None
        if at is None or not any(starts.values()):
            return {}, 0.0  # it starts at the first equation: a whole run
        return starts, self.reached.get(at, 0.0)

    def resume(self, run_eval, jaxpr, start: int, consts, args, *rest) -> list:
        """Evaluate `jaxpr` from equation `start` on, from the baseline's kept values."""
        del args  # the same as the baseline's: nothing before was promoted
        tail, live = self._derive(jaxpr, start)
        kept = self.values[id(jaxpr)]
        return run_eval(tail, consts, [kept[v] for v in live], *rest)

    def _derive(self, jaxpr, start: int) -> tuple[Any, list]:
        """start -1: the jaxpr returning every variable besides its outputs, and those
        variables; else: its equations from `start` on, as a jaxpr of the variables live
        there (their inputs), and those variables."""
        got = self._derived.get((id(jaxpr), start))
        if got is not None:
            return got
        if start < 0:
            names = [v for v in jaxpr.invars if _is_var(v)]
            names += [v for e in jaxpr.eqns for v in e.outvars if _is_var(v)]
            got = (jaxpr.replace(outvars=[*jaxpr.outvars, *names]), names)
        else:
            before = {v for v in jaxpr.invars if _is_var(v)}
            before |= {v for e in jaxpr.eqns[:start] for v in e.outvars if _is_var(v)}
            used = [v for e in jaxpr.eqns[start:] for v in e.invars if _is_var(v)]
            used += [v for v in jaxpr.outvars if _is_var(v)]
            live = list(dict.fromkeys(v for v in used if v in before))
            got = (jaxpr.replace(eqns=jaxpr.eqns[start:], invars=live), live)
        self._derived[(id(jaxpr), start)] = got
        return got
