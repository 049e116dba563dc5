"""HLO text, read for what a trace event does not carry: an instruction's dtype and shape.

A trace_viewer event names the HLO instruction it ran (`args.hlo_op`, e.g. `ynn_fusion`,
`broadcast_divide_fusion`); the optimised HLO of the module defines that instruction with its
result type (`%ynn_fusion = f32[256,256]{1,0} fusion(...)`). Reading both joins time with
dtype and shape. Instruction names are unique within a module, so a name is a key.
"""

from __future__ import annotations

import re

__all__ = ["instructions", "opcode_counts", "changed_instructions", "program_lines"]

# `[ROOT] %name = TYPE opcode(`; TYPE is `f32[4,8]{1,0}`, `bf16[]`, or a tuple `(f32[2], s32[2])`.
_DEF = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\([^=]*?\)|[a-z]\w*\[[^\]]*\]"
    r"(?:\{[^}]*\})?)\s+(?P<opcode>[a-z][\w\-]*)\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]\w*)\[(?P<dims>[^\]]*)\]")


def _shape(type_text: str) -> tuple[str, str]:
    """(dtype, shape) of an HLO result type; a tuple joins its elements with `, `."""
    arrays = _ARRAY.findall(type_text)
    dtypes = ", ".join(dict.fromkeys(d for d, _ in arrays))
    shapes = ", ".join(f"[{dims}]" for _, dims in arrays)
    return dtypes, shapes


def instructions(hlo_text: str) -> dict[str, dict[str, str]]:
    """Every instruction defined in HLO text: name -> {"dtype", "shape", "opcode"}."""
    out: dict[str, dict[str, str]] = {}
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if m:
            dtype, shape = _shape(m.group("type"))
            out[m.group("name")] = {"dtype": dtype, "shape": shape, "opcode": m.group("opcode")}
    return out


def opcode_counts(hlo_text: str) -> dict[str, int]:
    """How many instructions of each opcode the text defines."""
    counts: dict[str, int] = {}
    for info in instructions(hlo_text).values():
        counts[info["opcode"]] = counts.get(info["opcode"], 0) + 1
    return counts


def _normalised(line: str) -> str:
    """An instruction line without its metadata (source lines, op names differ per process)."""
    return re.sub(r",\s*metadata=\{[^}]*\}", "", line).strip()


def program_lines(text: str) -> list[str]:
    """The instruction lines of an HLO text, in order, without their metadata: two dumps of
    one program compare equal line for line whichever process wrote them."""
    return [_normalised(x) for x in text.splitlines() if _DEF.match(x)]


def changed_instructions(before: str, after: str, limit: int = 20) -> dict[str, list[str]]:
    """The instruction lines one HLO text has and the other lacks (metadata ignored).

    Returns:
      {"added": lines only in `after`, "removed": lines only in `before`}, at most `limit`
      each, in text order.
    """
    a, b = program_lines(before), program_lines(after)
    sa, sb = set(a), set(b)
    return {
        "added": [x for x in b if x not in sa][:limit],
        "removed": [x for x in a if x not in sb][:limit],
    }
