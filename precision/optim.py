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

With ``skip_with="select"`` it adds one pass over the params to what plain
optax does: the check reads each gradient once (one reduction per leaf).
Unscaling fuses into the optimizer's own elementwise pass, and each state leaf
is selected where it is computed, with the updates computed from the selected
state, so the update stays one pass per leaf, in place in donated buffers, with
no second copy of the state for the skip.

When params are stored in half precision (``p=f16``, ``p=bf16``, O2) it keeps a
float32 master copy in its state, updates that, and returns updates that move
the half params to the rounded master, so small updates accumulate instead of
vanishing to rounding. All of it is traceable: no host sync, no Python branch
on traced values.
"""

from __future__ import annotations

import dataclasses

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import source_info_util
from jax.extend.core import Literal

from precision.grad_norms import check_gradients, checked_nonfinite_leaf, leaf_check
from precision.loss_scale import DynamicLossScale, LossScale, select_tree
from precision.policy import cast_to_full
from precision.stored import ROUNDINGS, init_masters, master_updates, stored_in

__all__ = ["MixedPrecisionState", "SKIP_STRATEGIES", "mixed_precision", "find_mixed_precision_state",
           "current_loss_scale", "needs_master_weights"]


class MixedPrecisionState(NamedTuple):
    """Optimizer state of :func:`mixed_precision`; lives in the train state."""

    inner_state: optax.OptState
    loss_scale: LossScale
    master_params: Any  # float32 copy of half params, or None
    grads_finite: jax.Array  # whether the last step's gradients were finite
    grad_norm: jax.Array  # global norm of the last step's unscaled gradients
    # Where a skipped step went wrong (tree_leaves order): i >= 0, leaf i's gradient is not finite (on a
    # CPU, under skip_with="cond" or with sharded gradients, also a leaf whose own squares overflow); -2 - i,
    # every element is finite but the global norm overflowed float32, leaf i the largest (by its norm; on an
    # accelerator under "select", by its largest element); -1, no leaf (nothing went wrong, or only the loss
    # given as ``value`` was not finite).
    nonfinite_leaf: jax.Array
    stored_masters: Any = None  # bfloat16 params as their own masters (precision.stored), or None


def needs_master_weights(params: Any) -> bool:
    """True when any floating param is stored below float32."""
    return any(_is_half(x) for x in jax.tree_util.tree_leaves(params))


SKIP_STRATEGIES = ("auto", "select", "cond")

#: How the gradient check is chosen by platform (a name tests replace to run an accelerator's check on a CPU).
platform_dependent = jax.lax.platform_dependent


def mixed_precision(inner: optax.GradientTransformation,
                    loss_scale: LossScale | None = None,
                    *,
                    max_grad_norm: float | None = None,
                    skip_with: str = "auto",
                    master_dtype: Any = None,
                    master_rounding: str = "stochastic",
                    state_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
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
        flow, the usual choice on accelerators): each state leaf is selected
        where it is made and the updates read the selected state, so the whole
        update is one pass per leaf as in plain optax, in place in donated
        buffers (XLA bytes accessed of a train step within 0.1-2.5% of a
        hand-written optax step, ``python -m benchmarks.wrapper_overhead
        --bytes``); ``"cond"`` runs the update under ``lax.cond``, which
        materialises the updates and costs more bytes, but on XLA:CPU it is
        faster: there the update's fusions read a gradient stored transposed
        (as the backward matmul leaves it) element by element, slowly, while a
        cond passes it in transposed once; ``"auto"`` is cond where the step
        is lowered for a CPU, select elsewhere (decided by the lowering's
        platform, so a step compiled for a GPU from a CPU host gets select).
      master_dtype: the dtype of the master weights of half params: float32
        (``None``, the default: a float32 copy) or bfloat16 (bfloat16 params are
        their own masters: no copy, the float32 update rounded into them by
        ``master_rounding``, see :mod:`precision.stored`).
      master_rounding: ``"stochastic"`` (default), ``"kahan"`` (a bfloat16
        compensation buffer) or ``"nearest"`` (plain rounding: small updates
        vanish), for bfloat16 masters.
      state_dtype: the dtype ``inner``'s floating state is stored in: float32
        (``None``, the default) or bfloat16 (:func:`precision.stored.stored_in`:
        updated in float32, stored with stochastic rounding).

    Returns:
      A transformation whose ``update(scaled_grads, state, params)`` returns
      updates for ``optax.apply_updates(params, updates)``; ``update(...,
      grads_sharded=True)`` for gradients split over devices (FSDP; see ``_gradient_check``).
    """
    loss_scale, inner, lean = _checked(inner, loss_scale, max_grad_norm, skip_with, master_dtype, master_rounding,
                                       state_dtype)

    def init_fn(params):
        master = cast_to_full(params) if needs_master_weights(params) and not lean else None
        return MixedPrecisionState(
            inner_state=inner.init(master if master is not None else cast_to_full(params) if lean else params),
            loss_scale=loss_scale,
            master_params=master,
            grads_finite=jnp.array(True),
            grad_norm=jnp.zeros([], jnp.float32),
            nonfinite_leaf=jnp.array(-1, jnp.int32),
            stored_masters=init_masters(params, master_rounding) if lean else None)

    def update_fn(scaled_grads, state, params=None, *, grads_sharded=False, **extra_args):
        """``extra_args`` go to ``inner``; a ``value`` among them (the loss, optax's name for it) is checked
        for finiteness too: a non-finite loss skips the step even when its gradients are finite."""
        if (state.master_params is not None or state.stored_masters is not None) and params is None:
            raise ValueError("mixed_precision with half-precision params needs `params` in update()")
        grads = cast_to_full(scaled_grads)
        if skip_with != "auto":
            return _update(inner, skip_with, grads, state, params, extra_args, master_rounding, max_grad_norm,
                           grads_sharded)
        # auto: chosen for the platform the step is lowered for, not the host it is traced on
        return jax.lax.platform_dependent(
            grads, state, params, extra_args,
            cpu=lambda *a: _update(inner, "cond", *a, master_rounding, max_grad_norm, grads_sharded),
            default=lambda *a: _update(inner, "select", *a, master_rounding, max_grad_norm, grads_sharded))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _checked(inner: optax.GradientTransformation, loss_scale: Any, max_grad_norm: Any, skip_with: str,
             master_dtype: Any, master_rounding: str, state_dtype: Any
             ) -> tuple[Any, optax.GradientTransformationExtraArgs, bool]:
    """:func:`mixed_precision`'s arguments checked: the loss scale (default dynamic 2**15),
    ``inner`` with clipping and its stored state dtype, whether masters are bfloat16."""
    if loss_scale is None:
        loss_scale = DynamicLossScale(2.0 ** 15)
    if not hasattr(loss_scale, "adjust") or not hasattr(loss_scale, "unscale"):
        raise TypeError(f"loss_scale must be a NoOp/Static/DynamicLossScale, got {loss_scale!r}")
    if max_grad_norm is not None:
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        # Clipped in _update with the norm the wrapper takes anyway (optax.clip_by_global_norm
        # would take it again: a reduction per leaf); identity keeps clip's (empty) state, so
        # checkpoints keep their structure.
        inner = optax.chain(optax.identity(), inner)
    if skip_with not in SKIP_STRATEGIES:
        raise ValueError(f"skip_with must be one of {', '.join(SKIP_STRATEGIES)}, got {skip_with!r}")
    lean = master_dtype is not None and np.dtype(master_dtype) == np.dtype(jnp.bfloat16)
    if master_dtype is not None and np.dtype(master_dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise ValueError(f"master_dtype must be float32 or bfloat16, got {np.dtype(master_dtype)} (float16 "
                         f"masters lose updates to their 10-bit mantissa and 5-bit exponent)")
    if master_rounding not in ROUNDINGS:
        raise ValueError(f"master_rounding must be one of {', '.join(ROUNDINGS)}, got {master_rounding!r}")
    if state_dtype is not None and np.dtype(state_dtype) != np.dtype(jnp.float32):
        inner = stored_in(inner, state_dtype)
    return loss_scale, optax.with_extra_args_support(inner), lean


def _update(inner: optax.GradientTransformationExtraArgs, strategy: str, scaled: Any, state: MixedPrecisionState,
            params: Any, extra_args: dict, master_rounding: str = "stochastic",
            max_grad_norm: float | None = None, grads_sharded: bool = False) -> tuple[Any, MixedPrecisionState]:
    """The wrapper's update from float32 gradients of the scaled loss: check, unscale,
    clip, update (or skip, by ``strategy``: ``"cond"`` or ``"select"``), adjust the scale."""
    check, grad_norm, grads_ok, finite = _gradient_check(scaled, state.loss_scale, extra_args.get("value"),
                                                         strategy, grads_sharded)
    ref = params if params is not None else scaled

    def step(inner_state, master, stored, selected):
        grads = state.loss_scale.unscale(scaled)  # inside the cond's branch: no second copy of the gradients
        if max_grad_norm is not None:  # as optax.clip_by_global_norm; the multiply fuses into the update
            factor = jnp.where(grad_norm < max_grad_norm, 1.0, max_grad_norm / grad_norm)
            grads = jax.tree_util.tree_map(lambda g: g * factor.astype(g.dtype), grads)
        inner_params = master if master is not None else cast_to_full(params) if stored is not None else params
        if selected:
            updates, new_inner = _update_on_selected_state(inner, finite, grads, inner_state, inner_params,
                                                           extra_args)
        else:
            updates, new_inner = inner.update(grads, inner_state, inner_params, **extra_args)
        if master is not None:
            new_master = optax.apply_updates(master, updates)
            master = select_tree(finite, new_master, master) if selected else new_master
            # Updates that land the half params exactly on the rounded master.
            updates = jax.tree_util.tree_map(
                lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32), master, params)
        if stored is not None:  # bfloat16 params, their own masters: the update rounded into them
            updates, new_stored = master_updates(params, updates, stored, master_rounding)
            stored = select_tree(finite, new_stored, stored) if selected else new_stored
        return _cast_updates(updates, ref), new_inner, master, stored

    def skip(inner_state, master, stored):
        return _identity_updates(ref), inner_state, master, stored

    if strategy == "cond":
        updates, new_inner, master, stored = jax.lax.cond(finite, lambda s, m, t: step(s, m, t, False), skip,
                                                          state.inner_state, state.master_params,
                                                          state.stored_masters)
    else:
        # One pass over each leaf, as plain optax: the new state is selected where it is
        # made and the updates are computed from the selected state (equal to the new one
        # whenever they are kept), so nothing reads the old state after its buffer is
        # overwritten and donated buffers need no copies.
        updates, new_inner, master, stored = step(state.inner_state, state.master_params, state.stored_masters, True)
        updates = select_tree(finite, updates, _identity_updates(ref))
    return updates, MixedPrecisionState(
        inner_state=new_inner,
        loss_scale=_adjusted(state.loss_scale, grads_ok, finite),
        master_params=master,
        grads_finite=finite,
        grad_norm=grad_norm,
        nonfinite_leaf=checked_nonfinite_leaf(check, finite),
        stored_masters=stored)


def _gradient_check(scaled: Any, loss_scale: Any, value: Any, strategy: str, grads_sharded: bool) -> tuple:
    """(the gradient check, the unscaled global norm, whether the gradients are finite,
    whether the step is applied: gradients and ``value``, the loss, finite)."""
    # One pass over the gradients gives the metric, the check and the culprit: the norm is
    # finite iff every element is, except for finite gradients whose squares overflow float32
    # (norm > 1.8e19 before unscaling), which count as an overflow too. The norm is taken of the
    # scaled gradients and unscaled as a scalar; the gradients themselves are unscaled inside
    # the update, where the multiply fuses into the optimizer's own elementwise pass. Select
    # lowered for an accelerator: a few reductions over concatenated leaves
    # (precision.grad_norms.check_gradients); for XLA:CPU (whose library sums are faster than
    # one loop), under cond, or with gradients split over devices (FSDP: a concatenation would
    # gather them; train.make_train_step says so with grads_sharded=True): a sum of squares per leaf.
    if strategy == "select" and not grads_sharded:
        check = platform_dependent(scaled, cpu=lambda g: leaf_check(g, one_loop=True), default=check_gradients)
    else:
        check = leaf_check(scaled, one_loop=strategy == "select")
    grad_norm = loss_scale.unscale(jnp.sqrt(check.squares))
    grads_ok = jnp.isfinite(grad_norm)
    finite = grads_ok if value is None else jnp.logical_and(grads_ok, jnp.all(jnp.isfinite(jnp.asarray(value))))
    return check, grad_norm, grads_ok, finite


def _adjusted(scale: Any, grads_finite: jax.Array, applied: jax.Array) -> Any:
    """The loss scale after a step: it moves on the gradients' finiteness alone (a loss
    that is non-finite while its gradients are finite is no overflow a lower scale could
    fix: the scale stays where it is), and counts every skipped step."""
    moved = select_tree(jnp.logical_or(applied, jnp.logical_not(grads_finite)), scale.adjust(grads_finite), scale)
    counted = scale.adjust(applied)
    return dataclasses.replace(moved, skipped_steps=counted.skipped_steps, nonfinite_streak=counted.nonfinite_streak)


def _update_on_selected_state(inner: optax.GradientTransformationExtraArgs, finite: jax.Array, grads: Any,
                              inner_state: Any, params: Any, extra_args: dict) -> tuple[Any, Any]:
    """``inner.update`` with every new state leaf replaced, where it is computed, by
    ``select(finite, new, old)``; returns ``(updates, selected new state)``.

    Every later use of a new state leaf (Adam's update reads its new moments) then
    reads the selected one. Exact: when ``finite`` the selected state is the new
    one; when not, the caller discards the updates and the state is the old one.
    What it saves: selecting the state only at the end leaves the updates reading
    the *old* moments (XLA recomputes the new ones inside the update's fusion),
    after the selected moments were written over the old ones in their donated
    buffers, so XLA copies the whole optimizer state first.
    """
    leaves, treedef = jax.tree_util.tree_flatten((grads, inner_state, params, extra_args))
    old_state = jax.tree_util.tree_leaves(inner_state)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray, np.generic))]

    def call(*traced):
        flat = list(leaves)  # anything else (a Python number among the extra args) stays as it is
        for i, x in zip(arrays, traced):
            flat[i] = x
        g, s, p, e = jax.tree_util.tree_unflatten(treedef, flat)
        return inner.update(g, s, p, **e)

    closed, shapes = jax.make_jaxpr(call, return_shape=True)(*[leaves[i] for i in arrays])
    jaxpr = closed.jaxpr
    n_updates = len(jax.tree_util.tree_leaves(shapes[0]))
    state_vars = jaxpr.outvars[n_updates:]
    inputs = set(jaxpr.invars)
    olds: dict[Any, list] = {}
    for var, old in zip(state_vars, old_state, strict=True):
        if not isinstance(var, Literal) and var not in inputs:
            olds.setdefault(var, []).append(old)
    # A leaf returned in two places of the state with different old values is selected at the end.
    replace = {v: o[0] for v, o in olds.items()
               if len(o) == 1 and jnp.shape(o[0]) == v.aval.shape and jnp.result_type(o[0]) == v.aval.dtype}

    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, [leaves[i] for i in arrays], strict=True))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        bind_params = eqn.primitive.get_bind_params(eqn.params)
        subfuns, bind_params = bind_params if isinstance(bind_params, tuple) else ((), bind_params)  # JAX < 0.5
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outs = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **bind_params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for var, out in zip(eqn.outvars, outs, strict=True):
            if var in replace:
                out = jax.lax.select(finite, out, replace[var])
            env[var] = out
    out = [read(v) for v in jaxpr.outvars]
    selected = [x if v in replace or x is old else jax.lax.select(finite, x, old)
                for v, x, old in zip(state_vars, out[n_updates:], old_state, strict=True)]
    updates = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes[0]), out[:n_updates])
    return updates, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes[1]), selected)


def _first_nonfinite_leaf(grads: Any, finite: jax.Array) -> jax.Array:
    """Index of the first leaf of ``grads`` that is not finite (or whose squared norm
    overflows), ``-2 - i`` when only their global norm overflows (leaf ``i`` the largest),
    -1 when ``finite``; the wrapper reports it as ``nonfinite_leaf``."""
    return checked_nonfinite_leaf(leaf_check(cast_to_full(grads)), finite)


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
