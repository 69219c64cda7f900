"""A decode step in five kernels a layer (``--decode-kernels fused``), for the models written for it.

Hugging Face's Flax Llama (and its family: Mistral) and GPT-2 decode through their own
modules: XLA makes sixteen (GPT-2) to twenty (Llama) kernels of each layer.
:func:`fused_decoder` wraps the model's decoder (:mod:`train.serving.cache`) so that a step of
one token runs the layers on :mod:`train.serving.decode_kernels` and
:mod:`train.serving.decode_attention` instead (each family's step:
:mod:`train.serving.fused_llama`, :mod:`train.serving.fused_gpt2`), on the same weights and the
same cache (the model's ``cached_key``, ``cached_value`` and ``cache_index`` per layer): the
prompt still goes through the model's own modules, and a cache either wrote the other reads.

Its numerics are the model's in the served dtype: weights, normed activations and each
projection's result rounded to it, sums in float32, the residual stream and the softmax in
float32. :func:`fused_refusal` says why a model or a batch cannot take it (the step then runs
the model's modules, as with ``xla``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from precision.channel_weights import is_channel_int8
from train.serving import decode_kernels as kernels
from train.serving import fused_gpt2, fused_llama
from train.serving.layout import ContractedLast, is_stored_weight

__all__ = ["DECODE_KERNELS", "FAMILIES", "fused_refusal", "fused_decoder"]

#: ``--decode-kernels``: the model's own modules compiled by XLA, or the fused kernels.
DECODE_KERNELS = ("xla", "fused")
#: The Hugging Face ``model_type`` values the fused kernels are written for, and each one's step.
FAMILIES: dict[str, ModuleType] = {"llama": fused_llama, "mistral": fused_llama, "gpt2": fused_gpt2}
_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def fused_refusal(module: Any, params: Any, batch: int = 1) -> str | None:
    """Why ``module`` (the served model) at ``batch`` rows cannot decode with the fused
    kernels, or None when it can."""
    config = getattr(module, "config", None)
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        return (f"the fused decode kernels are written for Hugging Face {', '.join(sorted(set(FAMILIES)))} "
                f"models; {type(module).__name__} is not one")
    refusal = family.refusal(config)
    if refusal:
        return refusal
    flat = traverse_util.flatten_dict(params, is_leaf=lambda _, x: is_stored_weight(x))
    for path, w in flat.items():
        if path[-1] == "kernel" and not _readable(family.kernel_form(w)):
            return (f"the fused decode kernels read weights stored (out, in), as float arrays or int8 with a "
                    f"scale a row; {'/'.join(path)} is {type(w).__name__}")
    return _shape_refusal(family, config, batch)


def _shape_refusal(family: ModuleType, config: Any, batch: int) -> str | None:
    """Why the kernels' blocks do not fit ``config``'s widths at ``batch`` rows, or None."""
    hidden, head, *widths = family.widths(config)
    if kernels.fits(batch, hidden, head, *widths):
        return None
    return (f"the fused decode kernels need the batch and the head width powers of two (a head at least 16) and "
            f"every width a multiple of 16: batch {batch}, head {head}, widths {hidden}, {tuple(widths)}")


def fused_decoder(decoder: Any, module: Any) -> Any:
    """``decoder`` (a Hugging Face model's, :class:`train.serving.cache.Decoder`) with its
    one-token steps on the fused kernels (the model checked by :func:`fused_refusal` beforehand);
    batches the kernels' blocks do not fit, and prompts, go through the model's modules."""
    config = module.config
    family = FAMILIES[config.model_type]
    inner, step = decoder.forward, family.step(config)

    def forward(params, cache, tokens, index):
        if tokens.shape[1] != 1 or _shape_refusal(family, config, tokens.shape[0]):  # the model: refused at init
            return inner(params, cache, tokens, index)
        return step(_kernel_forms(family, params), cache, tokens[:, 0], index)

    return decoder._replace(forward=forward)


def _readable(w: Any) -> bool:
    """Whether the kernels read ``w`` (a kernel's ``(out, in)`` form, or None): floats or int8 codes."""
    return w is not None and (is_channel_int8(w) or (np.ndim(w) == 2 and np.dtype(w.dtype) in _FLOATS))


def _kernel_forms(family: ModuleType, params: Any) -> Any:
    """The served weights with each kernel in its ``(out, in)`` form (array or int8 codes)."""
    return jax.tree_util.tree_map(lambda w: family.kernel_form(w) if isinstance(w, ContractedLast) else w, params,
                                  is_leaf=lambda x: isinstance(x, ContractedLast))
