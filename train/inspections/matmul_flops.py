"""The FLOPs of a matmul or a convolution of an optimized HLO program, from its shapes and attributes.

A dot's are 2 x its output's elements x its contracted size; a convolution's, 2 x its output's
elements x the kernel's taps per output, where, over an input XLA dilated (``lhs_dilate``: how
XLA:TPU writes a batched matmul, its window spanning the batch), only the taps that meet an
input value count.
"""

from __future__ import annotations

import math
import re

import numpy as np

__all__ = ["dot_flops", "conv_flops", "ints"]


def ints(text: str) -> list[int]:
    """The integers written in ``text``, in order."""
    return [int(x) for x in re.findall(r"\d+", text)]


def dot_flops(out: tuple[int, ...], lhs: tuple[int, ...], rest: str) -> float:
    """2 x output elements x contracted size of a dot (its ``lhs_contracting_dims``) or of a
    GEMM library call (the ``lhs_contracting_dimensions`` of its backend config)."""
    m = re.search(r"lhs_contracting_dims=\{([^}]*)\}", rest) or \
        re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', rest)
    contracting = ints(m.group(1)) if m else []
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting if d < len(lhs))


def conv_flops(out: tuple[int, ...], rhs: tuple[int, ...], rest: str, lhs: tuple[int, ...] | None = None) -> float:
    """2 x output elements x the kernel's size per output of a convolution (its ``dim_labels``).
    Over an input dilated by ``lhs_dilate`` (``lhs``: its shape) only the taps meeting an input
    value count: XLA:TPU writes a batched matmul as such a convolution, its window spanning the
    batch, one tap in the window's size meeting a value."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if labels is None or len(labels.group(2)) != len(rhs):
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", rest)
    dilated = lhs is not None and window is not None and "lhs_dilate=" in window.group(1) and \
        len(lhs) == len(lhs_labels) and len(out) == len(out_labels)
    per_output, spatial_out = 1, 1
    for size, label in zip(rhs, rhs_labels):
        if dilated and label.isdigit():  # taps meeting values, summed over the outputs along this dim
            spatial = _window_field(window.group(1), int(label))
            per_output *= _taps(out[out_labels.index(label)], lhs[lhs_labels.index(label)], size, **spatial)
            spatial_out *= out[out_labels.index(label)]
        elif label != "o":
            per_output *= size
    groups = re.search(r"batch_group_count=(\d+)", rest)
    return 2.0 * math.prod(out) / spatial_out * per_output / (int(groups.group(1)) if groups else 1)


def _window_field(window: str, dim: int) -> dict[str, int]:
    """A window's stride, low padding and input dilation along spatial ``dim`` (XLA's defaults: 1, 0, 1)."""
    def field(name: str, default: int) -> int:
        m = re.search(name + r"=([\d_x\-]+)", window)
        if m is None:
            return default
        parts = m.group(1).split("x")
        return int(parts[dim].split("_")[0]) if dim < len(parts) else default

    return {"stride": field("stride", 1), "pad": field("pad", 0), "dilate": field("lhs_dilate", 1)}


def _taps(outputs: int, inputs: int, size: int, stride: int, pad: int, dilate: int) -> int:
    """Over ``outputs`` positions, the window taps that meet one of ``inputs`` values dilated by ``dilate``."""
    at = np.arange(outputs)[:, None] * stride + np.arange(size)[None, :] - pad
    return int(np.count_nonzero((at >= 0) & (at % dilate == 0) & (at // dilate < inputs)))
