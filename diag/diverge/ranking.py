"""The cause search's candidates: which ops to promote first, from what the shadow measured.

A failing output was computed from a few hundred ops; at most `cause.MAX_RERUNS` re-runs may
be spent. The shadow already knows, per op, its own rounding, the error it carried in and out
and which ops made its inputs (the ledger's producers), so the search walks back from the
outputs and ranks every op on the way: an Inf or NaN born there, a cast to a narrower dtype
that lost precision, a literal the tracer rounded, a value that crossed its threshold there,
an accumulation in bfloat16/float16 or a loop carry whose error grew, an op past its own
bound, and above all its own rounding times what the ops after it made of it (the `mul` of a
rotary angle is exact to half an ULP; the cosine after it turns that into a wrong value). A
score only orders the re-runs: nothing is claimed until a re-run confirms it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from diag import numerics
from diag.diverge.cause import SINGLES, Site

_NARROW = ("bfloat16", "float16")
_WIDENS = ("bfloat16", "float16", "float32")


def candidates(
    entries: Sequence[Any],
    starts: Sequence[int],
    allowance: float,
    limit: int = 2 * SINGLES,
) -> tuple[list[Site], dict[tuple, set[str]]]:
    """The sites to try, most likely first, and the primitives that read each.

    Walks back from the ledger entries `starts` (what the outputs were computed from) along
    each entry's producers; scores every op on the way by what the shadow measured
    (`_score`); a site's score is its best op's.

    Args:
        entries: the shadow's ledger entries (execution order).
        starts: the entries the function's outputs were computed from.
        allowance: the smallest failing output's allowance.
        limit: how many sites to return.
    """
    depth: dict[int, int] = {}
    frontier = [i for i in starts if 0 <= i < len(entries)]
    for i in frontier:
        depth[i] = 0
    consumers: dict[int, list[int]] = {}
    while frontier:
        nxt = []
        for i in frontier:
            for p in entries[i].producers:
                consumers.setdefault(p, []).append(i)
                if p not in depth:
                    depth[p] = depth[i] + 1
                    nxt.append(p)
        frontier = nxt
    # A cast to a narrower dtype, a rounded literal, an Inf born: candidates even where the
    # dataflow does not reach them (a module's parameters cast in place by `model.to`, whose
    # new data the shadow cannot tie to the parameter object). The re-run decides.
    for i, e in enumerate(entries):
        if i not in depth and (e.tags & {"narrowing", "literal"} or _born(e)):
            depth[i] = len(entries)
    best: dict[tuple, tuple[float, Site]] = {}
    readers: dict[tuple, set[str]] = {}
    cache: dict[int, tuple[str, str]] = {}
    memo: dict = {}
    for i, d in depth.items():
        e = entries[i]
        if e.cls == "structural" or e.dtype not in _WIDENS:
            continue
        amp = _downstream(i, entries, consumers, memo=memo)
        score = _score(e, amp, allowance) - 0.01 * d
        if i not in cache:
            cache[i] = e.where()
        source, library = cache[i]
        tags = e.tags | ({"birth"} if _born(e) else set())
        site = Site(e.primitive, source, library, e.phase, e.dtype, frozenset(tags), e.path)
        near = consumers.get(i, [])
        near = near + [g for c in near for g in consumers.get(c, ())]
        readers.setdefault(site.key, set()).update(entries[c].primitive for c in near)
        if site.key not in best or score > best[site.key][0]:
            best[site.key] = (score, site)
    ranked = sorted(best.values(), key=lambda t: -t[0])
    return [s for _, s in ranked[:limit]], readers


def _score(e: Any, amp: float, allowance: float) -> float:
    """How likely the op is the cause, from the shadow's figures (higher: try it sooner).

    `amp` is how much the ops that read its output grew the error they were given (looking
    through ops that only move values): the op's own rounding times it is what its rounding
    became downstream, measured against what the failing output may carry."""
    score = 0.0
    if _born(e):
        score += 100.0  # an Inf/NaN born here
    if "literal" in e.tags:
        score += 60.0
    u = numerics.unit_roundoff(e.dtype)
    grew = e.carried > 4.0 * max(e.carried_in, u)
    if "narrowing" in e.tags and e.carried_in < u:
        score += 30.0  # the value was more precise than the dtype it is cast to
    if e.carried > e.threshold >= e.carried_in or e.carried > allowance >= e.carried_in:
        score += 40.0  # the value left its threshold here
    if e.cls == "reduction" and e.dtype in _NARROW and grew:
        score += 30.0  # an accumulation that lost what it added
    if ("scan[" in e.path or "while[" in e.path) and grew:
        score += 20.0
    if e.own_ratio == e.own_ratio and e.own_ratio > 1.0:
        score += 20.0
    own = (e.own_ulps if e.own_ulps == e.own_ulps else 0.0) * u
    grown = own * amp
    if math.isinf(grown):
        score += 60.0
    elif grown > 0:
        score += 10.0 * max(0.0, min(10.0, math.log10(grown / allowance) + 4.0))
    return score


def _downstream(
    i: int, entries: Sequence[Any], consumers: dict, hops: int = 3, memo: dict | None = None
) -> float:
    """How much the ops after entry `i` grow an error in its output: the largest product of
    amplifications along a path of up to `hops` ops that compute (ops that only move values
    pass it on). A sigmoid read by ``1 - s`` (x9, normwise) and then by a log (an Inf born:
    infinite) is a path worth trying, though no single step past the sigmoid shows it."""
    memo = {} if memo is None else memo
    got = memo.get((i, hops))
    if got is not None:
        return got
    best = 1.0
    for c in consumers.get(i, ()):
        e = entries[c]
        if e.cls == "structural":
            best = max(best, _downstream(c, entries, consumers, hops, memo))
        elif hops > 0:
            step = max(1.0, _amp(e))
            rest = _downstream(c, entries, consumers, hops - 1, memo) if hops > 1 else 1.0
            best = max(best, step * rest)
    memo[(i, hops)] = best
    return best


def _born(e: Any) -> bool:
    return math.isinf(e.carried) and math.isfinite(e.carried_in)


def _amp(e: Any) -> float:
    u = numerics.unit_roundoff(e.dtype)
    if e.carried == 0.0:
        return 0.0
    if math.isinf(e.carried):
        return math.inf if math.isfinite(e.carried_in) else 1.0
    return e.carried / max(e.carried_in, u)
