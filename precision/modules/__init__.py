"""Applying a precision policy to unmodified Flax modules (Linen and NNX).

``with_policy(module, policy, rules)`` returns an object with the module's own
contract (``init`` / ``apply`` for Linen, a callable ``nnx.Module`` for NNX):
params are stored in the param dtype, outputs leave in the output dtype, and
the forward pass runs under :func:`precision.autocast`: every matmul and
convolution in the compute dtype whatever ``dtype=`` its layers pin, softmax,
norm statistics and other deny-listed ops in float32. Modules a rule matches
compute in the rule's dtype (a region, :mod:`precision.autocast.regions`). The casts sit
inside the differentiated function, so gradients with respect to float32
params come back in float32. Module state other than params (BatchNorm
statistics) stays in its own dtype whatever the compute dtype.

``autocast=False`` gives the older, module-level behaviour: params and inputs
cast to the compute dtype at the module boundary, which layers that pin their
``dtype`` undo (``precision.explain`` reports it).
"""

from __future__ import annotations

from typing import Any, Iterable

import flax.linen as nn
from flax import nnx

from precision.autocast.op_lists import OpLists
from precision.fp8 import Fp8Options, as_fp8_options
from precision.int8 import Int8Options, as_int8_options
from precision.modules.common import resolve
from precision.modules.linen_wrapper import LinenWithPolicy
from precision.modules.nnx_wrapper import NNXWithPolicy
from precision.policy import Policy

__all__ = ["with_policy", "LinenWithPolicy", "NNXWithPolicy"]


def with_policy(module: Any, policy: "str | Policy", rules: "Iterable[Any] | None" = None, *,
                autocast: bool = True, ops: OpLists | None = None, fp8: "Fp8Options | dict | None" = None,
                reduce_dtype: Any = None, int8: "Int8Options | dict | None" = None):
    """Puts an unmodified Flax module under a precision policy.

    Args:
      module: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
      policy: a :class:`Policy`, a ``jmp.Policy`` or a spec string / preset.
      rules: ordered ``(pattern, policy)`` pairs, first match wins (see
        :mod:`precision.rules`). ``None`` means the preset's rules when
        ``policy`` is a preset name (O1 adds softmax, O3 has none), otherwise
        normalization layers in float32. Pass ``[]`` for no rules.
      autocast: run the forward pass under :func:`precision.autocast`, so layers
        that pin ``dtype=float32`` still compute in the policy's dtype (default).
        ``False`` only casts params and inputs at the module boundary.
      ops: autocast's allow/deny lists (:func:`precision.op_lists`).
      fp8: :func:`precision.fp8_options` (scaling, history, min_size) for the
        FP8 matmuls of a policy or rule whose compute is ``f8``.
      int8: :func:`precision.int8_options` (backward, stochastic_rounding,
        min_size, attention) for the int8 matmuls of a policy or rule whose
        compute is ``int8``.
      reduce_dtype: the dtype the gradients of params read by half-precision
        matmuls, bias adds and embedding lookups are produced in (``"f32"``,
        ``"bf16"``, ``"f16"``; ``None``: the compute dtype). A data-parallel
        step reduces each such gradient across devices where it is produced,
        so this is the dtype gradients travel in; ``"f32"`` also hands them to
        the float32 masters unrounded (:mod:`precision.autocast.reductions`).

    Returns:
      A :class:`LinenWithPolicy` (``init`` / ``apply``) or an
      :class:`NNXWithPolicy` (call it like the module).
    """
    resolved_policy, resolved_rules, ops = resolve(policy, rules, ops)
    options, int8_options = as_fp8_options(fp8), as_int8_options(int8)
    if isinstance(module, nn.Module):
        return LinenWithPolicy(module, resolved_policy, resolved_rules, autocast=bool(autocast), ops=ops, fp8=options,
                               reduce_dtype=reduce_dtype, int8=int8_options)
    if isinstance(module, nnx.Module):
        return NNXWithPolicy(module, resolved_policy, resolved_rules, autocast=bool(autocast), ops=ops, fp8=options,
                             reduce_dtype=reduce_dtype, int8=int8_options)
    raise TypeError(f"with_policy expects a flax.linen.Module or flax.nnx.Module, got "
                    f"{type(module).__name__}")
