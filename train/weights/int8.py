"""Weights served in int8: which are quantized, and how an export holds them.

A weight is stored as :class:`precision.ChannelInt8` (int8 codes, a float32 scale per
output channel) when the serving casts it to a half dtype (the run's float32 islands,
norms, stay float32), it is large enough to pay (:func:`precision.quantizable`: a matrix of
4,096 values or more), and only matmuls read it (:func:`precision.contracted_axes` says over
which axes; biases and norms are read otherwise). An embedding stays in the half dtype: a
token reads one row of it, and a tied one (looked up, and multiplied by its transpose) would
be dequantized whole into a copy for its two readers. Everything else keeps the dtype the
serving casts it to.

An export (``python -m train export RUN --dtype int8 OUT``) writes each as two arrays beside
where the weight was, ``<path>/channel_codes`` (int8) and ``<path>/channel_scales``
(float32, with 1 on the contracted axes); :func:`dequantized_channels` reads them back as
the float32 weight, which quantizes again to the same codes.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from precision.channel_weights import ChannelInt8, quantize_channels
from precision.quantized_weights import quantizable

__all__ = ["CODES_KEY", "SCALES_KEY", "int8_weights", "channel_arrays", "dequantized_channels"]

CODES_KEY, SCALES_KEY = "channel_codes", "channel_scales"

Flat = dict[tuple[str, ...], Any]


def int8_weights(params: Flat, served: Flat, axes: Flat) -> Flat:
    """``served`` (params as the serving casts them) with each weight worth it in int8, quantized
    from its float32 value in ``params``; ``axes``: :func:`precision.contracted_axes` of each."""
    out = dict(served)
    for path, value in served.items():
        half = np.dtype(value.dtype).itemsize == 2 and jnp.issubdtype(value.dtype, jnp.floating)
        if half and axes.get(path) is not None and quantizable(np.asarray(params[path])):
            out[path] = quantize_channels(params[path], axes[path], value.dtype)
    return out


def channel_arrays(flat: Flat) -> Flat:
    """``flat`` with each :class:`ChannelInt8` as its two arrays (``<path>/channel_codes``,
    ``<path>/channel_scales``), numpy, for a file."""
    out: Flat = {}
    for path, value in flat.items():
        if isinstance(value, ChannelInt8):
            out[path + (CODES_KEY,)] = np.asarray(value.codes)
            out[path + (SCALES_KEY,)] = np.asarray(value.scales, np.float32)
        else:
            out[path] = value
    return out


def dequantized_channels(flat: Flat) -> Flat:
    """``flat`` (a file's arrays) with each ``<path>/channel_codes`` and ``<path>/channel_scales``
    pair read back as the float32 weight at ``path``."""
    out = {k: v for k, v in flat.items() if k[-1] not in (CODES_KEY, SCALES_KEY)}
    for path in {k[:-1] for k in flat if k[-1] == CODES_KEY and k[:-1] + (SCALES_KEY,) in flat}:
        codes, scales = np.asarray(flat[path + (CODES_KEY,)]), np.asarray(flat[path + (SCALES_KEY,)])
        out[path] = codes.astype(np.float32) * scales.astype(np.float32)
    return out
