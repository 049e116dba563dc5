"""Faults diag puts into outputs on purpose, to prove that a check can fail.

Two harnesses inject them: the worker (`DIAG_WORKER_FAULT`, see diag.worker.main), with
which diag's tests prove the runner's verdicts, and `diag nodes --inject`, with which a user
proves the scan names a faulty device. The kinds that change an output live here once, so
both corrupt outputs the same way and a new kind is one branch of `corrupt`.

Every kind returns a new array and leaves its argument alone: the caller keeps the true
output (the scan needs it for a ``stuck`` device's next call).
"""

from __future__ import annotations

import numpy as np

from diag.numerics import bits_view, is_supported

__all__ = ["OUTPUT_FAULTS", "WORKER_OUTPUT_FAULTS", "corrupt"]

#: What `corrupt` can do to an array:
#:   ``double``: the first element doubled (silent wrong data; a zero stays zero);
#:   ``truncate``: the last column dropped (a wrong shape);
#:   ``nan``: one random element set to NaN (a bit flip on a non-float array);
#:   ``bitflip``: one random bit of one random element flipped;
#:   ``stuck``: the previous output returned again (a device stuck on its last result).
OUTPUT_FAULTS = ("double", "truncate", "nan", "bitflip", "stuck")

#: `DIAG_WORKER_FAULT` kinds that corrupt the first output, and the `corrupt` kind each is.
#: (``corrupt_input`` doubles the first input the same way; the other worker kinds kill,
#: abort, raise, hang or drop an output, and live in the worker.)
WORKER_OUTPUT_FAULTS = {"corrupt": "double", "truncate": "truncate"}


def corrupt(
    out, kind: str, *, rng: np.random.Generator | None = None, stale: np.ndarray | None = None
) -> np.ndarray:
    """A corrupted copy of `out` (never `out` itself).

    Args:
      out: the true output (any array; float dtypes diag handles, integers, ...).
      kind: one of `OUTPUT_FAULTS`.
      rng: draws the element (and bit) for ``nan`` and ``bitflip``.
      stale: what a ``stuck`` device returns: its previous output.

    Returns:
      The corrupted array.

    Raises:
      ValueError: an unknown kind, or ``stuck`` without `stale` / a random kind without `rng`
        (a programming error: users' kinds are checked where they are parsed).
    """
    if kind == "stuck":
        if stale is None:
            raise ValueError("corrupt: kind 'stuck' needs the previous output (stale=)")
        return np.array(stale, copy=True)
    if kind == "double":
        bad = np.array(out, copy=True)
        bad.flat[0] = bad.flat[0] * 2
        return bad
    if kind == "truncate":
        return np.ascontiguousarray(np.asarray(out)[..., :-1])
    if kind not in ("nan", "bitflip"):
        raise ValueError(
            f"corrupt: unknown fault kind {kind!r}; expected one of {', '.join(OUTPUT_FAULTS)}"
        )
    if rng is None:
        raise ValueError(f"corrupt: kind {kind!r} needs a random generator (rng=)")
    bad = np.array(out, copy=True)
    flat = bits_view(bad.reshape(-1))
    i = int(rng.integers(flat.size))
    if kind == "nan" and is_supported(bad.dtype):
        bad.reshape(-1)[i] = np.nan
        return bad
    bit = int(rng.integers(8 * bad.dtype.itemsize))  # bitflip (and nan on a non-float output)
    flat[i] ^= flat.dtype.type(1 << bit)
    return bad
