"""Loss scales: multiply the loss before differentiation so half-precision
gradients do not flush to zero, divide the gradients after.

Names and signatures follow jmp (``NoOpLossScale``, ``StaticLossScale``,
``DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale)``,
``.scale``, ``.unscale``, ``.adjust``, ``all_finite``, ``select_tree``) so code
written against jmp runs with ``import precision as jmp``. Beyond jmp:

* every loss scale counts skipped (non-finite) steps and the current streak of
  consecutive non-finite steps;
* the dynamic scale has an optional separate backoff factor (by default it
  divides by ``factor``, as jmp), a ``max_loss_scale`` (by default 2**24, or the
  initial scale when that is larger) and optional hysteresis (consecutive
  overflows tolerated before backing off);
* all state is float32 / int32 whatever the compute dtype, and every field is a
  pytree leaf or static metadata, so it survives ``jax.jit``, ``tree_map`` and
  checkpoints.

Every construction jmp accepts is accepted (an integral float ``period``, a zero
``min_loss_scale`` or static scale, an initial scale above 2**24 or below
``min_loss_scale``); only values that cannot describe a loss scale at all
(negative, inf/nan, a non-integral period, a factor below 1) are rejected.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

__all__ = [
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "LossScale",
    "all_finite",
    "select_tree",
    "get_loss_scale",
    "LOSS_SCALE_KINDS",
    "ScalarBoolError",
]

#: The default cap of a dynamic scale, unless its initial scale is larger.
DEFAULT_MAX_LOSS_SCALE = 2.0 ** 24


class ScalarBoolError(TypeError, AssertionError):
    """A predicate that should be a scalar bool array is not.

    Both a ``TypeError`` and, because jmp asserts here, an ``AssertionError``,
    so code written against either library catches it.
    """


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.float32)


def _i32(x: Any) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.int32)


def _pytree(data_fields: tuple[str, ...], meta_fields: tuple[str, ...] = ()):
    """Registers a frozen dataclass as a pytree with named leaves.

    Unflattening bypasses ``__init__`` (JAX may unflatten with placeholder
    leaves), so validation and dtype conversion only run for user construction.
    """

    def register(cls):
        def flatten_with_keys(obj):
            children = tuple((jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in data_fields)
            return children, tuple(getattr(obj, f) for f in meta_fields)

        def flatten(obj):
            return tuple(getattr(obj, f) for f in data_fields), tuple(getattr(obj, f) for f in meta_fields)

        def unflatten(meta, children):
            obj = object.__new__(cls)
            for name, value in zip(data_fields + meta_fields, tuple(children) + tuple(meta)):
                object.__setattr__(obj, name, value)
            return obj

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
        return cls

    return register


_F32_MAX = float(np.finfo(np.float32).max)


def _float32_scale(v: float | None) -> bool:
    """A loss-scale value stored in float32: finite there too, and not negative."""
    return v is None or (math.isfinite(v) and 0 <= v <= _F32_MAX)


def _concrete(x: Any) -> float | None:
    try:
        return float(np.asarray(x))
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def _updated_counters(grads_finite: jax.Array, skipped_steps: jax.Array,
                      nonfinite_streak: jax.Array) -> tuple[jax.Array, jax.Array]:
    finite = _check_scalar_bool(grads_finite, "grads_finite")
    bad = jnp.logical_not(finite).astype(jnp.int32)
    return skipped_steps + bad, (nonfinite_streak + 1) * bad


def _check_scalar_bool(pred: Any, name: str) -> jax.Array:
    pred = jnp.asarray(pred)
    if pred.ndim != 0 or pred.dtype != jnp.bool_:
        raise ScalarBoolError(f"{name}: expected boolean scalar, i.e. a scalar bool array (e.g. from "
                              f"all_finite), got shape {pred.shape} dtype {pred.dtype}")
    return pred


def _is_number(x: Any) -> bool:
    return not isinstance(x, (bool, np.bool_, str, bytes)) and _concrete(x) is not None


def _integral(x: Any) -> int | None:
    """``x`` as an int when it is a whole number (``5``, ``5.``, ``np.int32(5)``), else None."""
    if not _is_number(x):
        return None
    v = _concrete(x)
    return int(v) if math.isfinite(v) and v.is_integer() else None


def _scale_tree(tree: T, factor: jax.Array) -> T:
    return jax.tree_util.tree_map(lambda x: x * factor, tree)


@_pytree(("skipped_steps", "nonfinite_streak"))
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No scaling (for f32 and bf16 compute); still counts non-finite steps."""

    skipped_steps: jax.Array = dataclasses.field(default_factory=lambda: _i32(0))
    nonfinite_streak: jax.Array = dataclasses.field(default_factory=lambda: _i32(0))

    @property
    def loss_scale(self) -> jax.Array:
        """Always 1."""
        return _f32(1.0)

    def scale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite: jax.Array) -> "NoOpLossScale":
        """Counts a skipped step when gradients were not finite."""
        skipped, streak = _updated_counters(grads_finite, self.skipped_steps, self.nonfinite_streak)
        return dataclasses.replace(self, skipped_steps=skipped, nonfinite_streak=streak)


@_pytree(("loss_scale", "skipped_steps", "nonfinite_streak"))
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """Scales by a fixed constant; counts non-finite steps."""

    loss_scale: jax.Array
    skipped_steps: jax.Array = dataclasses.field(default_factory=lambda: _i32(0))
    nonfinite_streak: jax.Array = dataclasses.field(default_factory=lambda: _i32(0))

    def __post_init__(self):
        value = _concrete(self.loss_scale)
        if not _float32_scale(value):
            raise ValueError(f"StaticLossScale: loss_scale must be finite and >= 0 in float32 (at most "
                             f"{_F32_MAX:.4g}), got {value}")
        object.__setattr__(self, "loss_scale", _f32(self.loss_scale))

    def scale(self, tree: T) -> T:
        """Multiplies every leaf by the loss scale."""
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Divides every leaf by the loss scale (result in at least float32)."""
        return _scale_tree(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
        """Keeps the scale; counts a skipped step when gradients were not finite."""
        skipped, streak = _updated_counters(grads_finite, self.skipped_steps, self.nonfinite_streak)
        return dataclasses.replace(self, skipped_steps=skipped, nonfinite_streak=streak)


_DYNAMIC_DATA = ("loss_scale", "counter", "min_loss_scale", "max_loss_scale",
                 "hysteresis_left", "skipped_steps", "nonfinite_streak")
_DYNAMIC_META = ("period", "factor", "backoff_factor", "hysteresis")


@_pytree(_DYNAMIC_DATA, _DYNAMIC_META)
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """The largest loss scale that keeps gradients finite, found while training.

    After ``period`` consecutive finite steps the scale grows by ``factor`` (up
    to ``max_loss_scale``); after ``hysteresis`` consecutive non-finite steps it
    shrinks by ``backoff_factor`` (down to ``min_loss_scale``).

    As in jmp, ``factor`` works both ways: unless ``backoff_factor`` is given,
    a non-finite step divides the scale by ``factor``. ``max_loss_scale``
    defaults to 2**24, or to the initial scale when that is larger; growth never
    reaches inf either way.
    """

    loss_scale: jax.Array
    counter: jax.Array = dataclasses.field(default_factory=lambda: _i32(0))
    period: int = 2000
    factor: float = 2
    min_loss_scale: jax.Array = dataclasses.field(default_factory=lambda: _f32(1.0))
    _: dataclasses.KW_ONLY
    backoff_factor: float | None = None
    max_loss_scale: jax.Array | None = None
    hysteresis: int = 1
    hysteresis_left: jax.Array | None = None
    skipped_steps: jax.Array = dataclasses.field(default_factory=lambda: _i32(0))
    nonfinite_streak: jax.Array = dataclasses.field(default_factory=lambda: _i32(0))

    def __post_init__(self):
        self._validate()
        set_ = functools.partial(object.__setattr__, self)
        set_("loss_scale", _f32(self.loss_scale))
        set_("min_loss_scale", _f32(self.min_loss_scale))
        if self.max_loss_scale is None:
            set_("max_loss_scale", jnp.maximum(_f32(DEFAULT_MAX_LOSS_SCALE), self.loss_scale))
        else:
            set_("max_loss_scale", _f32(self.max_loss_scale))
        if not isinstance(self.factor, (int, float)):  # np / jax scalars: static metadata must hash
            set_("factor", float(_concrete(self.factor)))
        if self.backoff_factor is None:
            set_("backoff_factor", 1.0 / float(self.factor))
        set_("counter", _i32(self.counter))
        set_("period", _integral(self.period))
        set_("hysteresis", _integral(self.hysteresis))
        set_("hysteresis_left", _i32(self.hysteresis if self.hysteresis_left is None
                                     else self.hysteresis_left))
        set_("skipped_steps", _i32(self.skipped_steps))
        set_("nonfinite_streak", _i32(self.nonfinite_streak))

    def _validate(self) -> None:
        def fail(what):
            raise ValueError(f"DynamicLossScale: {what}")

        period, hysteresis = _integral(self.period), _integral(self.hysteresis)
        if period is None or period < 1:
            fail(f"period must be a whole number >= 1, got {self.period!r}")
        if hysteresis is None or hysteresis < 1:
            fail(f"hysteresis must be a whole number >= 1, got {self.hysteresis!r}")
        factor = _concrete(self.factor) if _is_number(self.factor) else None
        if factor is None or not (math.isfinite(factor) and factor >= 1):
            fail(f"factor must be a number > 1 (or 1: a scale that never moves), got {self.factor!r}")
        backoff = self.backoff_factor
        if backoff is not None and not (isinstance(backoff, (int, float)) and not isinstance(backoff, bool)
                                        and 0 < backoff <= 1):
            fail(f"backoff_factor must be a number in (0, 1], got {backoff!r}")
        scale, lo = _concrete(self.loss_scale), _concrete(self.min_loss_scale)
        hi = None if self.max_loss_scale is None else _concrete(self.max_loss_scale)
        for name, v in (("loss_scale", scale), ("min_loss_scale", lo)):
            if not _float32_scale(v):
                fail(f"{name} must be finite and >= 0 in float32 (at most {_F32_MAX:.4g}), got {v}")
        if not _float32_scale(hi) or hi == 0:
            fail(f"max_loss_scale must be finite and > 0 in float32 (at most {_F32_MAX:.4g}), got {hi}")
        if lo is not None and hi is not None and lo > hi:
            fail(f"min_loss_scale ({lo}) must not exceed max_loss_scale ({hi})")
        if scale is not None and hi is not None and scale > hi:
            fail(f"loss_scale ({scale}) must not exceed max_loss_scale ({hi}); leave max_loss_scale "
                 f"unset for a cap of max(2**24, loss_scale)")

    def scale(self, tree: T) -> T:
        """Multiplies every leaf by the loss scale."""
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Divides every leaf by the loss scale (result in at least float32)."""
        return _scale_tree(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """The next state: grow after ``period`` finite steps, back off after
        ``hysteresis`` consecutive non-finite ones. Traceable, no host sync."""
        finite = _check_scalar_bool(grads_finite, "grads_finite")
        grow = jnp.logical_and(finite, self.counter == self.period - 1)
        grown = jnp.minimum(self.loss_scale * jnp.float32(self.factor), self.max_loss_scale)
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        left = self.hysteresis_left - 1
        back_off = jnp.logical_and(jnp.logical_not(finite), left <= 0)
        if self.backoff_factor == 1.0 / self.factor:  # jmp's back-off: an exact division by factor
            shrunk = self.loss_scale / jnp.float32(self.factor)
        else:
            shrunk = self.loss_scale * jnp.float32(self.backoff_factor)
        shrunk = jnp.maximum(shrunk, self.min_loss_scale)
        loss_scale = jnp.where(grow, grown, jnp.where(back_off, shrunk, self.loss_scale))
        counter = jnp.where(finite, (self.counter + 1) % self.period, 0)
        hysteresis_left = jnp.where(jnp.logical_or(finite, back_off), self.hysteresis, left)
        skipped, streak = _updated_counters(finite, self.skipped_steps, self.nonfinite_streak)
        return dataclasses.replace(
            self, loss_scale=loss_scale, counter=counter.astype(jnp.int32),
            hysteresis_left=hysteresis_left.astype(jnp.int32),
            skipped_steps=skipped, nonfinite_streak=streak)


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: True when every element of every leaf is finite."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred: jax.Array, a: T, b: T) -> T:
    """``a`` where the scalar bool ``pred`` is True, else ``b``, leaf by leaf,
    bit-exact and without a host sync."""
    pred = _check_scalar_bool(pred, "select_tree's pred")
    return jax.tree_util.tree_map(lambda x, y: jax.lax.select(pred, x, y), a, b)


LOSS_SCALE_KINDS = ("auto", "none", "static", "dynamic")


def get_loss_scale(kind: str = "auto", policy: Any = None, *, initial_scale: float = 2.0 ** 15,
                   **dynamic_kwargs: Any) -> LossScale:
    """Builds a loss scale by name: ``none``, ``static``, ``dynamic`` or ``auto``.

    ``auto`` (needs ``policy``) is dynamic when the policy computes or stores
    params in float16, and none for bfloat16 and float32, whose range makes
    scaling unnecessary. ``dynamic_kwargs`` go to :class:`DynamicLossScale`.
    """
    from precision.policy import get_policy  # local: loss scales do not depend on policies otherwise

    if not isinstance(kind, str) or kind.strip().lower() not in LOSS_SCALE_KINDS:
        raise ValueError(f"Unknown loss scale {kind!r}; valid: {', '.join(LOSS_SCALE_KINDS)}")
    kind = kind.strip().lower()
    if kind == "auto":
        if policy is None:
            raise ValueError("loss scale 'auto' needs the policy to decide (dynamic for float16)")
        p = get_policy(policy)
        f16 = np.dtype(jnp.float16)
        kind = "dynamic" if f16 in (p.compute_dtype, p.param_dtype) else "none"
    if kind != "dynamic" and dynamic_kwargs:
        raise ValueError(f"{sorted(dynamic_kwargs)} only apply to a dynamic loss scale, not {kind!r}")
    if kind == "none":
        return NoOpLossScale()
    if kind == "static":
        return StaticLossScale(initial_scale)
    return DynamicLossScale(initial_scale, **dynamic_kwargs)
