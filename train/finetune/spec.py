"""What a fine-tuning run trains, and how it stores what it does not: :class:`FineTune`."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from train.finetune.frozen import FreezeError, frozen_paths, param_paths
from train.finetune.lora import LoRA, adapted_modules, check_targets, is_adapter, with_lora

__all__ = ["FineTune", "BASE_DTYPES", "finetune_model", "finetune_frozen", "base_dtype", "finetune_note"]

#: Storage of a frozen base, by name.
BASE_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


class FineTune(NamedTuple):
    """A fine-tuning: ``lora`` adapters (or None: the params themselves are trained),
    ``freeze``: regular expressions (``re.search``) of param paths that are not trained
    (None: with LoRA every param but the adapters, without it none), ``base``: the dtype
    frozen params are stored in, ``"f32"``, ``"bf16"`` or ``"f16"`` (None: the policy's
    param dtype)."""

    lora: LoRA | None = None
    freeze: tuple[str, ...] | None = None
    base: str | None = None


def base_dtype(finetune: FineTune | None) -> Any:
    """The numpy dtype frozen params are stored in, or None (the policy's)."""
    if finetune is None or finetune.base is None:
        return None
    if finetune.base not in BASE_DTYPES:
        raise FreezeError(f"finetune.base: {finetune.base!r}; valid: {', '.join(BASE_DTYPES)}")
    return np.dtype(BASE_DTYPES[finetune.base])


def finetune_model(model: Any, finetune: FineTune | None, sample_input: Any) -> Any:
    """``model`` with the fine-tuning's adapters, if it has any (:func:`train.finetune.lora.with_lora`)."""
    if finetune is None or finetune.lora is None:
        return model
    from train.data.model_inputs import call_arguments

    args, kwargs = call_arguments(sample_input)
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
    import jax

    leaves = {path: x for path, x in zip(param_paths(params), jax.tree_util.tree_leaves(params))}
    total = sum(math.prod(x.shape) for x in leaves.values()) or 1
    trained = sum(math.prod(x.shape) for p, x in leaves.items() if p not in frozen)
    dtypes = sorted({str(np.dtype(leaves[p].dtype)) for p in frozen if p in leaves})
    modules = adapted_modules(params)
    lora = f"LoRA adapters on {len(modules)} module{'s' * (len(modules) != 1)} ({_first(modules)}); " if modules else ""
    return (f"fine-tuning: {lora}{trained:,} of {total:,} params trained ({100 * trained / total:.2g}%); "
            f"{len(frozen)} frozen arrays in {', '.join(dtypes)} with no gradient, master or optimizer state")


def _first(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
