"""Which 8-bit product an allow-listed matmul of the interpreter becomes: FP8 in an FP8 region,
int8 in an int8 region (:mod:`.fp8_sites`, :mod:`.int8_sites`), or none, and why not."""

from __future__ import annotations

from typing import Any

import numpy as np

from precision.autocast.scaled import fp8_sites, int8_sites
from precision.autocast.scaled.fp8_quantize import E4M3

__all__ = ["scaled_product", "not_scaled"]


def scaled_product(site: Any, ins: list, ctx: Any, out_dtype: np.dtype,
                   input_grad: np.dtype | None = None) -> tuple[Any, np.dtype | None, str | None]:
    """(the result, the dtype to log, the reason) where the site's region runs matmuls in FP8 or int8
    and this one qualifies; else (None, None, why it does not: None outside such a region).
    ``site``, ``ctx``: the interpreter's :class:`~precision.autocast.interpreter.Site` and context;
    ``input_grad``: the dtype of the gradient of an operand that is not a param where it is a sum
    split across devices (:mod:`precision.autocast.split_sums`; FP8's products only)."""
    if site.fp8:
        why = fp8_sites.skip_reason(site.name, ins, site.eqn, ctx.fp8.options)
        if why is not None:
            return None, None, why
        result, reason = fp8_sites.fp8_dot(site, ins, ctx.fp8, site.region, out_dtype, ctx.reduce, input_grad)
        return result, E4M3, reason
    if site.int8:
        why = int8_sites.skip_reason(site.name, ins, site.eqn, ctx.int8.options)
        if why is not None:
            return None, None, why
        result, reason = int8_sites.int8_op(site, ins, ctx.int8, site.region, out_dtype, ctx.reduce)
        return result, int8_sites.INT8, reason
    return None, None, None


def not_scaled(ctx: Any, site: Any) -> str:
    """Why a matmul of an FP8 or int8 policy is not one: a rule (or region) keeps it out."""
    if ctx.root_fp8 and not site.fp8:
        return fp8_sites.NOT_FP8_REGION
    if ctx.root_int8 and not site.int8:
        return int8_sites.NOT_INT8_REGION
    return "allow-listed op"
