"""The tensor-parallel finder's groups (:mod:`.finder`): matmul pairs being followed, joined
where their split values meet (attention's q, k and v; a gated MLP's two halves)."""

from __future__ import annotations

import dataclasses

from train.parallel.tensor.labels import Label

__all__ = ["Group", "Groups"]


@dataclasses.dataclass
class Group:
    """A matmul pair (or several joined by attention, gated MLPs) being followed."""

    seeds: list = dataclasses.field(default_factory=list)  # (path, param dim, module, size, location, parts)
    rows: list = dataclasses.field(default_factory=list)  # (path, param dim, module)
    features: list = dataclasses.field(default_factory=list)  # biases of split features: (path, dim, module, parts)
    sites: dict = dataclasses.field(default_factory=dict)  # location -> site
    stop: str | None = None
    sizes: list = dataclasses.field(default_factory=list)  # what tensor does not divide
    output: bool = False  # a split value leaves the model
    parts: int = 1  # found a fused matmul's parts (the first pass)


class Groups:
    """Groups by id, joined in a union-find."""

    def __init__(self):
        self.groups: list[Group] = []
        self.parent: list[int] = []

    def new_group(self) -> int:
        self.groups.append(Group())
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def root(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def join(self, gs: list[int]) -> int:
        roots = sorted({self.root(g) for g in gs})
        first = roots[0]
        for other in roots[1:]:
            self.parent[other] = first
            a, b = self.groups[first], self.groups[other]
            a.seeds += b.seeds
            a.rows += b.rows
            a.features += b.features
            a.sites.update(b.sites)
            a.sizes += b.sizes
            a.stop = a.stop or b.stop
            a.output = a.output or b.output
        return first

    def group(self, g: int) -> Group:
        return self.groups[self.root(g)]

    def stop(self, label: Label, why: str) -> None:
        group = self.group(label.group)
        group.stop = group.stop or why
