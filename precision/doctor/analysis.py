"""From probes to findings: statistics per module and pass, the problems they show
(overflow, a non-finite value, underflow, updates that round away), where numerics
first failed, and the loss scales that keep float16 gradients in range."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from precision.doctor.probe import SCALES, Probe

__all__ = ["THRESHOLDS", "Findings", "Flushed", "ModuleStats", "Problem", "analyze", "rounding_shares", "without_sites"]

#: When a share is a problem: underflow (backward: the share of a module's float32 parameter-gradient
#: norm in values that flush; forward: of activation values non-zero in float32), updates that round
#: away (per param). ``residue``: a module whose float32 gradient's root mean square is below this
#: share of the model's is rounding residue (zero in exact arithmetic): its flushing is no problem.
THRESHOLDS = {"underflow_backward": 0.01, "underflow_forward": 0.05, "rounding": 0.05, "residue": 1e-5}


class ModuleStats(NamedTuple):
    """One module path in one pass: what its ops computed."""

    path: str
    backward: bool
    dtypes: tuple[str, ...]
    amax: float  # largest finite magnitude of its half-precision results (of all results, if none is half)
    headroom: float  # log2(dtype max / amax) for that dtype (inf: nothing but zeros)
    overflow: float  # share of values that overflowed the half range (finite in float32)
    nonfinite: float  # share of values that are inf or NaN
    flushed: float  # share of float32-non-zero values that are zero in the half result
    subnormal: float  # share of half values that are subnormal
    flushed_at: tuple[float, ...] | None = None  # float16 backward: share flushed at each scale of probe.SCALES


@dataclasses.dataclass(frozen=True)
class Problem:
    """Something the policy's numerics got wrong, and where."""

    kind: str  # overflow | nonfinite | underflow | rounding | int8 (values an int8 product rounds to zero)
    pass_: str  # forward | backward | update
    path: str  # module path (a param path for rounding)
    op: str  # primitive ("" for a module-wide share)
    share: float
    detail: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "pass": self.pass_, "path": self.path, "op": self.op, "share": self.share,
                "detail": self.detail}


@dataclasses.dataclass(frozen=True)
class Findings:
    """Everything one probed run says."""

    modules: tuple[ModuleStats, ...]
    problems: tuple[Problem, ...]
    first_nonfinite: dict | None  # {"op", "path", "pass", "also_in_float32"?}
    scale_range: tuple[float, float] | None  # float16: (smallest scale with least underflow, largest without overflow)
    underflow_at: dict | None  # float16 backward: {scale: share of gradient values flushed}
    loss: float
    seconds: dict = dataclasses.field(default_factory=dict)  # probed program: trace, compile, run, segments, peak_bytes
    outputs_finite: bool = True  # the loss and every gradient (forward only: the outputs) finite
    nonfinite_sites: tuple[tuple[str, str, str], ...] = ()  # (op, path, pass) that made inf/NaN from finite inputs

    def metric(self, problem: Problem) -> float:
        """The share ``problem`` measured, as this run measures it (0 when it is gone)."""
        for p in self.problems:
            if (p.kind, p.pass_, p.path, p.op) == (problem.kind, problem.pass_, problem.path, problem.op):
                return p.share
        return 0.0


def _path(path: tuple[str, ...]) -> str:
    return "/".join(path) or "(top)"


def _module_stats(probes: list[Probe]) -> tuple[ModuleStats, ...]:
    groups: dict[tuple[str, bool], list[Probe]] = collections.defaultdict(list)
    for p in probes:
        groups[(_path(p.path), p.backward)].append(p)
    rows = []
    for (path, backward), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        size = sum(p.size for p in group)
        half = [p for p in group if "flushed" in p.stats]
        nonzero = sum(int(p.stats["nonzero_ref"]) for p in half)
        measured = half or group
        amax = max(float(p.stats["amax"]) for p in measured)
        narrow = min((p.dtype for p in measured), key=lambda d: jnp.finfo(d).max)
        headroom = math.log2(float(jnp.finfo(narrow).max) / amax) if amax > 0 else math.inf
        rows.append(ModuleStats(
            path, backward, tuple(sorted({str(p.dtype) for p in group})), amax, headroom,
            sum(int(p.stats.get("overflow", 0)) for p in group) / size,
            sum(int(p.stats["inf"]) + int(p.stats["nan"]) for p in group) / size,
            sum(int(p.stats["flushed"]) for p in half) / nonzero if nonzero else 0.0,
            sum(int(p.stats["subnormal"]) for p in half) / max(sum(p.size for p in half), 1),
            _flushed_at(half, nonzero)))
    return tuple(rows)


def _flushed_at(half: list[Probe], nonzero: int) -> tuple[float, ...] | None:
    """The share of a module's float32-non-zero values that flush at each loss scale of the grid."""
    grids = [p.stats["flushed_at"] for p in half if "flushed_at" in p.stats]
    if not grids or not nonzero:
        return None
    return tuple(float(f) / nonzero for f in np.sum(grids, axis=0))


def _made_nonfinite(p: Probe) -> bool:
    """Whether the op made an inf or NaN from inputs that were all finite."""
    return bool(p.stats["inputs_finite"]) and int(p.stats["inf"]) + int(p.stats["nan"]) > 0


def _first_nonfinite(probes: list[Probe]) -> Probe | None:
    """The first op that made a non-finite value from finite inputs."""
    return next((p for p in probes if _made_nonfinite(p)), None)


def _overflow_problems(probes: list[Probe]) -> list[Problem]:
    """Ops whose half results overflowed (finite in float32) or that made inf/NaN from finite inputs."""
    found: dict[tuple, list[Probe]] = collections.defaultdict(list)
    for p in probes:
        if _made_nonfinite(p):
            kind = "overflow" if int(p.stats.get("overflow", 0)) > 0 else "nonfinite"
            found[(kind, p.backward, _path(p.path), p.primitive)].append(p)
    problems = []
    for (kind, backward, path, op), group in found.items():
        size = sum(p.size for p in group)
        bad = sum(int(p.stats["overflow"] if kind == "overflow" else p.stats["inf"] + p.stats["nan"]) for p in group)
        dtype = group[0].dtype
        ref = max(float(p.stats.get("ref_amax", 0.0)) for p in group)
        narrowed = {p.narrowed for p in group}
        how = (f"{op}'s float32 result, cast to {dtype}," if "result" in narrowed else
               f"{op}'s operand, cast to {dtype} for it," if "operand" in narrowed else
               f"{op} to {dtype}" if op == "convert_element_type" else f"{op} in {dtype}")
        detail = (f"{how} made {bad} values past {float(jnp.finfo(dtype).max):g} (largest in float32 "
                  f"{ref:.4g})" if kind == "overflow" else f"{op} made inf/NaN from finite inputs")
        problems.append(Problem(kind, "backward" if backward else "forward", path, op, bad / size, detail))
    return problems


def _module_of(name: str) -> str:
    """The module of a param leaf's path (``block/dense/kernel`` -> ``block/dense``; NNX's ``value`` dropped)."""
    parts = name.split("/")
    if len(parts) > 1 and parts[-1] == "value":
        parts = parts[:-1]
    return "/".join(parts[:-1]) or "(top)"


class Flushed(NamedTuple):
    """One module's parameter gradients against a float32 run of the same step."""

    nonzero: int  # values non-zero and finite in the float32 run
    flushed: int  # of those, zero in the policy's run (and below the compute dtype's smallest normal)
    norm: float  # the float32 run's gradient norm (its finite values)
    lost: float  # the norm of the flushed values: what underflow took from the update
    size: int  # values in all


@functools.partial(jax.jit, static_argnums=2)
def _gradient_counts(grads: list, reference: list, tiny: float) -> list:
    """Per leaf, on the device: (values non-zero and finite in ``reference``, of those zero in ``grads``
    and below ``tiny``, the sum of squares of ``reference``'s finite values, of the flushed ones)."""
    found = []
    for g, r in zip(grads, reference):
        r = r.astype(jnp.float32)
        nonzero = (r != 0) & jnp.isfinite(r)
        flushed = nonzero & (g == 0) & (jnp.abs(r) < tiny)
        square = jnp.square(jnp.where(nonzero, r, 0.0))
        found.append((jnp.sum(nonzero), jnp.sum(flushed), jnp.sum(square), jnp.sum(jnp.where(flushed, square, 0.0))))
    return found


def gradient_underflow(grads: Any, reference: Any, tiny: float = math.inf) -> dict[str, Flushed]:
    """Per module, its parameter gradients (what the step applies, not the cotangents) against
    the float32 run's ``reference``: the values zero in the policy's run that are non-zero and
    below ``tiny`` (the compute dtype's smallest normal) in the reference, counted and by their
    norm. A value zero in half but of normal size is a sum that cancelled in rounding, not a
    value too small for the format."""
    leaves = [(path, g, r) for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                                                    jax.tree_util.tree_leaves(reference))
              if jnp.issubdtype(jnp.asarray(g).dtype, jnp.floating)]
    measured = jax.device_get(_gradient_counts([g for _, g, _ in leaves], [r for _, _, r in leaves], tiny))
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0])
    for (path, g, _), (nonzero, flushed, square, lost) in zip(leaves, measured):
        total = sums[_module_of(jax.tree_util.keystr(path, simple=True, separator="/"))]
        total[0] += int(nonzero)
        total[1] += int(flushed)
        total[2] += float(square)
        total[3] += float(lost)
        total[4] += int(np.size(g))
    return {m: Flushed(n, f, math.sqrt(sq), math.sqrt(lost), size) for m, (n, f, sq, lost, size) in sums.items()}


def _gradient_problems(underflow: dict[str, Flushed]) -> list[Problem]:
    """Modules whose flushed gradient values carry more than the threshold of their float32 gradient's
    norm; not those whose float32 gradient is rounding residue (its root mean square below
    ``THRESHOLDS["residue"]`` of the model's: a gradient zero in exact arithmetic, such as a projection's
    that a norm subtracts straight back out), whose values flushing loses nothing."""
    size = sum(u.size for u in underflow.values())
    rms = math.sqrt(sum(u.norm ** 2 for u in underflow.values()) / size) if size else 0.0
    problems = []
    for module, u in sorted(underflow.items()):
        share = u.lost / u.norm if u.norm > 0 else 0.0
        residue = u.norm / math.sqrt(u.size) < THRESHOLDS["residue"] * rms
        if share > THRESHOLDS["underflow_backward"] and not residue:
            problems.append(Problem("underflow", "backward", module, "", share,
                                    f"the values zero in this run carry {100 * share:.3g}% of its parameter-gradient "
                                    f"norm in a float32 run ({u.flushed} of {u.nonzero} values non-zero there)"))
    return problems


def _underflow_problems(modules: Iterable[ModuleStats], backward: bool = True) -> list[Problem]:
    problems = []
    for m in modules:
        if m.backward and not backward:
            continue
        limit = THRESHOLDS["underflow_backward" if m.backward else "underflow_forward"]
        if m.flushed > limit:
            what = "gradient (cotangent)" if m.backward else "activation"
            problems.append(Problem("underflow", "backward" if m.backward else "forward", m.path, "", m.flushed,
                                    f"{100 * m.flushed:.1f}% of {what} values non-zero in float32 are zero in half"))
    return problems


def _scale_analysis(probes: list[Probe], loss_scale: float) -> tuple[tuple[float, float] | None, dict | None]:
    """Float16 backward: the largest loss scale no op overflows at (from each op's float32 amax, which
    scales with the loss scale), the share flushed at each scale of the grid, and the recommended range."""
    backward = [p for p in probes if p.backward and "flushed_at" in p.stats]
    if not backward:
        return None, None
    nonzero = sum(int(p.stats["nonzero_ref"]) for p in backward)
    flushed = np.sum([p.stats["flushed_at"] for p in backward], axis=0)
    shares = {s: float(f) / nonzero if nonzero else 0.0 for s, f in zip(SCALES, flushed)}
    peak = max(float(p.stats.get("ref_amax", 0.0)) for p in backward)
    largest = float(np.finfo(np.float16).max) / (peak / loss_scale) if peak > 0 else math.inf
    safe = [s for s in SCALES if s <= largest / 2]  # a factor of two of headroom
    if not safe:
        return (0.0, largest), shares
    least = min(shares[s] for s in safe)
    smallest = min(s for s in safe if shares[s] <= least + 1e-4)
    return (smallest, largest), shares


def rounding_shares(params: Any, updates: Any, rounding: str = "nearest", steps: int = 32) -> dict[str, float]:
    """Per param leaf: the share of the movement that ``steps`` applications of ``updates``
    should make that a param stored in its dtype loses to rounding (0: none, 1: it never moves).

    ``rounding``: how each sum is stored: ``nearest`` (a half param updated in place: an
    update below half an ulp vanishes every time), ``stochastic`` or ``kahan`` (bfloat16
    masters, :mod:`precision.stored`: right on average, or carried to the next step).
    Measured, not assumed: the updates are applied ``steps`` times (on the host, to at most
    :data:`_SAMPLE` values of each leaf: no compilation, bounded time on any model) and the
    movement made is compared with the movement meant; for stochastic rounding, less three
    standard errors of its random movement (a leaf of ten values moves by whole ulps a few
    times in ``steps``: noise, not loss)."""
    shares = {}
    for (path, p), u in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(updates)):
        if not jnp.issubdtype(p.dtype, jnp.floating):
            continue
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        dtype = np.dtype(p.dtype)
        w0, u = _sample(np.asarray(p, np.float32)), _sample(np.asarray(u, np.float32))
        total = float(np.sum(np.abs(u.astype(np.float64)))) * steps
        if total == 0:
            shares[name] = 0.0
            continue
        moved = _moved(w0, u, dtype, rounding, steps)
        lost = 1.0 - float(np.sum(moved.astype(np.float64) * np.sign(u))) / total
        if rounding == "stochastic" and dtype != np.float32:
            ulp = _ulp(w0, dtype)
            q = np.abs(u.astype(np.float64)) / ulp % 1.0  # each step rounds up with probability q
            lost -= 3 * float(np.sqrt(steps * np.sum(ulp ** 2 * q * (1 - q)))) / total
        shares[name] = min(max(lost, 0.0), 1.0)
    return shares


#: Values of a leaf the update pass applies updates to (a strided sample beyond).
_SAMPLE = 1 << 16


def _sample(x: np.ndarray) -> np.ndarray:
    flat = x.reshape(-1)
    return flat if flat.size <= _SAMPLE else flat[::-(-flat.size // _SAMPLE)]


def _ulp(w: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The unit in the last place of each value of ``w`` in ``dtype``."""
    info = jnp.finfo(dtype)
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(w.astype(np.float64)), float(info.tiny)))) - info.nmant)


def _moved(w0: np.ndarray, u: np.ndarray, dtype: np.dtype, rounding: str, steps: int) -> np.ndarray:
    """The stored values after ``steps`` updates ``u`` (with Kahan, plus the compensation it
    carries for the next one) minus before, in float32, emulated exactly on the host."""
    def nearest(x):
        return x.astype(dtype).astype(np.float32)

    rng = np.random.default_rng(0)
    w, carry = w0.copy(), np.zeros_like(w0)
    for _ in range(steps):
        if rounding == "kahan" and dtype != np.float32:
            total = w + (u + carry)
            w = nearest(total)
            carry = nearest(total - w)
        elif rounding == "stochastic" and dtype == np.dtype(jnp.bfloat16):
            bits = (w + u).view(np.uint32)  # bfloat16 is float32's upper half: add 16 random bits, truncate
            noise = rng.integers(0, 1 << 16, size=w.shape, dtype=np.uint32)
            w = ((bits + noise) & np.uint32(0xFFFF0000)).view(np.float32)
        else:
            w = nearest(w + u)
    return w + carry - w0


def analyze(probes: list[Probe], loss: float, loss_scale: float, rounding: dict[str, float] | None,
            storage: dict[str, str], seconds: dict | None = None, outputs_finite: bool = True,
            gradients: dict[str, Flushed] | None = None) -> Findings:
    """The findings of one probed run (``rounding``: per param share, ``storage``: its dtype;
    ``outputs_finite``: whether the loss and gradients, or the outputs, came out finite;
    ``gradients``: :func:`gradient_underflow` against a float32 run, which then measures the
    backward pass's underflow in place of the cotangents)."""
    modules = _module_stats(probes)
    problems = _overflow_problems(probes) + _underflow_problems(modules, backward=gradients is None)
    problems += _gradient_problems(gradients or {})
    for name, share in (rounding or {}).items():
        if share > THRESHOLDS["rounding"]:
            problems.append(Problem("rounding", "update", name, "", share,
                                    f"{100 * share:.1f}% of its updates' movement is lost to rounding them "
                                    f"into a {storage.get(name, '?')} param"))
    sites = tuple(dict.fromkeys((p.primitive, _path(p.path), "backward" if p.backward else "forward")
                                for p in probes if _made_nonfinite(p)))
    if not outputs_finite and not sites:  # a non-finite constant or input, or the loss's own NaN
        problems.append(Problem("nonfinite", "forward", "(top)", "loss", 1.0,
                                "the loss is non-finite, though no op made a non-finite value from finite inputs: "
                                "a non-finite input, constant or label reaches it"))
        sites = (("loss", "(top)", "forward"),)
    return _sorted(Findings(modules, tuple(problems), _first(sites), None, None, loss, dict(seconds or {}),
                            outputs_finite, sites), probes, loss_scale)


def _first(sites: tuple[tuple[str, str, str], ...]) -> dict | None:
    return None if not sites else {"op": sites[0][0], "path": sites[0][1], "pass": sites[0][2]}


def _sorted(findings: Findings, probes: list[Probe], loss_scale: float) -> Findings:
    first = findings.first_nonfinite
    forward_failed = (not findings.outputs_finite and first is not None
                      and first["pass"] == "forward")  # no gradient to read then
    scale_range, underflow_at = (None, None) if forward_failed else _scale_analysis(probes, loss_scale)
    order = {"nonfinite": 0, "overflow": 1, "underflow": 2, "rounding": 3, "int8": 4}
    problems = tuple(sorted(findings.problems, key=lambda p: (order[p.kind], p.pass_ != "forward", -p.share)))
    return dataclasses.replace(findings, problems=problems, scale_range=scale_range, underflow_at=underflow_at)


def without_sites(findings: Findings, masked: set) -> Findings:
    """``findings`` without the non-finite values made at ``masked`` sites ((op, path, pass)):
    values the model discards (``where``, a clamp) before they reach its loss or gradients."""
    sites = tuple(site for site in findings.nonfinite_sites if site not in masked)
    problems = tuple(p for p in findings.problems
                     if p.kind not in ("overflow", "nonfinite") or (p.op, p.path, p.pass_) not in masked)
    return dataclasses.replace(findings, problems=problems, nonfinite_sites=sites, first_nonfinite=_first(sites))
