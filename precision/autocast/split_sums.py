"""Matmuls whose sums are split across devices, and the dtype those sums are made in.

Under tensor parallelism a layer's matmul is split across devices: a row-parallel
matmul (each device holds a slice of its contracted features) makes a partial
product on each device, and XLA's partitioner sums the parts across devices right
after the matmul, *in its output dtype*; the backward pass of a column-parallel
matmul (its output features split) does the same for its input's gradient. A sum
of bfloat16 parts rounds each part first, which one device never does (its matmul
accumulates in float32 and rounds once), and makes the loss drift.

A layout marks such a matmul with :func:`split_sums` (a named scope, so the mark
survives tracing, scans and remat as region tags do); autocast then makes the sum
in the dtype it names:

- ``forward``: the matmul's result in that dtype (a float32 value, which ends where
  it leaves the module, as float32 islands do), so the sum across devices runs in it;
  its cotangent comes back to the operands' dtype before the backward products;
- ``backward``: the gradient of its non-param operand (the activation) in that dtype,
  rounded to the operand's dtype after the sum.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import jax
import numpy as np

from precision.autocast.regions import SPLIT_SCOPE_PREFIX
from precision.policy import _canonical

__all__ = ["SplitSums", "split_sums", "split_sums_of", "wider_sums", "SPLIT_SCOPE_PREFIX"]


class SplitSums(NamedTuple):
    """The dtypes of a matmul's sums across devices (None: not split, or the matmul's own)."""

    forward: np.dtype | None = None
    backward: np.dtype | None = None


def _scope(dtype: np.dtype, forward: bool, backward: bool) -> str:
    which = "+".join(w for w, on in (("forward", forward), ("backward", backward)) if on)
    return f"{SPLIT_SCOPE_PREFIX}{which}:{np.dtype(dtype).name}"


@contextlib.contextmanager
def split_sums(dtype: object, *, forward: bool = False, backward: bool = False) -> Iterator[None]:
    """Matmuls traced inside have their sums split across devices: under autocast their
    result (``forward``) and their input's gradient (``backward``) are made in ``dtype``
    (``"f32"``, ``"bf16"``...). Outside autocast it only names a scope."""
    with jax.named_scope(_scope(_canonical(dtype), forward, backward)):
        yield


def split_sums_of(scope: tuple[str, ...]) -> SplitSums:
    """The split sums the innermost :func:`split_sums` scope of ``scope`` names."""
    for name in reversed(scope):
        if name.startswith(SPLIT_SCOPE_PREFIX):
            which, _, dtype = name[len(SPLIT_SCOPE_PREFIX):].partition(":")
            parts = which.split("+")
            return SplitSums(np.dtype(dtype) if "forward" in parts else None,
                             np.dtype(dtype) if "backward" in parts else None)
    return SplitSums()


def wider_sums(primitive: str, scope: tuple[str, ...], target: np.dtype) -> SplitSums:
    """The split sums of a ``primitive`` computing in ``target`` at ``scope``, where they are
    wider than ``target`` (a bfloat16 sum of bfloat16 operands is the matmul's own) and it is
    a ``dot_general``."""
    split = split_sums_of(scope) if primitive == "dot_general" else SplitSums()
    return SplitSums(*[None if d is None or d.itemsize <= np.dtype(target).itemsize else d for d in split])
