"""Which precision policy for this model, on this machine: the decision, from measurements.

A :class:`Candidate` is a policy (a preset or a policy string) with the other
precision settings it needs (per-module ``rules``, a ``deny`` list...). Whoever
trains measures each candidate into a :class:`Measurement` (numerics, the loss
after N steps, step times, memory; :func:`train.pick_policy` does it for an
experiment) and :func:`pick_policy` decides:

- eligible: numerics ok (or fixed), the loss within ``tolerance`` of float32's,
  and the step fits the device's memory;
- ``prefer="speed"``: the fastest eligible candidate, where faster than float32
  means by more than the timing spread: a difference within it is noise, and
  float32, the simpler and more accurate, is kept;
- ``prefer="memory"``: the eligible candidate with the smallest train state (params,
  masters, optimizer state: what training holds from step to step, and what grows with
  the model); the step's peak (XLA's memory plan) decides whether a candidate fits.

Nothing here trains: the decision is a pure function of the measurements.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
import statistics
from typing import Any, Iterable, Mapping, Sequence

import yaml

from precision.doctor.config_text import config_text
from precision.dtype_names import _KEYS
from precision.policy import Policy, PolicyError, get_policy
from precision.rules import as_rules

__all__ = ["DEFAULT_CANDIDATES", "PREFERENCES", "Candidate", "Measurement", "PolicyPick", "check_choice",
           "parse_candidates", "pick_policy"]

#: What is tried when the user names nothing: float32 (the reference), the mixed policies (FP8 and int8
#: matmuls among them: each dropped where no matmul would take its format), the lean ones.
DEFAULT_CANDIDATES = ("fp32", "mixed_bf16", "mixed_f16", "mixed_fp8", "mixed_int8", "lean_bf16", "lean_int8")
PREFERENCES = ("speed", "memory")
_FP32 = get_policy("fp32")
# Whitespace before the next key=value setting (a policy string's own keys, ``compute=f16``, are not settings).
_POLICY_KEYS = "|".join(sorted(_KEYS, key=len, reverse=True))
_SETTING = re.compile(rf"\s+(?=(?!(?:{_POLICY_KEYS})\s*=)[A-Za-z_][A-Za-z0-9_.]*=)")


def check_choice(tolerance: float, prefer: str) -> None:
    """Raises ``ValueError`` (one line) unless ``tolerance`` is in (0, 1) and ``prefer`` is speed or memory."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be a number in (0, 1), the relative loss change allowed against "
                         f"float32 (e.g. 0.01 for 1%), got {tolerance!r}")
    if prefer not in PREFERENCES:
        raise ValueError(f"prefer must be one of {', '.join(PREFERENCES)}, got {prefer!r}")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A policy to try, with the precision settings that go with it (``rules``...)."""

    name: str
    policy: str
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Candidate":
        """``"mixed_f16"`` or ``"mixed_f16 rules=[[block, f32]]"``: a policy, then ``key=value``
        precision settings (YAML values). Raises :class:`PolicyError` naming the nearest preset."""
        if not isinstance(text, str) or not text.strip():
            raise PolicyError(f"a candidate is a policy or preset, optionally followed by key=value settings "
                              f"(e.g. 'mixed_f16 rules=[[LayerNorm, f32]]'), got {text!r}")
        policy, *parts = _SETTING.split(text.strip())
        get_policy(policy)  # the nearest preset in the message
        settings = {}
        for part in parts:
            key, _, value = part.partition("=")
            key = key.removeprefix("precision.")
            try:
                settings[key] = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise PolicyError(f"candidate {text!r}: {key}={value} is not valid YAML ({e})") from None
        if "rules" in settings:
            try:
                as_rules(settings["rules"])
            except (TypeError, PolicyError) as e:
                raise PolicyError(f"candidate {text!r}: rules: {e}") from None
        return cls(text.strip(), policy.strip(), settings)


def parse_candidates(candidates: "str | Iterable[str | Candidate] | None") -> tuple[Candidate, ...]:
    """Candidates from text (``;`` between them, as ``--candidates`` takes them) or a list of
    texts / :class:`Candidate`; ``None``: :data:`DEFAULT_CANDIDATES`. float32 is always
    measured (the reference): it is put first when missing."""
    if candidates is None:
        candidates = DEFAULT_CANDIDATES
    if isinstance(candidates, str):
        candidates = [candidates]
    parsed: list[Candidate] = []
    for item in candidates:
        if isinstance(item, Candidate):
            parsed.append(item)
            continue
        if not isinstance(item, str):
            raise PolicyError(f"a candidate is a string such as 'mixed_bf16' or a precision.Candidate, got "
                              f"{type(item).__name__} {item!r}")
        parsed += [Candidate.parse(part) for part in item.split(";") if part.strip()]
    if not parsed:
        raise PolicyError("no candidates given: name at least one policy, e.g. 'fp32;mixed_bf16'")
    names = [c.name for c in parsed]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PolicyError(f"candidate {repeated[0]!r} is given twice")
    if not any(_is_reference(c.policy, c.settings) for c in parsed):
        parsed.insert(0, Candidate("fp32", "fp32"))
    return tuple(parsed)


def _is_reference(policy: str | Policy, settings: Mapping[str, Any]) -> bool:
    return get_policy(policy) == _FP32 and not settings


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A candidate as measured on this machine. ``numerics``: ``ok``, ``fixed`` (by the
    doctor's verified change, now in ``settings``), ``warning`` (problems below overflow
    that no change fixed) or ``dropped``; ``error``: why it could not be measured."""

    name: str
    policy: str
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    numerics: str = "ok"
    numerics_note: str = ""
    loss: float | None = None  # after ``steps`` steps, on the eval batches
    steps: int = 0
    skipped_steps: int = 0
    step_seconds: tuple[float, ...] = ()  # one per step after the first (the first may warm up)
    state_bytes: int | None = None
    peak_bytes: int | None = None  # the compiled step's (XLA's memory analysis), per device
    memory_limit: int | None = None  # the device's memory (a CPU's: the host's RAM)
    error: str | None = None

    @property
    def is_reference(self) -> bool:
        """float32 without other settings: what the others' losses are compared with."""
        return _is_reference(self.policy, self.settings)

    @property
    def median_seconds(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None

    @property
    def spread_seconds(self) -> float:
        """The interquartile range of the step times (0 with fewer than 4)."""
        if len(self.step_seconds) < 4:
            return 0.0
        q = statistics.quantiles(self.step_seconds, n=4, method="inclusive")
        return q[2] - q[0]

    @property
    def fits(self) -> bool | None:
        """The compiled step fits the device's memory (None: not known)."""
        if self.peak_bytes is None or not self.memory_limit:
            return None
        return self.peak_bytes <= self.memory_limit

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(settings=dict(self.settings), step_seconds=list(self.step_seconds),
                   median_seconds=self.median_seconds, spread_seconds=self.spread_seconds, fits=self.fits)
        return out


@dataclasses.dataclass(frozen=True)
class Row:
    """A line of the table: the measurement, its loss change against float32, the verdict and why."""

    measurement: Measurement
    loss_change: float | None
    verdict: str  # picked, eligible, dropped, failed
    reason: str


def _drop_reason(m: Measurement, change: float | None, tolerance: float) -> str | None:
    """Why ``m`` is not eligible (None: it is)."""
    if m.error:
        return m.error
    if m.numerics == "dropped":
        return f"numerics: {m.numerics_note}"
    if m.loss is None or not math.isfinite(m.loss):
        return f"loss after {m.steps} steps is {m.loss}"
    if change is None:
        return "no float32 loss to compare with"
    if change > tolerance:
        return f"loss {100 * change:.2f}% from float32's, over the {100 * tolerance:g}% tolerance"
    if m.fits is False:
        return f"the step needs {_bytes(m.peak_bytes)}, more than the {_bytes(m.memory_limit)} of memory"
    return None


def _loss_change(m: Measurement, reference: Measurement | None) -> float | None:
    if m.is_reference and m.loss is not None and math.isfinite(m.loss):
        return 0.0
    if reference is None or reference.loss is None or m.loss is None or not math.isfinite(m.loss):
        return None
    return abs(m.loss - reference.loss) / max(abs(reference.loss), 1e-12)


def _within_noise(a: Measurement, b: Measurement) -> bool:
    """``a`` and ``b`` take the same time, as far as their spreads can tell."""
    return abs(a.median_seconds - b.median_seconds) <= max(a.spread_seconds, b.spread_seconds)


def _speed_choice(eligible: list[Row]) -> tuple[Row, str, str]:
    """The fastest eligible row; float32 instead where the fastest beats it by no more than the timing spread."""
    timed = [r for r in eligible if r.measurement.median_seconds is not None]
    if not timed:
        row = min(eligible, key=_simplest)
        return row, "no step times (steps < 2): kept the simplest, most accurate candidate", "low: nothing timed"
    fastest = min(timed, key=lambda r: (r.measurement.median_seconds, _simplest(r)))
    reference = next((r for r in timed if r.measurement.is_reference), None)
    row, f = fastest, fastest.measurement
    if reference is not None and reference is not fastest and _within_noise(reference.measurement, f):
        row = reference
        m = reference.measurement
        reason = (f"{f.name} is {_ms(m.median_seconds - f.median_seconds)} faster, within the timing spread "
                  f"(+-{_ms(max(m.spread_seconds, f.spread_seconds))}): noise; kept float32, the simpler and "
                  f"more accurate")
    elif reference is fastest or reference is None:
        reason = "fastest within tolerance"
    else:
        r = reference.measurement
        reason = (f"fastest within tolerance: {r.median_seconds / f.median_seconds:.2f}x faster than float32, beyond "
                  f"the timing spread (+-{_ms(max(r.spread_seconds, f.spread_seconds))})")
    m = row.measurement
    others = [r for r in timed if r is not row]
    if not others:
        return row, reason, "high: the only eligible candidate"
    runner = min(others, key=lambda r: r.measurement.median_seconds).measurement
    gap = (runner.median_seconds - m.median_seconds) / m.median_seconds
    noise = max(m.spread_seconds, runner.spread_seconds) / m.median_seconds
    level = "high" if gap > 3 * noise and gap > 0.05 else "medium" if gap > noise else "low"
    sign = "slower" if gap >= 0 else "faster, within the noise"
    return row, reason, (f"{level}: the next eligible, {runner.name}, is {100 * abs(gap):.0f}% {sign}; "
                         f"timing spread (IQR) +-{100 * noise:.0f}% of the median")


def _simplest(row: Row) -> tuple:
    m = row.measurement
    return (not m.is_reference, len(m.settings), row.loss_change or 0.0, m.median_seconds or 0.0)


def _memory_key(row: Row) -> tuple:
    """The train state's bytes (what training holds from step to step, and checkpoints), then the step's peak."""
    m = row.measurement
    return (m.state_bytes if m.state_bytes is not None else math.inf,
            m.peak_bytes if m.peak_bytes is not None else math.inf, _simplest(row))


def _memory_choice(eligible: list[Row]) -> tuple[Row, str, str]:
    """The eligible row with the smallest train state; says so when another one's step peaks lower."""
    row = min(eligible, key=_memory_key)
    m = row.measurement
    reason = f"the smallest train state: {_bytes(m.state_bytes)}"
    lower = [r.measurement for r in eligible if (r.measurement.peak_bytes or math.inf) < (m.peak_bytes or 0)]
    if lower:
        low = min(lower, key=lambda x: x.peak_bytes)
        reason += (f"; its step peaks at {_bytes(m.peak_bytes)} against {low.name}'s {_bytes(low.peak_bytes)} "
                   f"(the update's temporaries): the state is what grows with the model")
    others = [r for r in eligible if r is not row]
    if not others:
        return row, reason, "high: the only eligible candidate"
    runner = min(others, key=_memory_key).measurement
    return row, reason, (f"high: bytes are exact; the next smallest state, {runner.name}'s, is "
                         f"{_bytes(runner.state_bytes)}")


def pick_policy(measurements: Sequence[Measurement], tolerance: float = 0.01, prefer: str = "speed",
                backend: str | None = None) -> "PolicyPick":
    """The policy to train with, from ``measurements`` of the candidates (float32's among
    them: the reference). Eligible: numerics ok or fixed, the loss within ``tolerance``
    (relative) of float32's, the step fitting memory. ``prefer``: ``speed`` (the fastest,
    by more than the timing spread) or ``memory`` (the fewest bytes).

    Raises:
      ValueError: ``tolerance`` outside (0, 1) or ``prefer`` unknown.
      PolicyError: no candidate is eligible (one line: each one's reason).
    """
    check_choice(tolerance, prefer)
    reference = next((m for m in measurements if m.is_reference and not m.error), None)
    rows = []
    for m in measurements:
        change = _loss_change(m, reference)
        why = _drop_reason(m, change, tolerance)
        rows.append(Row(m, change, "failed" if m.error else "dropped" if why else "eligible", why or ""))
    eligible = [r for r in rows if r.verdict == "eligible"]
    if not eligible:
        raise PolicyError("no candidate is eligible: " + "; ".join(f"{r.measurement.name}: {r.reason}" for r in rows))
    choice, reason, confidence = (_speed_choice if prefer == "speed" else _memory_choice)(eligible)
    rows = [dataclasses.replace(r, verdict="picked", reason=reason) if r is choice
            else dataclasses.replace(r, reason=_against(r, choice, prefer)) if r.verdict == "eligible" else r
            for r in rows]
    notes = []
    if backend == "cpu":
        notes.append("on CPU, XLA computes float16/bfloat16 by converting to float32 and back: half precision is "
                     "not faster here, so the speed pick is fp32 unless the difference says otherwise; "
                     "--prefer memory picks by bytes")
    return PolicyPick(choice.measurement, tuple(rows), tolerance, prefer, backend, confidence, tuple(notes))


def _against(row: Row, choice: Row, prefer: str) -> str:
    """How an eligible candidate that was not picked compares with the one that was."""
    m, c = row.measurement, choice.measurement
    if prefer == "memory":
        return f"state {_bytes(m.state_bytes)} ({c.name}: {_bytes(c.state_bytes)})"
    if m.median_seconds is None or c.median_seconds is None:
        return "not timed"
    return f"{m.median_seconds / c.median_seconds:.2f}x {c.name}'s step time"


@dataclasses.dataclass(frozen=True)
class PolicyPick:
    """What :func:`pick_policy` decided: the ``choice``, every candidate's row, and how sure it is."""

    choice: Measurement
    rows: tuple[Row, ...]
    tolerance: float
    prefer: str
    backend: str | None
    confidence: str
    notes: tuple[str, ...] = ()

    @property
    def precision(self) -> dict[str, Any]:
        """The ``precision`` section's keys the choice sets: its policy and settings."""
        return {"policy": self.choice.policy, **self.choice.settings}

    @property
    def fragment(self) -> str:
        """A YAML config fragment (``precision:`` and its keys) to merge into the experiment's config."""
        return config_text(**self.precision)[0] + "\n"

    @property
    def overrides(self) -> tuple[str, ...]:
        """The same as ``key=value`` overrides: ``python -m train CONFIG <overrides>``."""
        return config_text(**self.precision)[1]

    def table(self) -> str:
        """The candidates, their measurements and verdicts, as text."""
        head = ("candidate", "numerics", "loss vs fp32", "skipped", "step ms (IQR)", "state", "step peak", "verdict")
        lines = [head]
        for r in self.rows:
            m = r.measurement
            numerics = m.numerics if not m.error else "-"
            change = "-" if r.loss_change is None else ("ref" if m.is_reference else f"{100 * r.loss_change:+.2f}%")
            time = "-" if m.median_seconds is None else f"{1e3 * m.median_seconds:.3g} ({1e3 * m.spread_seconds:.2g})"
            lines.append((m.name, numerics, change, str(m.skipped_steps) if m.steps else "-", time,
                          _bytes(m.state_bytes), _bytes(m.peak_bytes), r.verdict))
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        why = [f"  {r.measurement.name}: {r.verdict}: {r.reason}" for r in self.rows if r.reason]
        why += [f"  {r.measurement.name}: numerics: {r.measurement.numerics_note}" for r in self.rows
                if r.measurement.numerics in ("fixed", "warning")]
        return "\n".join([f"policy pick (prefer {self.prefer}, tolerance {100 * self.tolerance:g}% of float32's "
                          f"loss{', on ' + self.backend if self.backend else ''}):", *text, "why:", *why,
                          f"picked: {self.choice.name} -> {shlex.join(self.overrides)}",
                          f"confidence: {self.confidence}", *(f"note: {n}" for n in self.notes)])

    __str__ = table

    def to_dict(self) -> dict:
        """Plain data (``policy_pick.json``)."""
        return {"picked": self.choice.name, "precision": self.precision, "overrides": list(self.overrides),
                "fragment": self.fragment, "prefer": self.prefer, "tolerance": self.tolerance,
                "backend": self.backend, "confidence": self.confidence, "notes": list(self.notes),
                "candidates": [{**r.measurement.to_dict(), "loss_change": r.loss_change, "verdict": r.verdict,
                                "reason": r.reason} for r in self.rows]}


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3g} ms"
