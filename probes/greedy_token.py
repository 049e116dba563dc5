"""greedy_token: the greedy token of each row by every path a sampler may take (argmax,
argmax of the softmax, top-1, approx top-1; fused and op by op; in batches), against the exact
argmax, with rounding ties and batch dependence told apart from errors.

The truth is the correctly rounded softmax (`diag.oracle.softmax_result`, shared with the
softmax probe's cases on the same inputs): what sampling from rounded probabilities can and
cannot resolve. Tolerance: `diag.tolerance`'s greedy_token row (the exact argmax, except
where the rounded probabilities of the top two are equal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from diag import numerics
from diag.compare.outcome import Evaluation, Outcome
from diag.compare.verdict import Mismatch, Verdict, format_mismatch
from diag.plan.probe import FLOATS, LOGIT_MAKERS, Probe, rows_bytes, rows_label, rows_shapes
from diag.probes.softmax import truth
from diag.status import Status

_BATCH_LABEL = re.compile(r"^batch\d+$")

#: A sampler path whose name holds this reads the rounded probabilities (`on_jax` and
#: `on_torch` name such paths `argmax_softmax`): it is held to what correctly rounded
#: probabilities can resolve. A path-naming convention, not a reference to the softmax op.
PROBABILITY_PATH = "softmax"


def _hex(v: np.generic) -> str:
    b = int(numerics.bits_view(np.asarray(v)))
    return f"0x{b:0{2 * np.asarray(v).dtype.itemsize}x}"


def _top3(row: np.ndarray) -> list[dict]:
    r64 = row.astype(np.float64)
    r64 = np.where(np.isnan(r64), -np.inf, r64)
    top = np.argsort(-r64, kind="stable")[:3]
    return [{"index": int(i), "logit": float(r64[i]), "bits": _hex(row[i])} for i in top]


@dataclass
class _Exact:
    """The exact greedy answer of each row of `logits` (NaN rows aside), as float64."""

    xm: np.ndarray  # [rows, vocab] the logits, NaN as -inf
    mx: np.ndarray  # [rows] the maximum logit
    expected: np.ndarray  # [rows] its lowest index
    unique: np.ndarray  # [rows] the maximum occurs once
    tied: np.ndarray  # [rows] the maximum occurs more than once
    nan_row: np.ndarray  # [rows] the row holds a NaN


def _exact_greedy(logits: np.ndarray) -> _Exact:
    rows, vocab = logits.shape
    x64 = logits.astype(np.float64)
    nan_row = np.asarray(np.isnan(x64).any(axis=1))
    xm = np.where(np.isnan(x64), -np.inf, x64)
    mx = xm.max(axis=1) if vocab else np.zeros(rows)
    n_max = (xm == mx[:, None]).sum(axis=1)
    return _Exact(
        xm=xm,
        mx=mx,
        expected=xm.argmax(axis=1) if vocab else np.zeros(rows, np.int64),
        unique=(n_max == 1) & ~nan_row,
        tied=(n_max > 1) & ~nan_row,
        nan_row=nan_row,
    )


def _check_path(
    name: str,
    tok: np.ndarray,
    logits: np.ndarray,
    exact: _Exact,
    rounded_probs: np.ndarray | None,
) -> dict[str, Any]:
    """One path's metrics: its tokens `tok` [rows] against the exact greedy tokens."""
    rows, vocab = logits.shape
    inr = (tok >= 0) & (tok < vocab)
    picked = np.where(inr, exact.xm[np.arange(rows), np.where(inr, tok, 0)], np.nan)
    disagree = exact.unique & (tok != exact.expected)
    rounding_tie = np.zeros(rows, bool)
    if rounded_probs is not None and PROBABILITY_PATH in name:
        probs = np.asarray(rounded_probs).astype(np.float64)
        top = np.nanmax(np.where(np.isnan(probs), -np.inf, probs), axis=1)
        safe = np.where(inr, tok, 0)
        rounding_tie = disagree & inr & (probs[np.arange(rows), safe] == top)
        disagree &= ~rounding_tie
    wrong_tie = exact.tied & ~(picked == exact.mx)
    lowest = exact.tied & (tok == exact.expected)
    bad = np.flatnonzero(disagree | wrong_tie | rounding_tie)
    examples = [
        {
            "row": int(r),
            "expected": int(exact.expected[r]),
            "chosen": int(tok[r]),
            "tied_max": bool(exact.tied[r]),
            "rounding_tie": bool(rounding_tie[r]),
            "chosen_logit": (float(picked[r]) if inr[r] else None),
            "top3": _top3(logits[r]),
        }
        for r in bad[:10]
    ]
    return {
        "disagree": int(disagree.sum()),
        "wrong_on_tie": int(wrong_tie.sum()),
        "rounding_tie": int(rounding_tie.sum()),
        "tie_lowest_index": int(lowest.sum()),
        "examples": examples,
    }


def _batch_dependence(chosen: dict[str, np.ndarray], logits: np.ndarray) -> dict[str, Any]:
    """Per group of paths that differ only in a ``batchN`` component: the rows they split on."""
    groups: dict[str, list[str]] = {}
    for name in chosen:
        parts = name.split("/")
        if any(_BATCH_LABEL.match(p) for p in parts):
            key = "/".join(p for p in parts if not _BATCH_LABEL.match(p))
            groups.setdefault(key, []).append(name)
    batch: dict[str, Any] = {}
    for key, names in groups.items():
        if key in chosen:  # the same path on all rows at once is one more batch size
            names = [key] + names
        if len(names) < 2:
            continue
        stack = np.stack([chosen[nm] for nm in names])
        differ = np.flatnonzero((stack != stack[0]).any(axis=0))
        batch[key] = {
            "paths": names,
            "rows_differ": int(differ.size),
            "examples": [
                {
                    "row": int(r),
                    "tokens": {nm: int(chosen[nm][r]) for nm in names},
                    "top3": _top3(logits[r]),
                }
                for r in differ[:10]
            ],
        }
    return batch


def check_greedy(
    logits: np.ndarray, tokens: dict[str, np.ndarray], *, rounded_probs: np.ndarray | None = None
) -> dict[str, Any]:
    """Does every sampler path pick the token the exact math picks (the incident's check)?

    The exact greedy token of a row is the index of its maximum logit, where that maximum occurs
    once; rows whose maximum is exactly tied are excluded from agreement (counted), but a path
    that picks a non-maximal token there is still wrong. Rows holding NaN are counted apart.
    Batch dependence: paths whose names differ only in a ``batchN`` component (e.g.
    "jit/batch1/argmax" and "jit/batch64/argmax", and "jit/argmax" on all rows at once) must
    choose the same token in every row.

    A path through the probabilities (its name holds ``softmax``) is held to what the
    correctly rounded probabilities allow: where rounding to the dtype makes the top two equal
    (`rounded_probs`), no implementation can tell them apart and an argmax takes the lower
    index. Such rows are counted as ``rounding_tie`` (a hazard of sampling from rounded
    probabilities, the incident's mechanism), not as the backend's error.

    Args:
        logits: [rows, vocab] logits as the backend received them (bf16, ...).
        tokens: path name -> [rows] chosen token per row.
        rounded_probs: the correctly rounded softmax of `logits` (diag.oracle.softmax), or
            None to hold softmax paths to the exact argmax like every other path.

    Returns:
        Metrics: rows, vocab, unique_rows, tied_rows, nan_rows, paths (per path: disagree,
        wrong_on_tie, tie_lowest_index, examples with row, expected, chosen, chosen logit and
        the top-3 logits as floats and bit patterns), disagreeing_paths, batch_dependence
        (per path group: the paths, rows_differ, examples).
    """
    from diag.errors import UsageError

    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise UsageError(f"check_greedy: logits must be [rows, vocab], got shape {logits.shape}")
    rows, vocab = logits.shape
    exact = _exact_greedy(logits)
    paths: dict[str, Any] = {}
    chosen: dict[str, np.ndarray] = {}
    for name, tok in tokens.items():
        tok = np.asarray(tok).reshape(-1)
        if tok.shape[0] != rows:
            raise UsageError(
                f"check_greedy: path {name!r} gives {tok.shape[0]} tokens for {rows} rows"
            )
        chosen[name] = tok.astype(np.int64)
        paths[name] = _check_path(name, chosen[name], logits, exact, rounded_probs)
    return {
        "rows": int(rows),
        "vocab": int(vocab),
        "unique_rows": int(exact.unique.sum()),
        "tied_rows": int(exact.tied.sum()),
        "nan_rows": int(exact.nan_row.sum()),
        "paths": paths,
        "disagreeing_paths": sorted(
            nm for nm, p in paths.items() if p["disagree"] or p["wrong_on_tie"]
        ),
        "rounding_tie_paths": sorted(nm for nm, p in paths.items() if p["rounding_tie"]),
        "batch_dependence": _batch_dependence(chosen, logits),
    }


def _path_mismatch(metrics: dict[str, Any], name: str) -> Mismatch:
    """A failing path's rows: those off the unique maximum, or off a tied maximum."""
    p = metrics["paths"][name]
    ex = next((e for e in p["examples"] if not e.get("rounding_tie")), p["examples"][0])
    return Mismatch(
        p["disagree"] + p["wrong_on_tie"],
        metrics["unique_rows"],
        "rows",
        share=False,
        where=f"row {ex['row']}",
        got=ex["chosen"],
        expected=ex["expected"],
    )


def greedy_mismatch(metrics: dict[str, Any]) -> Mismatch | None:
    """The rows that decide `judge_greedy`'s verdict, in its order: the first path off the
    exact argmax, else the rows where rounded probabilities tie, else the rows whose token
    depends on the batch size; None when none."""
    bad = metrics["disagreeing_paths"]
    if bad:
        return _path_mismatch(metrics, bad[0])
    rounded = metrics.get("rounding_tie_paths") or []
    if rounded:
        p = metrics["paths"][rounded[0]]
        ex = next(e for e in p["examples"] if e.get("rounding_tie"))
        return Mismatch(
            p["rounding_tie"],
            metrics["unique_rows"],
            "rows",
            share=False,
            where=f"row {ex['row']}",
            got=ex["chosen"],
            expected=ex["expected"],
        )
    dep = [v for v in metrics["batch_dependence"].values() if v["rows_differ"]]
    if dep:
        return Mismatch(dep[0]["rows_differ"], metrics["rows"], "rows", share=False)
    return None


def judge_greedy(metrics: dict[str, Any]) -> tuple[str, str]:
    """Verdict for `check_greedy` metrics: (status, one-line reason).

    fail: any path picks a token other than the unique exact maximum, or a non-maximal token on
    a tied row (beyond what rounding the probabilities forces). warn: a softmax path drops the
    most probable token only where the correctly rounded probabilities of the top two are
    equal (the dtype cannot separate them: sample from logits), or a path's choice depends on
    the batch size (possible only on tied or NaN rows). pass: otherwise.
    """
    uniq = metrics["unique_rows"]
    bad = metrics["disagreeing_paths"]
    m = greedy_mismatch(metrics)
    if bad:
        assert m is not None  # greedy_mismatch decides in the same order
        # One count per path before one shared total ("a 3; b 2 of 64 rows"): the form
        # tests/test_compare_sampling.py pins, so the paths read as one sentence.
        parts = "; ".join(f"{name} {_path_mismatch(metrics, name).count}" for name in bad)
        ex = next(
            (e for e in metrics["paths"][bad[0]]["examples"] if not e.get("rounding_tie")),
            metrics["paths"][bad[0]]["examples"][0],
        )
        top = ", ".join(f"{t['index']}: {t['logit']:.6g} ({t['bits']})" for t in ex["top3"])
        return Status.FAIL, (
            f"greedy token differs from the exact argmax: {parts} of {m.total} rows "
            f"with a unique maximum disagree (first: {bad[0]} {m.where} chose "
            f"{m.got}, exact {m.expected}; top logits {top})"
        )
    dep = {k: v for k, v in metrics["batch_dependence"].items() if v["rows_differ"]}
    tie_note = (
        f" ({metrics['tied_rows']} rows with an exactly tied maximum excluded)"
        if metrics["tied_rows"]
        else ""
    )
    rounded = metrics.get("rounding_tie_paths") or []
    if rounded:
        assert m is not None
        return Status.WARN, (
            f"argmax over rounded probabilities drops the most probable token in "
            f"{format_mismatch(m)} ({', '.join(rounded)}): the top two "
            f"logits round to the same probability in this dtype (first: "
            f"{m.where} chose {m.got}, exact {m.expected}); sample "
            f"from the logits or from float32 probabilities{tie_note}"
        )
    if dep:
        key, v = next(iter(dep.items()))
        assert m is not None
        return Status.WARN, (
            f"every path picks the exact greedy token, but {key} depends on the "
            f"batch size in {format_mismatch(m)} "
            f"({', '.join(v['paths'])}){tie_note}"
        )
    return Status.PASS, (
        f"all {len(metrics['paths'])} paths pick the exact greedy token in all "
        f"{uniq} rows with a unique maximum{tie_note}"
    )


def agree_tokens(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], names: tuple[str, str]
) -> Verdict:
    """Do two backends pick the same token per row on every path they share? A difference is
    a warn (each is judged against the exact argmax on its own)."""
    shared = [p for p in a if p in b]
    differ = {
        p: int(np.count_nonzero(np.asarray(a[p]).reshape(-1) != np.asarray(b[p]).reshape(-1)))
        for p in shared
    }
    metrics = {"paths": shared, "rows_differ": differ}
    bad = {p: k for p, k in differ.items() if k}
    if not bad:
        return Verdict(
            Status.PASS,
            (f"{names[0]} and {names[1]} pick the same tokens on all {len(shared)} shared paths"),
            metrics,
        )
    first = next(iter(bad))
    return Verdict(
        Status.WARN,
        (
            f"{names[0]} and {names[1]} pick different tokens on {len(bad)} paths "
            f"(first: {first}, {bad[first]} rows)"
        ),
        metrics,
    )


def evaluate(o: Outcome) -> Evaluation:
    """Every sampler path's tokens against the exact argmax; the truth is the correctly
    rounded softmax, which says where rounded probabilities cannot separate the top two."""
    tokens = o.named
    metrics = check_greedy(o.inputs[0], tokens, rounded_probs=o.truth.value)
    status, reason = judge_greedy(metrics)
    return Evaluation(status, reason, metrics, mismatch=greedy_mismatch(metrics))


def agree(a: Outcome, b: Outcome, names: tuple[str, str], context) -> Verdict:
    """Two backends' tokens on the paths they share."""
    return agree_tokens(a.named, b.named, names)


# The batch sizes a sampler's rows are also run in: a chosen token must not depend on them.
SAMPLER_BATCHES = (1, 8, 64)


def _jax_sampler(x):
    """How a model's sampler picks the greedy token, four ways, in one function."""
    import jax
    import jax.numpy as jnp

    probs = jax.nn.softmax(x, axis=-1)
    return {
        "argmax": jnp.argmax(x, axis=-1).astype(jnp.int32),
        "argmax_softmax": jnp.argmax(probs, axis=-1).astype(jnp.int32),
        "top_k": jax.lax.top_k(x, 1)[1][..., 0].astype(jnp.int32),
        "approx_max_k": jax.lax.approx_max_k(x, 1)[1][..., 0].astype(jnp.int32),
    }


def on_jax(backend, batches: tuple[int, ...] = ()):
    """The greedy token per row by every path a sampler may take.

    `jit/*`: the four choices fused in one jitted function, where XLA may keep bf16
    intermediates in float32 (`--xla_allow_excess_precision`). `eager/*`: op by op, each
    result materialised in the input dtype (softmax output rounded before the argmax).
    `jit/batchB/*`: the jitted function on batches of B rows, for each B in `batches`
    (`SAMPLER_BATCHES`).
    """
    import jax
    import jax.numpy as jnp

    fused = jax.jit(_jax_sampler)

    def paths(x):
        out = {f"jit/{name}": v for name, v in fused(x).items()}
        probs = jax.nn.softmax(x, axis=-1)  # materialised, in x's dtype
        out["eager/argmax"] = jnp.argmax(x, axis=-1).astype(jnp.int32)
        out["eager/argmax_softmax"] = jnp.argmax(probs, axis=-1).astype(jnp.int32)
        out["eager/top_k"] = jax.lax.top_k(x, 1)[1][..., 0].astype(jnp.int32)
        out["eager/approx_max_k"] = jax.lax.approx_max_k(x, 1)[1][..., 0].astype(jnp.int32)
        for b in batches:
            chunks = [fused(x[i : i + b]) for i in range(0, x.shape[0], b)]
            for name in chunks[0]:
                out[f"jit/batch{b}/{name}"] = jnp.concatenate([c[name] for c in chunks])
        return out

    setattr(paths, "eager", True)  # noqa: B010 - read as getattr(fn, "eager", False); mypy has no fn attrs
    return paths


def _torch_sampler(x) -> dict:
    import torch

    probs = torch.softmax(x, dim=-1)  # materialised, in x's dtype
    return {
        "argmax": torch.argmax(x, dim=-1),
        "argmax_softmax": torch.argmax(probs, dim=-1),
        "top_k": torch.topk(x, 1, dim=-1).indices[..., 0],
    }


def on_torch(backend, batches: tuple[int, ...] = ()):
    """The greedy token per row by every path an eager sampler may take (torch has no
    approx_max_k): `eager/*` on all rows, `eager/batchB/*` on batches of B rows, for each B in
    `batches` (`SAMPLER_BATCHES`)."""
    import torch

    def paths(x):
        out = {f"eager/{name}": v for name, v in _torch_sampler(x).items()}
        for b in batches:
            chunks = [_torch_sampler(x[i : i + b]) for i in range(0, x.shape[0], b)]
            for name in chunks[0]:
                out[f"eager/batch{b}/{name}"] = torch.cat([c[name] for c in chunks])
        return out

    return paths


PROBE = Probe(
    op="greedy_token",
    dims=("rows", "n"),
    params={},
    op_args=(),
    dtypes=FLOATS,
    inputs=LOGIT_MAKERS,
    input_shapes=rows_shapes,
    truth=truth,
    evaluate=evaluate,
    agree=agree,
    label=rows_label(),
    input_family="rows",
    host_bytes=rows_bytes,
    fixed_args={"batches": SAMPLER_BATCHES},
    report_section="greedy",
    implementations={"jax": on_jax, "torch": on_torch},
)
