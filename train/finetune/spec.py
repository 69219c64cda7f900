"""What a fine-tuning run trains, and how it stores what it does not: :class:`FineTune`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from precision.quantized_weights import is_quantized, logical_size
from train.finetune.frozen import FreezeError, frozen_paths, param_leaves
from train.finetune.lora import LoRA, adapted_modules, check_targets, is_adapter, with_lora

__all__ = ["FineTune", "BASE_DTYPES", "finetune_model", "finetune_frozen", "base_dtype", "finetune_note"]

#: Storage of a frozen base, by name: a floating dtype, or 8-bit / 4-bit codes for its weight
#: matrices (:mod:`precision.quantized_weights`; QLoRA's base), the smaller params in bfloat16.
BASE_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "int8": "int8", "nf4": "nf4"}


class FineTune(NamedTuple):
    """A fine-tuning: ``lora`` adapters (or None: the params themselves are trained),
    ``freeze``: regular expressions (``re.search``) of param paths that are not trained
    (None: with LoRA every param but the adapters, without it none), ``base``: the dtype
    frozen params are stored in, ``"f32"``, ``"bf16"``, ``"f16"``, or ``"int8"`` / ``"nf4"``
    (weight matrices in 8-bit / 4-bit codes, the rest in bfloat16; None: the policy's param dtype)."""

    lora: LoRA | None = None
    freeze: tuple[str, ...] | None = None
    base: str | None = None


def base_dtype(finetune: FineTune | None) -> Any:
    """The numpy dtype frozen params are stored in, ``"int8"`` / ``"nf4"``, or None (the policy's)."""
    if finetune is None or finetune.base is None:
        return None
    if finetune.base not in BASE_DTYPES:
        raise FreezeError(f"finetune.base: {finetune.base!r}; valid: {', '.join(BASE_DTYPES)}")
    stored = BASE_DTYPES[finetune.base]
    return stored if isinstance(stored, str) else np.dtype(stored)


def finetune_model(model: Any, finetune: FineTune | None, sample_input: Any, inputs_as: str = "kwargs") -> Any:
    """``model`` with the fine-tuning's adapters, if it has any (:func:`train.finetune.lora.with_lora`),
    traced on ``sample_input`` (a dict of inputs passed as ``inputs_as`` says: :mod:`train.data.model_inputs`)."""
    if finetune is None or finetune.lora is None:
        return model
    from train.data.model_inputs import call_arguments

    args, kwargs = call_arguments(sample_input, inputs_as)
    return with_lora(model, finetune.lora, *args, **kwargs)


def finetune_frozen(params: Any, finetune: FineTune | None) -> frozenset[str]:
    """The paths of the params ``finetune`` freezes (checked: its targets and patterns
    match the model, something is left to train)."""
    if finetune is None:
        return frozenset()
    base_dtype(finetune)
    if finetune.lora is not None:
        lora = finetune.lora.checked()
        check_targets(params, lora)
        freeze = (".*",) if finetune.freeze is None else finetune.freeze
        return frozen_paths(params, freeze, keep=is_adapter)
    if finetune.base is not None and not finetune.freeze:
        raise FreezeError(f"finetune.base={finetune.base} stores frozen params, and nothing is frozen: give "
                          f"finetune.freeze (param paths) or finetune.lora")
    return frozen_paths(params, finetune.freeze or ())


def finetune_note(params: Any, frozen: frozenset[str]) -> str | None:
    """The run header's line on what is trained: adapters, trained and frozen params, the
    frozen ones' storage (None when every param is trained)."""
    if not frozen:
        return None
    leaves = param_leaves(params)
    total = sum(logical_size(x) for x in leaves.values()) or 1
    trained = sum(logical_size(x) for p, x in leaves.items() if p not in frozen)
    dtypes = sorted({_stored(leaves[p]) for p in frozen if p in leaves})
    modules = adapted_modules(params)
    lora = f"LoRA adapters on {len(modules)} module{'s' * (len(modules) != 1)} ({_first(modules)}); " if modules else ""
    return (f"fine-tuning: {lora}{trained:,} of {total:,} params trained ({100 * trained / total:.2g}%); "
            f"{len(frozen)} frozen arrays in {', '.join(dtypes)} with no gradient, master or optimizer state")


def _stored(x: Any) -> str:
    return f"{x.code} codes" if is_quantized(x) else str(np.dtype(x.dtype))


def _first(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
