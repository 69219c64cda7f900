"""The finder's groups judged (:mod:`.finder`): which matmul pairs, heads and vocabularies
split, the params' splits assembled from them, and why the other params stay whole."""

from __future__ import annotations

import dataclasses
from typing import Any

from train.parallel.tensor.sites import Column

__all__ = ["Found", "verdict"]


@dataclasses.dataclass
class Found:
    """What :func:`find` found: ``splits`` ``{param path: (dim, role, module, parts)}``, ``kept``
    ``{param path: why}``, ``sites`` ``{location: (site, the param paths it splits with)}``,
    ``bad_sizes`` (one line each) and ``sequences``: the sequence length at each site that
    could split it (None for a site with no sequence dimension)."""

    splits: dict
    kept: dict
    sites: dict
    bad_sizes: list
    sequences: frozenset = frozenset()


def verdict(finder: Any, tensor: int) -> Any:
    """:class:`Found` from a finder (:mod:`.finder`) that has walked a program."""
    groups = {finder.root(g): finder.groups[finder.root(g)] for g in range(len(finder.groups))}
    why_not = {g: _why_not(group) for g, group in groups.items()}
    embeddings = dict(finder.embeddings)
    for _ in range(3):  # a param split two ways fails every group reading it; then look again
        splits, owners = _splits(groups, why_not, embeddings)
        clashes = {path for path, dims in splits.items() if len({(d, k) for d, _, _, k in dims}) > 1}
        if not clashes:
            break
        for path in clashes:
            ways = sorted({f"dim {d} ({role} in {module})" for d, role, module, _ in splits[path]})
            for g in owners[path]:
                why_not[g] = why_not[g] or f"{'/'.join(path)} would be split two ways: {', '.join(ways)}"
            if path in embeddings:
                embeddings.pop(path)
                finder.reads.setdefault(path, []).append(f"split two ways: {', '.join(ways)}")
    splits, _ = _splits(groups, why_not, embeddings)
    sites, bad = {}, []
    for g, group in groups.items():
        if why_not[g] is None:
            paths = frozenset(p for p, *_ in group.seeds + group.rows + group.features)
            sites.update({loc: (site, paths) for loc, site in _marked_heads(group).items()})
            bad += [] if _is_head(group) else group.sizes
    for path, (dim, module, size, loc, site) in embeddings.items():
        if path in splits:
            sites[loc] = (site, frozenset({path}))
            if size % tensor:
                bad.append(f"the vocabulary of {size} tokens of {module}")
    bad.sort(key=lambda line: " heads" not in line)  # heads first: the size a user chooses them by
    chosen = {path: next(iter(dims)) for path, dims in splits.items()}
    kept = _kept(finder, groups, why_not, chosen)
    return Found(chosen, kept, sites, bad, frozenset(finder.sequences))


def _is_head(group: Any) -> bool:
    return not group.rows and group.output and len(group.seeds) == 1


def _why_not(group: Any) -> str | None:
    """Why a group does not split (None: it does)."""
    if group.stop:
        return group.stop
    if _is_head(group):
        return f"tensor does not divide {group.sizes[0]}" if group.sizes else None
    if group.output:
        return "its split features leave the model"
    if not group.rows:
        return "its split features never reach a matmul that sums them"
    return None


def _splits(groups: dict, why_not: dict, embeddings: dict) -> tuple[dict, dict]:
    """``{param path: {(dim, role, module)}}`` of the groups that split, and the groups each
    path belongs to."""
    splits: dict = {}
    owners: dict = {}
    for g, group in groups.items():
        if why_not[g] is not None:
            continue
        head = _is_head(group)
        parts = [(p, d, "vocabulary" if head else "column", m, k) for p, d, m, _, _, k in group.seeds]
        parts += [(p, d, "row", m, 1) for p, d, m in group.rows]
        parts += [(p, d, "feature", m, k) for p, d, m, k in group.features]
        for path, dim, role, module, k in parts:
            splits.setdefault(path, set()).add((dim, role, module, k))
            owners.setdefault(path, set()).add(g)
    for path, (dim, module, *_rest) in embeddings.items():
        splits.setdefault(path, set()).add((dim, "vocabulary", module, 1))
        owners.setdefault(path, set())
    return splits, owners


def _marked_heads(group: Any) -> dict:
    """A group's sites, its column site marked as a head where the group is one."""
    if not _is_head(group):
        return dict(group.sites)
    return {loc: site._replace(head=True) if isinstance(site, Column) else site for loc, site in group.sites.items()}


def _kept(finder: Any, groups: dict, why_not: dict, chosen: dict) -> dict:
    """``{param path: why it stays whole}`` for every param read and not split."""
    why: dict = {}
    for g, group in groups.items():
        if why_not[g] is None:
            continue
        for path, *_ in group.seeds + group.rows + group.features:
            why.setdefault(path, why_not[g])
    for path, reasons in finder.reads.items():
        why.setdefault(path, reasons[0])
    return {path: reason for path, reason in why.items() if path not in chosen}
