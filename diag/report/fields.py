"""Typed reads of the loosely typed JSON that records and run.json hold.

A record's `metrics`, `timings`, `params` and the like are mappings when a writer put them there
and anything else (absent, None, a torn value) when it did not; the report never fails on a
missing field. These two readers say so once, with types the checker can follow, instead of
`x.get(k) if isinstance(x.get(k), Mapping) else {}` at every use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def as_mapping(value: Any) -> Mapping[str, Any]:
    """`value` when it is a mapping, else an empty one (a field absent or not an object)."""
    return value if isinstance(value, Mapping) else {}


def mapping_or_none(value: Any) -> Mapping[str, Any] | None:
    """`value` when it is a mapping, else None (a section the report leaves out)."""
    return value if isinstance(value, Mapping) else None
