"""From the optimizer section to optax objects: the optimizer and the learning-rate
schedule a config names, built-in, any of optax's by name, or the user's own factory
(``path/to/file.py:make``, ``package.module:make``).

Each is checked when built, so a bad one fails in one line before anything
compiles: a reference that does not resolve, an argument the function does not
take (see :mod:`train.config.optimizer` for what each gets), a factory returning
something else than a GradientTransformation (a schedule: than a function of the
step), and an optimizer whose update needs arguments a train step does not give
(a step gives the gradients, the state, the params, and ``value=`` the loss).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.config.errors import ConfigError
from train.config.optimizer import SCHEDULE_FIELDS, optimizer_arguments, schedule_arguments, takes
from train.experiment.names import Resolved, resolve_optimizer, resolve_schedule
from train.references import one_line

__all__ = ["build_optimizer", "build_schedule", "optimizer_from", "schedule_from"]

#: A small tree of params an optimizer is tried on when built (abstractly: nothing is computed).
_PROBE_PARAMS = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
#: The largest optimizer.lr accepted: far above any rate that trains (typical: 1e-5 to 1), far below
#: float32's overflow (3.4e38, where the schedule's rate becomes inf and every step non-finite).
MAX_LEARNING_RATE = 1e3
#: YAML 1.1 reads 1e-3 (no dot) as a string: an option's string of this form is a number.
_EXPONENT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def build_optimizer(opt: Any, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule | None]:
    """The optax optimizer and learning-rate schedule an optimizer config describes, for a
    run of ``steps`` steps. The schedule is what a run logs as the learning rate; it is
    None for a user's factory that takes no ``learning_rate`` (its rate is its own).

    Raises:
      ConfigError: one line naming the key, for a reference that does not resolve, an
        argument the function does not take or needs, or an optimizer that cannot
        update a train state.
    """
    return optimizer_from(opt, steps, resolve_optimizer(opt.name), resolve_schedule(opt.schedule))


def optimizer_from(opt: Any, steps: int, optimizer: Resolved, schedule_name: Resolved
                   ) -> tuple[optax.GradientTransformation, optax.Schedule | None]:
    """:func:`build_optimizer` from ``optimizer.name`` and ``optimizer.schedule`` resolved
    (:mod:`train.experiment.names`)."""
    schedule = schedule_from(opt, steps, schedule_name)
    if optimizer.target is None:  # a built-in (its options were checked with the config)
        return _builtin(opt, schedule), schedule
    fn, what = optimizer.target, optimizer.label
    kwargs = {k: _plain(v) for k, v in optimizer_arguments(opt, fn, what).items()}
    if takes(fn, "learning_rate"):
        kwargs["learning_rate"] = schedule
    else:
        given = [f"optimizer.{k}" for k in SCHEDULE_FIELDS if k in opt.model_fields_set]
        if given:
            raise ConfigError(f"{given[0]}: {what} takes no learning_rate, so {', '.join(given)} would be unused; "
                              f"give it a learning_rate argument (it gets the schedule) or unset them "
                              f"({' '.join(k + '=null' for k in given)} on the command line, or remove them from "
                              f"the file)")
        schedule = None
    tx = _call(fn, kwargs, what, "optimizer.name")
    if not (isinstance(tx, optax.GradientTransformation) or callable(getattr(tx, "init", None))
            and callable(getattr(tx, "update", None))):
        raise ConfigError(f"optimizer.name: {what} returned a {type(tx).__name__}, not an optax "
                          f"GradientTransformation")
    _check_update(tx, what)
    return tx, schedule


def _builtin(opt: Any, schedule: optax.Schedule) -> optax.GradientTransformation:
    """adam, adamw, lion, sgd from the config's fields, as they always were, and the options."""
    options = {k: _plain(v) for k, v in opt.options.items()}
    if opt.name == "adam":
        return optax.adam(schedule, opt.b1, opt.b2, opt.eps, **options)
    if opt.name == "adamw":
        return optax.adamw(schedule, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay, **options)
    if opt.name == "lion":
        return optax.lion(schedule, opt.b1, opt.b2, weight_decay=opt.weight_decay, **options)
    tx = optax.sgd(schedule, opt.momentum or None, opt.nesterov, **options)
    return optax.chain(optax.add_decayed_weights(opt.weight_decay), tx) if opt.weight_decay else tx


def build_schedule(opt: Any, steps: int) -> optax.Schedule:
    """The learning-rate schedule of an optimizer config for a run of ``steps`` steps: the
    config's schedule after a linear warmup from 0 over ``warmup_steps`` (unless the
    schedule takes ``warmup_steps`` itself)."""
    return schedule_from(opt, steps, resolve_schedule(opt.schedule))


def schedule_from(opt: Any, steps: int, resolved: Resolved) -> optax.Schedule:
    """:func:`build_schedule` from ``optimizer.schedule`` resolved (:mod:`train.experiment.names`)."""
    _check_learning_rate(opt.lr)
    warmup = min(opt.warmup_steps, steps)
    if resolved.name == "constant":
        after = optax.constant_schedule(opt.lr)
    elif resolved.name == "cosine":
        after = optax.cosine_decay_schedule(opt.lr, max(steps - warmup, 1), alpha=opt.min_lr / opt.lr)
    elif resolved.name == "linear":
        after = optax.linear_schedule(opt.lr, opt.min_lr, max(steps - warmup, 1))
    else:
        fn, what = resolved.target, resolved.label
        kwargs, own_warmup = schedule_arguments(opt, fn, what, steps)
        after = _call(fn, {k: _plain(v) for k, v in kwargs.items()}, what, "optimizer.schedule")
        _check_schedule(after, what)
        if own_warmup:
            return after
    return (optax.join_schedules([optax.linear_schedule(0.0, opt.lr, warmup), after], [warmup])
            if warmup else after)


def _check_learning_rate(lr: float) -> None:
    """A learning rate that could train: finite and at most :data:`MAX_LEARNING_RATE`."""
    if not (np.isfinite(lr) and lr <= MAX_LEARNING_RATE):
        in_float32 = lr > float(np.finfo(np.float32).max)
        overflow = " (in float32, where the schedule computes it, it is inf)" if in_float32 else ""
        raise ConfigError(f"optimizer.lr: {lr:g} is far beyond any learning rate that trains{overflow}: its first "
                          f"updates would blow up the params; valid: at most {MAX_LEARNING_RATE:g} "
                          f"(typical: 1e-4 to 1e-1)")


def _call(fn: Callable, kwargs: dict[str, Any], what: str, key: str) -> Any:
    try:
        return fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - the function rejected the config's arguments
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "learning_rate")
        raise ConfigError(f"{key}: {what}({given}) raised {one_line(e)}") from None


def _plain(value: Any) -> Any:
    """A YAML value as the function expects it: a list as a tuple, ``1e-3`` as a number."""
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def _check_schedule(schedule: Any, what: str) -> None:
    """A schedule maps a step to a scalar learning rate (checked abstractly)."""
    if not callable(schedule):
        raise ConfigError(f"optimizer.schedule: {what} returned a {type(schedule).__name__}, not a function of the "
                          f"step")
    try:
        rate = jax.eval_shape(schedule, jax.ShapeDtypeStruct((), jnp.int32))
    except Exception as e:  # noqa: BLE001 - the user's schedule failed on a step
        raise ConfigError(f"optimizer.schedule: {what}'s schedule fails on a step: {one_line(e)}") from None
    if getattr(rate, "shape", None) != ():
        raise ConfigError(f"optimizer.schedule: {what}'s schedule gives {rate!r} for a step, not a scalar learning "
                          f"rate")


def _check_update(tx: optax.GradientTransformation, what: str) -> None:
    """``tx`` can update params with what a train step gives it (tried abstractly on a small
    tree): an update that needs other arguments (optax.lbfgs's ``grad`` and ``value_fn``,
    sophia's ``obj_fn``) fails here in one line, not in the step's trace. Other failures are
    left to the real params, whose structure the optimizer may depend on."""
    extra = optax.with_extra_args_support(tx)

    def update(params):
        return extra.update(params, extra.init(params), params, value=jnp.zeros([], jnp.float32))

    try:
        jax.eval_shape(update, _PROBE_PARAMS)
    except Exception as e:  # noqa: BLE001 - sorted below
        message = str(e)
        if isinstance(e, TypeError) and "argument" in message or "must be provided" in message:
            raise ConfigError(f"optimizer.name: {what}'s update needs arguments a train step does not give "
                              f"({one_line(e)}); a step gives the gradients, the state, the params and value= the "
                              f"loss") from None
