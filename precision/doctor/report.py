"""What the doctor says: a :class:`Diagnosis` with its problems, the changes it
verified (each with the measurement before and after), a table to print and a
dict to save (``diagnosis.json``)."""

from __future__ import annotations

import dataclasses
import math
import shlex

from precision.doctor.analysis import Findings, ModuleStats, Problem
from precision.doctor.probe import SCALES
from precision.policy import Policy

__all__ = ["Diagnosis", "Recommendation"]


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """A change the doctor applied, diagnosed again, and saw fix a problem."""

    change: str  # in words
    yaml: str  # a YAML mapping to merge into a config file (``precision:`` and its keys)
    python: str  # as code
    problem: Problem  # the problem it fixes
    before: str  # e.g. "overflow 2.1%"
    after: str  # e.g. "overflow 0%"
    overrides: tuple[str, ...] = ()  # the same as ``key=value`` for ``python -m train CONFIG ...``
    summary: str = ""  # the change alone, for one line (a rule: without the rules it keeps), if not the overrides

    @property
    def command_line(self) -> str:
        """The overrides as shell words (quoted where a shell would split or glob them)."""
        return " ".join(shlex.quote(o) for o in self.overrides)

    def to_dict(self) -> dict:
        return {"change": self.change, "yaml": self.yaml, "overrides": list(self.overrides), "python": self.python,
                "problem": self.problem.to_dict(), "before": self.before, "after": self.after, "summary": self.summary}


def _pct(share: float) -> str:
    return f"{100 * share:.3g}%"


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What :func:`precision.diagnose` found; ``print`` it for the table."""

    name: str
    policy: Policy
    loss_scale: float
    findings: Findings
    recommendations: tuple[Recommendation, ...]
    notes: tuple[str, ...] = ()  # what was checked and found not to be precision's (e.g. also in float32)
    verified: bool = True  # changes were tried (False: ``verify=False``, only diagnosed)

    @property
    def problems(self) -> tuple[Problem, ...]:
        return self.findings.problems

    @property
    def modules(self) -> tuple[ModuleStats, ...]:
        return self.findings.modules

    @property
    def first_nonfinite(self) -> dict | None:
        """Where numerics first failed: ``{"op", "path", "pass"}`` (None: nothing non-finite)."""
        return self.findings.first_nonfinite

    @property
    def healthy(self) -> bool:
        return not self.findings.problems and self.findings.first_nonfinite is None

    def to_dict(self) -> dict:
        """Plain data: the schema of ``diagnosis.json`` (see docs/diagnose.md)."""
        f = self.findings
        return {
            "model": self.name, "policy": str(self.policy), "loss_scale": self.loss_scale, "healthy": self.healthy,
            "loss": None if math.isnan(f.loss) else f.loss,
            "first_nonfinite": f.first_nonfinite,
            "problems": [p.to_dict() for p in f.problems],
            "recommendations": [r.to_dict() for r in self.recommendations],
            "loss_scale_range": list(f.scale_range) if f.scale_range else None,
            "underflow_at_loss_scale": {f"{s:g}": v for s, v in (f.underflow_at or {}).items()},
            "modules": [{"path": m.path, "pass": "backward" if m.backward else "forward", "dtypes": list(m.dtypes),
                         "amax": m.amax, "headroom_bits": None if math.isinf(m.headroom) else m.headroom,
                         "overflow": m.overflow, "nonfinite": m.nonfinite, "flushed": m.flushed,
                         "subnormal": m.subnormal,
                         "underflow_at_loss_scale": None if m.flushed_at is None else
                         {f"{s:g}": v for s, v in zip(SCALES, m.flushed_at)}} for m in f.modules],
            "notes": list(self.notes),
            "seconds": {k: round(v, 3) for k, v in f.seconds.items()},
        }

    def table(self) -> str:
        head = f"precision.diagnose: {self.name} under {self.policy} (loss scale {self.loss_scale:g})"
        if self.healthy:
            return (f"{head}: healthy: no overflow or non-finite value, underflow and rounding below the "
                    f"thresholds" + (f"; {'; '.join(self.notes)}" if self.notes else ""))
        lines = [head]
        first = self.findings.first_nonfinite
        if first:
            lines.append(f"first non-finite value: {first['op']} in {first['path']} ({first['pass']})")
        lines.append("problems:")
        lines += [f"  {p.kind:<9} {p.pass_:<8} {p.path}{' ' + p.op if p.op else ''}: {_pct(p.share)}  ({p.detail})"
                  for p in self.problems]
        if self.findings.scale_range:
            low, high = self.findings.scale_range
            lines.append(f"float16 loss scales: no overflow up to {high:.4g}; least underflow from {low:g}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append("modules (worst first):")
        lines += _module_rows(self.findings.modules)
        if self.recommendations:
            lines.append("verified changes (applied, diagnosed again):")
            for r in self.recommendations:
                lines.append(f"  {r.change}: {r.before} -> {r.after}")
                if r.summary:
                    lines.append(f"    change: {r.summary}")
                lines.append("    yaml:   " + r.yaml.replace("\n", "\n            "))
                if r.overrides:
                    lines.append(f"    command line: {r.command_line}")
                lines.append(f"    python: {r.python}")
        elif any("float32 too" in n for n in self.notes):
            lines.append("no change recommended: the failure is the same in float32 (see the note)")
        elif not self.verified:
            lines.append("no change tried: verification was off (verify=False)")
        else:
            lines.append("no verified change: none of the changes tried fixed these")
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return self.table()


def _module_rows(modules: tuple[ModuleStats, ...], most: int = 12) -> list[str]:
    def badness(m: ModuleStats) -> tuple:
        return (-m.overflow, -m.flushed, m.headroom)

    rows = [("module", "pass", "dtypes", "amax", "headroom", "overflow", "flushed", "subnormal")]
    for m in sorted(modules, key=badness)[:most]:
        rows.append((m.path, "backward" if m.backward else "forward", ",".join(m.dtypes), f"{m.amax:.3g}",
                     "-" if math.isinf(m.headroom) else f"{m.headroom:.1f} bits", _pct(m.overflow), _pct(m.flushed),
                     _pct(m.subnormal)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
