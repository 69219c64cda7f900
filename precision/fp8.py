"""FP8 matmuls: their options, and the state delayed scaling keeps.

A policy with compute ``f8`` (preset ``mixed_fp8``) runs every allow-listed
``dot_general`` at or above ``min_size`` in FP8 (see
:mod:`precision.autocast.scaled.fp8_matmul` for the arithmetic) and every other op in
the fallback dtype (bf16 unless ``compute=f8/f16``). Options:

- ``scaling="current"`` (default): each tensor is scaled from its own amax in
  the step. Nothing to keep; the safest choice.
- ``scaling="delayed"``: scaled from the largest amax of the last ``history``
  steps, this step's amax recorded. The histories are state: a collection
  ``"fp8"`` next to ``"params"`` (``{module path...: {"dot_general_0":
  {"lhs", "rhs", "grad"}}}``). They are updated through differentiation: the
  gradient of the loss with respect to them *is* their new value (Flax's
  "overwrite with gradient"); :func:`train.make_train_step` stores it, takes
  the max over gradient-accumulation micro-steps and keeps the old value on a
  skipped step. Matmuls inside a loop body, a remat block or a custom
  derivative rule are scaled currently (their state could not leave the
  sub-program); :func:`precision.explain` says which.
- ``scaling="rowwise"``: a scale per row of the activation and per column of
  the weight (torchao's rowwise recipe), each from its own amax in the step;
  the float32 product is divided by both. An outlier then costs precision
  only to its own row. The backward quantizes again along the axes its
  products contract, from operands saved in 16 or 32 bits (tensorwise saves
  them in FP8: rowwise keeps twice the activation bytes for the backward).
- ``min_size``: a matmul is FP8 only when each of M, K and N (lhs rows,
  contracted size, rhs columns; batch axes aside) is at least this. FP8 pays
  on a GPU only when the matmul's time outweighs the quantization passes:
  the default, 1024, follows torchao/torchtitan, which leave linear layers
  with small K and N in bf16 as slower in float8. ``0`` takes every matmul.
  (GPT-2-small's d_model 768 is below it: no FP8 matmul at all, and the run
  says so.)
- ``attention``: False (default) keeps attention out of FP8, as Transformer
  Engine and torchao do: a *batched* product of two activations (batch axes
  on both operands, neither a param: q·kᵀ and probabilities·v, and MoE's
  dispatch and combine) stays in the fallback dtype, so softmax probabilities
  are never rounded to E4M3. True takes them (when at or above ``min_size``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Literal, Mapping

import jax
import jax.numpy as jnp

from precision.policy import PolicyError

__all__ = ["Fp8Options", "fp8_options", "as_fp8_options", "FP8_COLLECTION", "DEFAULT_MIN_SIZE", "DEFAULT_HISTORY",
           "SCALINGS", "init_fp8_state", "combine_fp8_states"]

#: The variables collection holding delayed scaling's amax histories.
FP8_COLLECTION = "fp8"
#: Matmuls with any of M, K, N below this stay in the fallback dtype.
DEFAULT_MIN_SIZE = 1024
#: Steps of amax kept by delayed scaling.
DEFAULT_HISTORY = 16
SCALINGS = ("current", "delayed", "rowwise")


@dataclasses.dataclass(frozen=True)
class Fp8Options:
    """How FP8 matmuls are scaled and which matmuls are FP8 (hashable: a static jit argument)."""

    scaling: Literal["current", "delayed", "rowwise"] = "current"
    history: int = DEFAULT_HISTORY
    min_size: int = DEFAULT_MIN_SIZE
    attention: bool = False

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    @property
    def rowwise(self) -> bool:
        return self.scaling == "rowwise"


def fp8_options(scaling: str = "current", history: int = DEFAULT_HISTORY,
                min_size: int = DEFAULT_MIN_SIZE, attention: bool = False) -> Fp8Options:
    """Options for FP8 matmuls: ``scaling`` ``"current"`` | ``"delayed"`` |
    ``"rowwise"``, the amax ``history`` length (delayed), ``min_size``, and
    whether ``attention``'s products may be FP8 (see :mod:`precision.fp8`).
    Bad values raise :class:`precision.PolicyError` naming the valid ones."""
    if not isinstance(scaling, str) or scaling.strip().lower() not in SCALINGS:
        raise PolicyError(f"fp8 scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    for name, value, low in (("history", history, 1), ("min_size", min_size, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PolicyError(f"fp8 {name} must be an integer >= {low}, got {value!r}")
    if not isinstance(attention, bool):
        raise PolicyError(f"fp8 attention must be true or false, got {attention!r}")
    return Fp8Options(scaling.strip().lower(), history, min_size, attention)  # type: ignore[arg-type]


def as_fp8_options(value: "Fp8Options | Mapping[str, Any] | None") -> Fp8Options:
    """``fp8=`` as the functions taking it accept it: options, a dict of their keys, or None (defaults)."""
    if value is None:
        return Fp8Options()
    if isinstance(value, Fp8Options):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {f.name for f in dataclasses.fields(Fp8Options)}
        if unknown:
            raise PolicyError(f"fp8: unknown option(s) {sorted(unknown)}; valid: scaling, history, min_size, attention")
        return fp8_options(**value)
    raise TypeError(f"fp8 must be precision.fp8_options(...), a dict of its keys or None, got {type(value).__name__}")


def init_fp8_state(sites: Iterable[tuple[tuple[str, ...], str]], history: int) -> dict:
    """Zero amax histories for each ``(module path, site name)``: the ``"fp8"`` collection.

    A zero history means "no step recorded yet": that step scales from the
    tensor's own amax, as current scaling does.
    """
    state: dict = {}
    for path, name in sites:
        node = state
        for key in path:
            node = node.setdefault(key, {})
        node[name] = {k: jnp.zeros([history], jnp.float32) for k in ("lhs", "rhs", "grad")}
    return state


def combine_fp8_states(a: Any, b: Any) -> Any:
    """The elementwise max of two updated states (gradient-accumulation micro-steps:
    each recorded its amax in the same slot, the step keeps the largest)."""
    return jax.tree_util.tree_map(jnp.maximum, a, b)
