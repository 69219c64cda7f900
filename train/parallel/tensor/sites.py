"""What the tensor-parallel layout does at each equation of a model's program: the sites
the finder (:mod:`.finder`) records and the rewrite (:mod:`.rewrite`) carries out.

Each site names the equation it acts on by its *location*: the indices of the equations
leading to it through the sub-programs it sits in (a jit, a remat, a scan's body).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Column", "Row", "Unfuse", "Embedding", "Site"]


class Column(NamedTuple):
    """A column-parallel matmul (its output features split), or a vocabulary head.

    ``activation``/``weight``: operand positions; ``weight_dim``: the weight operand's
    dimension split; ``out_dim``: the result's; ``tokens``: the activation's dimensions that
    are not contracted (batch first, then the sequence); ``parts``: a fused matmul's parts
    (q, k and v in one kernel), each split on its own; ``head``: a vocabulary head (its
    output leaves the model, split)."""

    activation: int
    weight: int
    weight_dim: int
    out_dim: int
    tokens: tuple[int, ...]
    parts: int = 1
    head: bool = False


class Row(NamedTuple):
    """A row-parallel matmul (its contracted features split): each device's product is a
    partial sum. ``tokens``: the result's token dimensions (batch first, then the sequence);
    ``activation``: the split operand, ``dim`` its split dimension, ``tokens_in`` its token
    dimensions."""

    tokens: tuple[int, ...]
    activation: int = 0
    dim: int = 0
    tokens_in: tuple[int, ...] = ()


class Unfuse(NamedTuple):
    """The split (or slice: ``part``) of a fused matmul's result into its parts."""

    axis: int
    parts: int
    part: int | None = None  # a slice taking one part; None: a split into all of them


class Embedding(NamedTuple):
    """A lookup in a vocabulary split over ``tensor``: ``tokens``, its result's token dimensions."""

    tokens: tuple[int, ...]


Site = Column | Row | Unfuse | Embedding
