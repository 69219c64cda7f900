"""The FLOPs of a matmul or a convolution of an optimized HLO program, from its shapes and attributes.

A dot's are 2 x its output's elements x its contracted size; a convolution's, 2 x its output's
elements x the kernel's taps per output that meet an input value, as XLA's own cost analysis
counts them (``HloCostAnalysis::GetConvolutionFlops``): a tap on padding, or between the values of
an input XLA dilated, multiplies nothing. XLA:TPU writes matmuls so: a batched one as a window
spanning the batch over an input dilated by as much; a ``DenseGeneral`` onto heads (``(b, t, d) x
(d, h, k)``) as a window of ``h`` taps over one input position padded by ``h - 1`` on each side,
one tap of each output meeting it.
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
    """2 x output elements x the kernel's taps per output of a convolution (its ``dim_labels``) that
    meet an input value (``lhs``: the input's shape; without it, every tap of the window)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if labels is None or len(labels.group(2)) != len(rhs):
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", rest)
    known = lhs is not None and window is not None and len(lhs) == len(lhs_labels) and len(out) == len(out_labels)
    per_output, spatial_out = 1, 1
    for size, label in zip(rhs, rhs_labels):
        if known and label.isdigit():  # taps meeting values, summed over the outputs along this dim
            spatial = _window_field(window.group(1), int(label))
            per_output *= _taps(out[out_labels.index(label)], lhs[lhs_labels.index(label)], size, **spatial)
            spatial_out *= out[out_labels.index(label)]
        elif label != "o":
            per_output *= size
    groups = re.search(r"batch_group_count=(\d+)", rest)
    return 2.0 * math.prod(out) / spatial_out * per_output / (int(groups.group(1)) if groups else 1)


def _window_field(window: str, dim: int) -> dict[str, int]:
    """A window's stride, low padding, input and window dilation along spatial ``dim`` (XLA's defaults:
    1, 0, 1, 1)."""
    def field(name: str, default: int) -> int:
        m = re.search(name + r"=([\d_x\-]+)", window)
        if m is None:
            return default
        parts = m.group(1).split("x")
        return int(parts[dim].split("_")[0]) if dim < len(parts) else default

    return {"stride": field("stride", 1), "pad": field("pad", 0), "dilate": field("lhs_dilate", 1),
            "spread": field("rhs_dilate", 1)}


def _taps(outputs: int, inputs: int, size: int, stride: int, pad: int, dilate: int, spread: int = 1) -> int:
    """Over ``outputs`` positions, the window taps (``spread`` apart) that meet one of ``inputs`` values
    dilated by ``dilate``."""
    if dilate == 1:  # per tap, the outputs whose input index o * stride + tap * spread - pad is in range
        start = np.arange(size) * spread - pad
        first = np.maximum(-(start // stride), 0)  # ceil(-start / stride), at least 0
        last = np.minimum((inputs - 1 - start) // stride, outputs - 1)
        return int(np.maximum(last - first + 1, 0).sum())
    at = np.arange(outputs)[:, None] * stride + np.arange(size)[None, :] * spread - pad
    return int(np.count_nonzero((at >= 0) & (at % dilate == 0) & (at // dilate < inputs)))
