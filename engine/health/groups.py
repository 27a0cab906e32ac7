"""Rows a person can read: a deep model's layers grouped by block, the full list kept on disk.

``group_rows`` picks the deepest level of the module tree whose blocks number at most ``limit``
(``encoder.layers.3.attn.q`` → ``encoder.layers.3`` at depth 3); where even the top level has more
blocks than that (a ``Sequential`` of 100 layers), consecutive layers are joined into ``limit`` runs
named ``first … last``. Sums (squared norms, activation sums) add within a group; the values are
then formed from the group's sums, so a group's gradient norm is the norm over all its parameters.
"""

from __future__ import annotations

from collections.abc import Sequence


def _prefix(name: str, depth: int) -> str:
    return ".".join(name.split(".")[:depth])


def group_rows(names: Sequence[str], limit: int) -> tuple[list[str], list[int]]:
    """``(group names, the group of each name)``; each name its own row when there are few enough."""
    if len(names) <= limit:
        return list(names), list(range(len(names)))
    deepest = max((n.count(".") + 1 for n in names), default=1)
    for depth in range(deepest, 0, -1):
        prefixes = list(dict.fromkeys(_prefix(n, depth) for n in names))
        if len(prefixes) <= limit:
            where = {p: k for k, p in enumerate(prefixes)}
            return prefixes, [where[_prefix(n, depth)] for n in names]
    # Consecutive runs of about equal length.
    n = len(names)
    of = [k * limit // n for k in range(n)]
    groups: list[str] = []
    for g in range(limit):
        members = [names[k] for k in range(n) if of[k] == g]
        groups.append(members[0] if len(members) == 1 else f"{members[0]} … {members[-1]}")
    return groups, of


def add_by_group(values: Sequence[float], of: Sequence[int], groups: int) -> list[float]:
    """Sum ``values`` into their groups."""
    out = [0.0] * groups
    for v, g in zip(values, of, strict=True):
        out[g] += v
    return out
