"""LoRA adapters on any Flax model, by qwix's model surgery.

qwix (Google's JAX quantization library) intercepts the matmuls of an unmodified
Linen or NNX model and adds ``x @ A @ B * alpha / rank`` beside each one that reads a
param of a matched module, with ``A`` (``<param>_lora_a``, He-uniform) and ``B``
(``<param>_lora_b``, zeros: the adapted model starts equal to the base) as new params
of that module. This module chooses what qwix adapts from a :class:`LoRA` spec and
checks the result; the precision around it is this framework's: the adapters'
matmuls run in the policy's compute dtype like every other, their params get float32
masters and optimizer state, and the base is frozen (:mod:`train.finetune.frozen`).
"""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

from train.finetune.frozen import FreezeError, param_paths

__all__ = ["LoRA", "with_lora", "is_adapter", "adapted_modules", "check_targets", "ADAPTER_SUFFIXES"]

#: qwix names a param's adapters ``<param>_lora_a`` (fan-in x rank) and ``<param>_lora_b`` (rank x fan-out).
ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")
#: The ops adapted by default: Dense, DenseGeneral, Einsum and NNX Linear kernels (not convolutions).
DEFAULT_OPS = ("dot_general", "einsum")


class LoRA(NamedTuple):
    """Low-rank adapters: ``rank`` (> 0), ``alpha`` (the update is scaled by ``alpha / rank``),
    ``targets``: regular expressions, each matching whole module paths (``block_\\d+/attn/.*``)
    whose matmuls get adapters; ``dropout`` on the adapters' input while training."""

    rank: int
    alpha: float | None = None  # None: alpha = rank (a scale of 1)
    #: default ``.+``: every named module; not the model's root, whose path is empty, as is that of a
    #: module a model applies on its own (Hugging Face's tied LM head: ``lm_head.apply({"kernel": ...})``)
    targets: tuple[str, ...] = (".+",)
    dropout: float = 0.0

    def checked(self) -> "LoRA":
        """This spec, or :class:`FreezeError` naming what is wrong and what is valid."""
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise FreezeError(f"finetune.lora.rank must be a positive integer (e.g. 8), got {self.rank!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise FreezeError(f"finetune.lora.alpha must be > 0 (the update is scaled by alpha / rank), "
                              f"got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise FreezeError(f"finetune.lora.dropout must be in [0, 1), got {self.dropout!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets:
            raise FreezeError("finetune.lora.targets is empty: give regular expressions of module paths "
                              "(default: .+, every Dense / Einsum / Linear)")
        for pattern in targets:
            try:
                re.compile(pattern)
            except re.error as e:
                raise FreezeError(f"finetune.lora.targets: {pattern!r} is not a regular expression ({e})") from None
        return self._replace(targets=targets, alpha=float(self.rank if self.alpha is None else self.alpha))


def with_lora(model: Any, lora: LoRA, *sample_inputs: Any, rngs: Any = None, **sample_kwargs: Any) -> Any:
    """``model`` with adapters on the matmuls of the modules ``lora.targets`` match (qwix's
    ``apply_lora_to_model``). A Linen module is returned as a module of the same fields;
    an NNX module (initialised) needs sample inputs (positional and keyword) to create the adapters."""
    import qwix
    from flax import nnx

    lora = lora.checked()
    rules = [qwix.LoraRule(module_path=pattern, op_names=DEFAULT_OPS, rank=lora.rank, alpha=lora.alpha,
                           dropout=lora.dropout) for pattern in lora.targets]
    provider = _linen_einsum_fixed(qwix.LoraProvider)(rules)
    if isinstance(model, nnx.Module):
        return qwix.apply_lora_to_model(model, provider, *sample_inputs, rngs=rngs or nnx.Rngs(0), **sample_kwargs)
    return qwix.apply_lora_to_model(model, provider)


@functools.cache
def _linen_einsum_fixed(provider: type) -> type:
    """qwix's LoRA provider, able to adapt a Linen ``nn.Einsum`` (any ``jnp.einsum`` reading a
    param in a Linen module): qwix 0.1.8 records the adapters' einsum on the module with
    ``setattr`` ("for debugging"), which a Linen module refuses outside ``setup``
    (``SetAttributeFrozenModuleError``). The module takes that attribute as in ``setup``; the
    adapters, their params and their product are qwix's own."""
    import flax.linen as nn

    class LinenEinsumLoraProvider(provider):
        def einsum(self, einsum_str: str, *operands: Any, **kwargs: Any) -> Any:
            stack = nn.module._context.module_stack  # the Linen module being called, as qwix finds it
            module = stack[-1] if stack else None
            if not isinstance(module, nn.Module) or module._state.in_setup:
                return super().einsum(einsum_str, *operands, **kwargs)
            module._state.in_setup = True  # Module.__setattr__ then stores a string as it is
            try:
                return super().einsum(einsum_str, *operands, **kwargs)
            finally:
                module._state.in_setup = False

    return LinenEinsumLoraProvider


def is_adapter(path: str) -> bool:
    """Whether the param at ``path`` is a LoRA adapter (``.../kernel_lora_a``)."""
    return path.rsplit("/", 1)[-1].endswith(ADAPTER_SUFFIXES)


def adapted_modules(params: Any) -> list[str]:
    """The module paths holding adapters, in order."""
    found: dict[str, None] = {}
    for path in param_paths(params):
        if is_adapter(path):
            found[path.rsplit("/", 1)[0] if "/" in path else ""] = None
    return list(found)


def check_targets(params: Any, lora: LoRA) -> None:
    """Each target matched a module with a matmul on a param; else :class:`FreezeError`
    listing the modules that have params (a typo would fine-tune nothing, silently)."""
    adapted = adapted_modules(params)
    for pattern in lora.targets:
        if not any(re.fullmatch(pattern, module) for module in adapted):
            modules = list(dict.fromkeys(p.rsplit("/", 1)[0] for p in param_paths(params)
                                         if "/" in p and not is_adapter(p)))
            shown = ", ".join(modules[:16]) + (f" ... ({len(modules)} in all)" if len(modules) > 16 else "")
            raise FreezeError(f"finetune.lora.targets: {pattern!r} matches no module with a matmul (Dense, "
                              f"DenseGeneral, Einsum, Linear) on its params; the model's modules: {shown}")
