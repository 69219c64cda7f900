"""The weights a model is served in: ``--dtype bf16|f16|f32|int8|nf4``.

``bf16``, ``f16``, ``f32``: every param cast to the dtype but those the run's precision
rules keep in float32 (its float32 islands: norms by default), by the framework's own
casting by module path and class (:meth:`precision.LinenWithPolicy.cast_params`), as
``python -m train export`` casts them; the model computes in that dtype, its softmax and
logits in float32. ``int8``: the same in bfloat16, then the matmuls' weights as int8 with a
scale per output channel (:mod:`train.weights.int8`), handed to the model as they are
(:func:`model_reads`): the model's autocast multiplies their codes and scales the product,
``(x . codes) * scales`` (:mod:`precision.autocast.frozen_reads`), one GEMM reading each code
once. ``nf4``: a run fine-tuned on an nf4 base, as it stored it (:mod:`train.serving.stored_base`):
the base matrices in their codes and block scales, the LoRA adapters unmerged, the rest as in
``bf16``. Whatever the dtype, each matmul's weight is stored with the axes it contracts last
(:mod:`train.serving.layout`), so a decode step reads it once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import precision
from precision.block_codes import block_codes
from precision.channel_weights import is_channel_int8
from precision.contractions import read_axes
from precision.quantized_weights import in_codes
from train.serving.layout import (ContractedLast, in_model_layout, is_stored_weight, laid_out, read_weight,
                                  stored_bytes)
from train.serving.tokenizer import SampleError
from train.training.binding import bind, cast_variables, mode_kwargs
from train.weights.int8 import int8_weights

__all__ = ["SERVING_DTYPES", "ServedWeights", "serving_dtype", "serve_weights", "materialized", "model_reads",
           "float32_weights",
           "tree_bytes"]

#: ``--dtype`` names: the dtype weights are stored in, and the one the model computes in.
SERVING_DTYPES = {"bf16": ("bfloat16", "bfloat16"), "f16": ("float16", "float16"), "f32": ("float32", "float32"),
                  "int8": ("int8", "bfloat16"), "nf4": ("nf4", "bfloat16")}
_ALIASES = {"bfloat16": "bf16", "float16": "f16", "fp16": "f16", "float32": "f32", "fp32": "f32"}


class ServedWeights(NamedTuple):
    """``params`` as served (arrays, :class:`precision.ChannelInt8` for int8 weights), the
    serving ``policy`` (computing in ``compute``) and ``rules``, what ``--dtype`` named."""

    params: Any
    policy: precision.Policy
    rules: tuple
    dtype: str
    compute: str
    looked_up: frozenset = frozenset()  # the paths of tables only lookups read (token embeddings)

    def bind(self, module: Any) -> Any:
        """``module`` (the model, or its decoding clone: the same params) under the serving policy."""
        return bind(module, self.policy, self.rules)

    @property
    def bytes(self) -> int:
        return tree_bytes(self.params)

    @property
    def token_bytes(self) -> int:
        """Bytes of weights one token reads: every weight, but one row of a table only looked up."""
        flat = traverse_util.flatten_dict(self.params, is_leaf=lambda _, x: is_stored_weight(x))
        return sum(stored_bytes(x) // (x.shape[0] if path in self.looked_up else 1) for path, x in flat.items())

    def describe(self) -> str:
        flat = [x.stored if isinstance(x, ContractedLast) else x
                for x in jax.tree_util.tree_leaves(self.params, is_leaf=is_stored_weight)]
        kept = sum(1 for x in flat if not in_codes(x) and np.dtype(x.dtype) == np.float32)
        int8 = sum(1 for x in flat if is_channel_int8(x))
        parts = [f"{int8} int8 (a scale per output channel)"] if int8 else []
        coded = [x for x in flat if in_codes(x) and not is_channel_int8(x)]
        if coded:
            parts.append(f"{len(coded)} in {coded[0].code} codes as stored (a scale per 64 values)")
        parts.append(f"{kept} float32" if self.compute != "float32" else "all float32")
        return f"{self.dtype} weights ({', '.join(parts)}), computing in {self.compute}"


def serving_dtype(name: str) -> str:
    """The ``--dtype`` key ``name`` stands for (``bf16``, ``f16``, ``f32``, ``int8``, ``nf4``)."""
    key = _ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if key not in SERVING_DTYPES:
        raise SampleError(f"--dtype {name!r}: give bf16, f16, f32, int8 or nf4")
    return key


def serve_weights(model: Any, params: Any, rules: Any, dtype: str, inputs: Any, state: dict | None = None,
                  codes: dict | None = None) -> ServedWeights:
    """``params`` (float32) as served in ``dtype`` under ``rules`` (the run's float32 islands),
    and ``model`` bound to the serving policy; ``inputs``: a batch to trace the model with;
    ``codes`` (``nf4``): ``{path: QuantizedWeight}``, the weights served in the codes they were stored in."""
    key = serving_dtype(dtype)
    stored, compute = SERVING_DTYPES[key]
    policy = precision.Policy(compute, compute, "float32")
    rules = tuple(rules)
    bound = bind(model, policy, rules)
    state = state or {}
    tree = jax.tree_util.tree_map(np.asarray, params)  # cast on the host: no program per shape and dtype
    mode = mode_kwargs(bound, False)
    cast = traverse_util.flatten_dict(cast_variables(bound, {"params": tree, **state}, inputs, **mode)["params"])
    own = bind(model, precision.Policy("float32", "float32", "float32"), (), autocast=False)  # as written
    apply = lambda p: own.apply({"params": p, **state}, inputs, **mode_kwargs(own, False))  # noqa: E731
    axes, only_looked_up, read_by_either = map(traverse_util.flatten_dict, read_axes(
        apply, tree, [(False, True), (True, False), (True, True)]))
    looked_up = frozenset(path for path, a in only_looked_up.items() if a is not None)
    if stored == "int8":
        cast = int8_weights(traverse_util.flatten_dict(tree), cast, axes)
    codes = codes or {}
    if stored == "nf4" and not codes:
        raise SampleError("--dtype nf4 serves weights stored in nf4 codes as they are: none given; give bf16, f16, "
                          "f32 or int8")
    served = laid_out(cast, {path: a for path, a in axes.items() if path not in codes})
    served.update({path: decoding_codes(q.replace(dtype=np.dtype(cast[path].dtype)), read_by_either.get(path))
                   for path, q in codes.items()})
    return ServedWeights(traverse_util.unflatten_dict(served), policy, rules, key, compute, looked_up)


def decoding_codes(q: Any, contracted: tuple[int, ...] | None) -> Any:
    """A stored base's weight ``q`` as served: laid out for decoding
    (:class:`precision.block_codes.BlockCodes`: each code read once by a decode step's product)
    where matmuls contracting one axis of it, and lookups of slices along that axis, read it
    (``contracted``: a tied embedding's too), else as stored."""
    laid = block_codes(q, contracted[0]) if contracted is not None and len(contracted) == 1 else None
    return q if laid is None else laid


def materialized(params: Any) -> Any:
    """``params`` as the model reads them: each int8 weight dequantized, each laid-out one
    transposed back (inside a jitted step: fused into the operand of the matmul that reads it)."""
    return jax.tree_util.tree_map(read_weight, params, is_leaf=is_stored_weight)


def model_reads(params: Any) -> Any:
    """``params`` as a served step hands them to the model: each laid-out one transposed back, each
    int8 or nf4 one as its codes and scales (read by the model's autocast inside the matmuls)."""
    return jax.tree_util.tree_map(in_model_layout, params, is_leaf=is_stored_weight)


def float32_weights(served: Any, params: Any) -> Any:
    """The float32 weights ``served`` stands for, in the model's layout: each int8 one as its
    codes give it back, the rest as ``params`` (the source's float32) hold them (the doctor
    compares the serving dtypes with these)."""
    def full(x, source):
        inner = x.stored if isinstance(x, ContractedLast) else x
        return read_weight(x, jnp.float32) if in_codes(inner) else jnp.asarray(source, jnp.float32)

    return jax.tree_util.tree_map(full, served, params, is_leaf=is_stored_weight)


def tree_bytes(tree: Any) -> int:
    """Bytes of the arrays of ``tree`` (an int8 weight's codes and scales)."""
    return sum(stored_bytes(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_stored_weight))
