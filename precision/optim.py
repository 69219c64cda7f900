"""The mixed-precision optax wrapper.

``mixed_precision(inner, loss_scale)`` is an ``optax.GradientTransformation``
that takes the gradients of the *scaled* loss and

1. casts them to float32 and unscales them;
2. checks all of them for finiteness, once (through their global norm, which it
   also reports);
3. runs ``inner`` on the unscaled float32 gradients (so clipping, weight decay
   and Adam's moments all see true gradients, in float32);
4. keeps everything unchanged when a gradient was not finite: the updates are
   ``-0.0`` (the exact additive identity, so params stay bit-identical) and the
   inner state and master weights are selected unchanged;
5. adjusts the loss scale.

When params are stored in half precision (``p=f16``, ``p=bf16``, O2) it keeps a
float32 master copy in its state, updates that, and returns updates that move
the half params to the rounded master, so small updates accumulate instead of
vanishing to rounding. All of it is traceable: no host sync, no Python branch
on traced values.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from precision.loss_scale import DynamicLossScale, LossScale, select_tree
from precision.policy import cast_to_full

__all__ = ["MixedPrecisionState", "SKIP_STRATEGIES", "mixed_precision", "find_mixed_precision_state",
           "current_loss_scale", "needs_master_weights"]


class MixedPrecisionState(NamedTuple):
    """Optimizer state of :func:`mixed_precision`; lives in the train state."""

    inner_state: optax.OptState
    loss_scale: LossScale
    master_params: Any  # float32 copy of half params, or None
    grads_finite: jax.Array  # whether the last step's gradients were finite
    grad_norm: jax.Array  # global norm of the last step's unscaled gradients
    nonfinite_leaf: jax.Array  # index (tree_leaves order) of the first non-finite gradient, -1 if none


def needs_master_weights(params: Any) -> bool:
    """True when any floating param is stored below float32."""
    return any(_is_half(x) for x in jax.tree_util.tree_leaves(params))


SKIP_STRATEGIES = ("auto", "select", "cond")


def mixed_precision(inner: optax.GradientTransformation,
                    loss_scale: LossScale | None = None,
                    *,
                    max_grad_norm: float | None = None,
                    skip_with: str = "auto") -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` for training with scaled half-precision gradients.

    Args:
      inner: any optax transformation; it sees unscaled float32 gradients and
        float32 (master) params, and its state is float32.
      loss_scale: the initial loss scale (``NoOpLossScale``, ``StaticLossScale``
        or ``DynamicLossScale``); default ``DynamicLossScale(2**15)``.
      max_grad_norm: if set, clips unscaled gradients to this global norm before
        ``inner``: the right order (clipping scaled gradients would clip by a
        threshold multiplied by the loss scale).
      skip_with: how a non-finite step is skipped, both bit-exact and traceable:
        ``"select"`` computes the update and selects the old state (no control
        flow, the usual choice on accelerators); ``"cond"`` runs the update
        under ``lax.cond`` (on CPU a select over donated buffers forces copies of
        the whole optimizer state: 1.51x the plain optax step against 1.03x with
        cond for mixed_f16, ``benchmarks/results/wrapper_overhead_cpu.md``);
        ``"auto"`` is cond on CPU, select elsewhere.

    Returns:
      A transformation whose ``update(scaled_grads, state, params)`` returns
      updates for ``optax.apply_updates(params, updates)``.
    """
    if loss_scale is None:
        loss_scale = DynamicLossScale(2.0 ** 15)
    if not hasattr(loss_scale, "adjust") or not hasattr(loss_scale, "unscale"):
        raise TypeError(f"loss_scale must be a NoOp/Static/DynamicLossScale, got {loss_scale!r}")
    if max_grad_norm is not None:
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        inner = optax.chain(optax.clip_by_global_norm(max_grad_norm), inner)
    if skip_with not in SKIP_STRATEGIES:
        raise ValueError(f"skip_with must be one of {', '.join(SKIP_STRATEGIES)}, got {skip_with!r}")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        master = cast_to_full(params) if needs_master_weights(params) else None
        return MixedPrecisionState(
            inner_state=inner.init(master if master is not None else params),
            loss_scale=loss_scale,
            master_params=master,
            grads_finite=jnp.array(True),
            grad_norm=jnp.zeros([], jnp.float32),
            nonfinite_leaf=jnp.array(-1, jnp.int32))

    def update_fn(scaled_grads, state, params=None, **extra_args):
        if state.master_params is not None and params is None:
            raise ValueError("mixed_precision with half-precision params needs `params` in update()")
        scaled = cast_to_full(scaled_grads)
        # One reduction per leaf gives the metric, the check and the culprit: the norm is finite
        # iff every element is, except for finite gradients whose squares overflow float32 (norm >
        # 1.8e19 before unscaling), which count as an overflow too. The norm is taken of the scaled
        # gradients and unscaled as a scalar; the gradients themselves are unscaled inside the
        # update, where the multiply fuses into the optimizer's own elementwise pass.
        squares = _leaf_squared_norms(scaled)
        grad_norm = state.loss_scale.unscale(jnp.sqrt(sum(squares)))
        finite = jnp.isfinite(grad_norm)
        ref = params if params is not None else scaled

        def step(inner_state, master):
            grads = state.loss_scale.unscale(scaled)
            updates, new_inner = inner.update(grads, inner_state,
                                              master if master is not None else params, **extra_args)
            if master is not None:
                master = optax.apply_updates(master, updates)
                # Updates that land the half params exactly on the rounded master.
                updates = jax.tree_util.tree_map(
                    lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32), master, params)
            return _cast_updates(updates, ref), new_inner, master

        def skip(inner_state, master):
            return _identity_updates(ref), inner_state, master

        strategy = skip_with if skip_with != "auto" else ("cond" if jax.default_backend() == "cpu" else "select")
        if strategy == "cond":
            updates, new_inner, master = jax.lax.cond(finite, step, skip, state.inner_state, state.master_params)
        else:
            updates, new_inner, master = select_tree(finite, step(state.inner_state, state.master_params),
                                                     skip(state.inner_state, state.master_params))
        return updates, MixedPrecisionState(
            inner_state=new_inner,
            loss_scale=state.loss_scale.adjust(finite),
            master_params=master,
            grads_finite=finite,
            grad_norm=grad_norm,
            nonfinite_leaf=_first_nonfinite(squares, finite))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _leaf_squared_norms(grads: Any) -> list[jax.Array]:
    return [jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads)] or [jnp.zeros([], jnp.float32)]


def _first_nonfinite(squares: list[jax.Array], finite: jax.Array) -> jax.Array:
    return jnp.where(finite, -1, jnp.argmin(jnp.isfinite(jnp.stack(squares)))).astype(jnp.int32)


def _first_nonfinite_leaf(grads: Any, finite: jax.Array) -> jax.Array:
    """Index of the first leaf of ``grads`` that is not finite (or whose squared norm
    overflows), -1 when ``finite``; the wrapper reports it as ``nonfinite_leaf``."""
    return _first_nonfinite(_leaf_squared_norms(cast_to_full(grads)), finite)


def _is_half(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32


def _cast_updates(updates: Any, ref: Any) -> Any:
    # Half params get float32 updates (apply_updates adds in float32, then rounds once).
    return jax.tree_util.tree_map(lambda u, p: u if _is_half(p) else u.astype(p.dtype), updates, ref)


def _identity_updates(ref: Any) -> Any:
    # x + (-0.0) == x bit for bit for every x, -0.0 included; x + 0.0 would turn -0.0 into +0.0.
    return jax.tree_util.tree_map(
        lambda p: jnp.full(p.shape, -0.0, jnp.float32 if _is_half(p) else p.dtype)
        if jnp.issubdtype(p.dtype, jnp.floating) else jnp.zeros_like(p), ref)


def find_mixed_precision_state(opt_state: Any) -> MixedPrecisionState:
    """The :class:`MixedPrecisionState` inside an optimizer state (also when
    wrapped by ``optax.MultiSteps``, ``optax.chain``...)."""
    found = [s for s in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, MixedPrecisionState))
        if isinstance(s, MixedPrecisionState)]
    if len(found) != 1:
        raise ValueError(f"expected exactly one mixed_precision state in the optimizer state, "
                         f"found {len(found)}; build the optimizer with precision.mixed_precision")
    return found[0]


def current_loss_scale(opt_state: Any) -> LossScale:
    """The loss scale to multiply the next loss by, read from the optimizer state."""
    return find_mixed_precision_state(opt_state).loss_scale


def full_precision_params(params: Any, opt_state: Any) -> Any:
    """The float32 params behind ``params``: the master copy that ``mixed_precision``
    keeps when params are stored in half precision, else ``params`` themselves.
    What to evaluate, export or re-cast after training."""
    master = find_mixed_precision_state(opt_state).master_params
    return params if master is None else master
