"""``precision.diagnose``: run a model once in its policy's dtypes with every op
probed, name where numerics fail, and recommend only what it verified.

For each problem the doctor tries the changes that could fix it, cheapest first:
a float32 rule on the smallest module that contains it (then on each enclosing
module outward: a caller may cast the rule's result back to half), taking the primitive out
of the half ops (an op-list change), bfloat16 instead of float16, a loss scale
inside the range where float16 gradients neither overflow nor flush, float32
master weights. Each is applied, the program diagnosed again, and kept only when
the problem is gone and nothing non-finite remains.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precision.autocast import ALLOW, OpLists, op_lists
from precision.doctor import probe
from precision.doctor.config_text import config_text
from precision.doctor.int8_check import THRESHOLD as INT8_THRESHOLD, int8_problems, uses_int8
from precision.doctor.analysis import (
    THRESHOLDS,
    Findings,
    Problem,
    analyze,
    gradient_underflow,
    rounding_shares,
    without_sites,
)
from precision.doctor.report import Diagnosis, Recommendation
from precision.doctor.subject import Subject, subject_of
from precision.policy import Policy
from precision.rules import default_rules

__all__ = ["diagnose"]

F16, BF16, F32 = np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class _Setting:
    """Everything a run depends on that a fix may change."""

    policy: Policy
    rules: tuple
    ops: OpLists
    loss_scale: float
    masters: bool  # updates applied to float32 masters (not to the stored params)
    rounding: str = "nearest"  # how updates are stored into half params: nearest, stochastic or kahan


def _reference_grads(subject: Subject, s: _Setting, loss_fn: Callable, cache: dict) -> Any:
    """The gradients of a float32 run at ``s``'s loss scale (not probed): what the policy's
    gradients are measured against (cached per scale)."""
    if s.loss_scale not in cache:
        forward, params = subject.program(Policy(F32, F32, F32), s.rules, s.ops)
        full = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
        cache[s.loss_scale] = jax.jit(jax.grad(lambda p: jnp.asarray(loss_fn(forward(p)), jnp.float32)
                                               * s.loss_scale))(full)
    return cache[s.loss_scale]


def _examine(subject: Subject, s: _Setting, loss_fn: Callable | None, optimizer: Any,
             reference: dict | None = None, segments: dict | None = None) -> Findings:
    """One probed run under setting ``s`` (``reference``: a cache of float32 runs' gradients;
    ``segments``: of compiled probe segments, shared by a diagnosis's runs)."""
    forward, params = subject.program(s.policy, s.rules, s.ops)
    found = _probed(subject, s, loss_fn, optimizer, forward, params, reference, segments)
    if not uses_int8(s.policy, s.rules):
        return found
    return dataclasses.replace(found, problems=found.problems + int8_problems(forward, params, loss_fn))


def _probed(subject: Subject, s: _Setting, loss_fn: Callable | None, optimizer: Any, forward: Callable, params: Any,
            reference: dict | None, segments: dict | None) -> Findings:
    """The probed run of :func:`_examine`: every op's results against float32."""
    if loss_fn is None:
        outputs, probes, seconds = probe.run(forward, (params,), compiled=segments)
        return analyze(probes, math.nan, 1.0, None, {}, seconds, _all_finite(outputs))

    def scaled(p):
        return jnp.asarray(loss_fn(forward(p)), jnp.float32) * s.loss_scale

    try:
        (value, grads), probes, seconds = probe.run(jax.value_and_grad(scaled), (params,), s.loss_scale,
                                                    n_primal=1, compiled=segments)
    except TypeError as e:
        if "scalar" not in str(e):
            raise
        shape = jax.eval_shape(scaled, params).shape
        raise ValueError(f"diagnose: loss_fn must return a scalar (the loss of the batch), got an array of shape "
                         f"{shape}; reduce it, e.g. with .mean()") from None
    rounding, storage = None, {}
    if optimizer is not None:
        full = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
        unscaled = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32) / s.loss_scale, grads)
        updates, _ = optimizer.update(unscaled, optimizer.init(full), full)
        stored = full if s.masters else params
        rounding = rounding_shares(stored, updates, s.rounding)
        how = "" if s.masters else f" (rounded {'to nearest' if s.rounding == 'nearest' else s.rounding})"
        storage = {jax.tree_util.keystr(path, simple=True, separator="/"): f"{x.dtype}{how}"
                   for path, x in jax.tree_util.tree_leaves_with_path(stored)}
    gradients = None
    if s.policy.compute_dtype != F32 and reference is not None:
        gradients = gradient_underflow(grads, _reference_grads(subject, s, loss_fn, reference),
                                       float(jnp.finfo(s.policy.compute_dtype).tiny))
    return analyze(probes, float(value) / s.loss_scale, s.loss_scale, rounding, storage, seconds,
                   _all_finite((value, grads)), gradients)


def _all_finite(tree: Any) -> bool:
    """Whether every floating value of ``tree`` is finite."""
    flags = probe.finite_flags(jax.tree_util.tree_leaves(tree))
    return bool(jnp.all(jnp.stack(flags))) if flags else True  # one transfer to the host


# ----------------------------------------------------------------------------- changes to try


@dataclasses.dataclass(frozen=True)
class _Change:
    change: str
    yaml: str  # a YAML mapping (see .config_text)
    python: str
    setting: _Setting
    overrides: tuple[str, ...] = ()  # the same, as key=value for the command line
    summary: str = ""  # the change alone, for one line (see Recommendation.summary)


def _rule_change(problem: Problem, s: _Setting, path: str | None = None) -> _Change | None:
    """A float32 rule on ``path`` (default: the problem's module)."""
    path = problem.path if path is None else path
    if path == "(top)" or s.policy.compute_dtype == F32:
        return None
    rules = ((path, "f32"), *s.rules)
    shown = [[path, "f32"], *([r.pattern, _policy_name(r.policy)] for r in s.rules)]
    rest = ("*precision.default_rules()" if s.rules == default_rules()
            else ", ".join(f"({r.pattern!r}, {_policy_name(r.policy)!r})" for r in s.rules))
    python = f"rules=[({path!r}, 'f32')" + (f", {rest}]" if rest else "]")
    yaml_text, overrides = config_text(rules=shown)
    kept = "" if not s.rules else (f"; the {'default rules' if s.rules == default_rules() else 'rules in use'} "
                                   f"still apply (the diagnosis's override keeps them after it)")
    return _Change(f"keep {path} in float32 (a rule)", yaml_text, python, dataclasses.replace(s, rules=rules),
                   overrides, f"add the rule [{path}, f32] to precision.rules{kept}")


def _fallback_rule_change(problem: Problem, s: _Setting) -> _Change | None:
    """A rule keeping the problem's module out of int8: its matmuls in the policy's fallback dtype."""
    if problem.path in ("", "(top)"):
        return None
    fallback = Policy(s.policy.param_dtype, s.policy.compute_dtype, s.policy.output_dtype)
    name = str(fallback)
    rules = ((problem.path, name), *s.rules)
    shown = [[problem.path, name], *([r.pattern, _policy_name(r.policy)] for r in s.rules)]
    yaml_text, overrides = config_text(rules=shown)
    return _Change(f"keep {problem.path} out of int8 (a rule: its matmuls in {_policy_name(fallback)})", yaml_text,
                   f"rules=[({problem.path!r}, {name!r}), ...]", dataclasses.replace(s, rules=rules), overrides,
                   f"add the rule [{problem.path}, {name}] to precision.rules")


def _rule_changes(problem: Problem, s: _Setting) -> list[_Change | None]:
    """Float32 rules from the problem's module outward, one per enclosing module: where a
    rule's float32 result is cast back to half by its caller (a residual), the overflow
    moves out, and the smallest scope that contains it is the one to keep."""
    parts = problem.path.split("/")
    return [_rule_change(problem, s, "/".join(parts[:n])) for n in range(len(parts), 0, -1)]


def _policy_name(policy: Policy) -> str:
    """``f32`` (``f32,matmul=highest``) for a policy of one dtype, else its spec."""
    one = len({policy.param_dtype, policy.compute_dtype, policy.output_dtype}) == 1
    if not one:
        return str(policy)
    matmul = f",matmul={policy.matmul_precision}" if policy.matmul_precision != "default" else ""
    return str(policy).split(",")[0].removeprefix("p=") + matmul


def _op_list_change(problem: Problem, s: _Setting) -> _Change | None:
    if not problem.op or problem.op in ALLOW or problem.op in s.ops.deny or s.policy.compute_dtype == F32:
        return None
    try:
        ops = op_lists(deny=[problem.op], base=s.ops)
    except Exception:  # noqa: BLE001 - not a primitive the op lists know
        return None
    return _Change(f"compute {problem.op} in float32 (the deny list)", *_with_python(
        config_text(deny=sorted(ops.deny - OpLists().deny)), f"ops=precision.op_lists(deny=[{problem.op!r}])",
        dataclasses.replace(s, ops=ops)))


def _bf16_change(problem: Problem, s: _Setting) -> _Change | None:
    if s.policy.compute_dtype != F16:
        return None
    half = {F16: BF16}
    policy = Policy(half.get(s.policy.param_dtype, s.policy.param_dtype), BF16,
                    half.get(s.policy.output_dtype, s.policy.output_dtype), state_dtype=s.policy.state_dtype,
                    accum_dtype=s.policy.accum_dtype, matmul_precision=s.policy.matmul_precision)
    return _Change("bfloat16 instead of float16 (float32's range)", *_with_python(
        config_text(policy=str(policy)), f"precision.with_policy(model, {str(policy)!r})",
        dataclasses.replace(s, policy=policy)))


def _scale_change(problem: Problem, s: _Setting, findings: Findings, step: int = 0) -> _Change | None:
    """A loss scale from the range where float16 gradients neither overflow nor flush: for
    underflow its low end (``step`` > 0: 2**(8 * step) times it, while below the top)."""
    if findings.scale_range is None or problem.pass_ != "backward":
        return None
    low, high = findings.scale_range
    scale = (low * 2.0 ** (8 * step) if problem.kind == "underflow"
             else max((x for x in probe.SCALES if x <= high / 2), default=None))
    if scale is None or scale == s.loss_scale or (step and scale > high / 2):
        return None
    return _Change(f"loss scale {scale:g}", *_with_python(
        config_text(loss_scale="dynamic", initial_scale=scale), f"precision.DynamicLossScale({scale:g})",
        dataclasses.replace(s, loss_scale=scale)))


def _masters_change(problem: Problem, s: _Setting) -> _Change | None:
    if problem.kind != "rounding" or s.masters:
        return None
    if s.policy.master_dtype is not None:  # bfloat16 masters chosen: the policy without them
        policy = s.policy.with_stored(master_dtype=None, master_rounding=None)
        return _Change("float32 master weights (updates applied to them, not to the half params)", *_with_python(
            config_text(policy=str(policy)), f"precision.with_policy(model, {str(policy)!r})",
            dataclasses.replace(s, policy=policy, masters=True)))
    return _Change("float32 master weights (updates applied to them, not to the half params)",
                   "# nothing to set: the framework's optimizer (precision.mixed_precision) keeps them",
                   "tx = precision.mixed_precision(optimizer)  # keeps float32 masters of half params",
                   dataclasses.replace(s, masters=True))


def _rounding_change(problem: Problem, s: _Setting, rounding: str) -> _Change | None:
    """bfloat16 params as their own masters, updated with stochastic rounding or Kahan
    compensation (precision.stored): no copy, the movement kept."""
    if problem.kind != "rounding" or s.masters or s.rounding == rounding or s.policy.param_dtype != BF16:
        return None
    policy = s.policy.with_stored(master_dtype=BF16, master_rounding=rounding)
    what = {"stochastic": "stochastic rounding (right on average)",
            "kahan": "Kahan compensation (a bfloat16 buffer carries what rounding lost)"}[rounding]
    return _Change(f"bfloat16 masters with {what}", *_with_python(
        config_text(policy=str(policy)), f"precision.with_policy(model, {str(policy)!r})",
        dataclasses.replace(s, policy=policy, rounding=rounding)))


def _with_python(config: tuple[str, tuple[str, ...]], python: str, setting: _Setting) -> tuple:
    """_Change's fields after its description, from config_text's pair."""
    yaml_text, overrides = config
    return yaml_text, python, setting, overrides


def _changes(problem: Problem, s: _Setting, findings: Findings) -> list[_Change]:
    if problem.kind == "int8":
        tries = [_fallback_rule_change(problem, s)]
    elif problem.kind == "rounding":
        tries = [_rounding_change(problem, s, "stochastic"), _rounding_change(problem, s, "kahan"),
                 _masters_change(problem, s)]
    elif problem.kind == "underflow":
        tries = [*(_scale_change(problem, s, findings, step) for step in range(3)), _bf16_change(problem, s),
                 _rule_change(problem, s)]
    else:
        tries = [*_rule_changes(problem, s), _op_list_change(problem, s), _scale_change(problem, s, findings),
                 _bf16_change(problem, s)]
    return [c for c in tries if c is not None]


def _fixed(problem: Problem, after: Findings, every_layer: bool = False) -> bool:
    """The problem is gone, and nothing non-finite reaches the loss or gradients;
    ``every_layer`` (a new loss scale): no layer's gradients underflow past the threshold either."""
    if every_layer and any(p.kind == "underflow" and p.pass_ == "backward" for p in after.problems):
        return False
    if problem.kind in ("overflow", "nonfinite"):
        return after.outputs_finite and after.first_nonfinite is None and after.metric(problem) == 0
    if problem.kind == "int8":
        return after.metric(problem) <= INT8_THRESHOLD and after.outputs_finite
    limit = THRESHOLDS["rounding" if problem.kind == "rounding" else
                      "underflow_backward" if problem.pass_ == "backward" else "underflow_forward"]
    return after.metric(problem) <= limit and after.outputs_finite and after.first_nonfinite is None


def _name(problem: Problem) -> str:
    return {"overflow": "overflow", "nonfinite": "non-finite", "underflow": "underflow",
            "rounding": "updates rounding away", "int8": "int8 rounding to zero"}[problem.kind]


# ----------------------------------------------------------------------------- the doctor


def diagnose(target: Any, *args: Any, policy: Any = None, variables: Any = None, loss_fn: Callable | None = None,
             loss_scale: Any = None, rules: Any = None, ops: OpLists | None = None, optimizer: Any = None,
             learning_rate: float | None = None, verify: bool = True, most: int = 3, int8: Any = None,
             **kwargs: Any) -> Diagnosis:
    """Runs ``target`` on ``args`` once in ``policy``'s dtypes with every op probed, and says where its
    numerics fail and what verified change fixes them.

    Args:
      target: a Linen module (with its ``variables``; initialised from key 0 if None), an NNX module, a
        :func:`precision.with_policy` wrapper (its own policy, rules and op lists), or a function of arrays.
      *args, **kwargs: the call's inputs and keyword arguments (``train=True``...).
      policy, rules, ops: as :func:`precision.with_policy` takes them.
      loss_fn: ``loss_fn(outputs) -> scalar``: also diagnose the backward pass, at ``loss_scale`` (a number or
        a loss scale object; default 1), and the loss scales where float16 gradients keep in range.
      optimizer, learning_rate: an optax optimizer (or plain SGD at ``learning_rate``): also measure the
        updates that would round away if applied to the params in their storage dtype.
      verify: try the changes that could fix each problem (the ``most`` worst), and recommend those that
        did; ``False`` only diagnoses.
      int8: :func:`precision.int8_options` of an int8 policy's matmuls (a wrapper's own by default). Under
        int8 the diagnosis also names the modules whose int8 operands round values to zero
        (:mod:`precision.doctor.int8_check`), with a rule keeping them in the fallback dtype, verified.
    """
    subject = subject_of(target, args, kwargs, policy, rules, ops, variables, int8)
    scale = float(np.asarray(getattr(loss_scale, "loss_scale", 1.0 if loss_scale is None else loss_scale)))
    if optimizer is None and learning_rate is not None:
        optimizer = optax.sgd(learning_rate)
    policy = subject.policy
    setting = _Setting(policy, subject.rules, subject.ops, scale, False,
                       policy.master_rounding if policy.master_dtype is not None else "nearest")
    reference: dict = {}
    segments: dict = {}  # the verification runs recompile only the segments a change touched
    findings = _examine(subject, setting, loss_fn, optimizer, reference, segments)
    notes, recommendations, masked = [], [], set()
    if findings.nonfinite_sites and findings.outputs_finite:  # made, then discarded: never reaches the loss
        masked = set(findings.nonfinite_sites)
    elif findings.first_nonfinite and subject.policy != Policy(F32, F32, F32):
        full = _examine(subject, dataclasses.replace(setting, policy=Policy(F32, F32, F32), loss_scale=1.0), loss_fn,
                        None, segments=segments)
        if not full.outputs_finite:
            first = full.first_nonfinite or findings.first_nonfinite
            notes.append(f"{first['op']} in {first['path']} ({first['pass']}) is non-finite in float32 too: the "
                         f"model's math, not precision")
        else:
            masked = set(full.nonfinite_sites)  # the model's own inf/NaN, discarded in float32 as in half
    if masked:
        findings = without_sites(findings, masked)
        notes.append(_masked_note(masked))
    if verify and not any("float32 too" in n for n in notes):
        recommendations = _verified(subject, setting, findings, loss_fn, optimizer, most, masked, reference,
                                     segments)
    return Diagnosis(subject.name, subject.policy, scale, findings, tuple(recommendations), tuple(notes), verify)


def _masked_note(masked: set) -> str:
    where = ", ".join(f"{op} in {path} ({pass_})" for op, path, pass_ in sorted(masked)[:4])
    more = f" and {len(masked) - 4} more" if len(masked) > 4 else ""
    return (f"{where}{more} made inf/NaN that the model discards (a where or clamp) before the loss and "
            f"gradients: not a problem")


def _verified(subject: Subject, setting: _Setting, findings: Findings, loss_fn: Callable | None, optimizer: Any,
              most: int, masked: set = frozenset(), reference: dict | None = None,
              segments: dict | None = None) -> list[Recommendation]:
    """For each of the ``most`` worst problems, the first change that fixes it when applied."""
    found: list[Recommendation] = []
    tried: dict[_Setting, Findings] = {}
    for problem in findings.problems[:most]:
        if any(r.problem == problem for r in found):
            continue
        for change in _changes(problem, setting, findings):
            if change.setting not in tried:
                tried[change.setting] = without_sites(
                    _examine(subject, change.setting, loss_fn, optimizer, reference, segments), masked)
            after = tried[change.setting]
            if _fixed(problem, after, every_layer=change.setting.loss_scale != setting.loss_scale):
                if any(r.change == change.change for r in found):
                    break  # already recommended, for a worse problem it fixes too
                found.append(Recommendation(change.change, change.yaml, change.python, problem,
                                            f"{_name(problem)} {100 * problem.share:.3g}%",
                                            f"{_name(problem)} {100 * after.metric(problem):.3g}%",
                                            change.overrides, change.summary))
                break
    return found
