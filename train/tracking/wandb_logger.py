"""Weights & Biases for a run (``tracker.wandb``; process 0 only): every metrics
record at its step (each numeric field as ``kind/field``, as TensorBoard has it),
the resolved config, the precision report (the policy and :func:`precision.explain`'s
per-module table) and the end-of-run summary.

The W&B files go under ``WORKDIR/wandb``, and the run's id is kept there
(``WORKDIR/wandb/run_id``): rerunning the same command continues the same W&B run.
What wandb says on the terminal goes to the Python logger ``wandb`` (a run's
``train.log``). A wandb failure (the network, its service) never stops
training: one warning, and the run goes on without W&B (``metrics.jsonl``
keeps every record). In your own loop::

    with WandbLogger("my-project", "runs/mine", config={"lr": 1e-3}, mode="offline") as logger:
        logger.log({"kind": "train", "step": 10, "loss": 0.5})  # train/loss at step 10
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from typing import Any, Iterator, Mapping, Sequence, TextIO

import precision
from train.training.checkpoint import CheckpointError
from train.config import ConfigError, ExperimentConfig
from train.config.tracker import WandbConfig, missing_project, settings_without_project
from train.data import DataError
from train.tracking.metrics import OutputError

__all__ = ["INSTALL_HINT", "WandbLogger", "check_wandb", "exit_status", "import_wandb"]

INSTALL_HINT = "tracker.wandb needs the wandb package: pip install 'flax-mixed-precision[wandb]'"


def import_wandb() -> Any:
    """The ``wandb`` module; :class:`ConfigError` with how to install it where it is missing."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return wandb


def check_wandb(config: ExperimentConfig) -> None:
    """What :func:`train.run` checks of ``tracker.wandb`` before any compute: settings
    without a project, and the wandb package where it logs (:class:`ConfigError`, one line)."""
    unread = settings_without_project(config.tracker.wandb)
    if unread:
        raise ConfigError(missing_project(unread))
    if config.tracker.wandb.enabled:
        import_wandb()


def exit_status(error: BaseException | None) -> int:
    """The status ``python -m train`` exits with after ``error`` (the W&B run's exit code):
    0 done, 130 interrupted, 2 a bad config or data, 3 a checkpoint or output not written, else 1."""
    if error is None:
        return 0
    if isinstance(error, KeyboardInterrupt):
        return 130
    if isinstance(error, (ConfigError, DataError)):
        return 2
    return 3 if isinstance(error, (CheckpointError, OutputError)) else 1


def _number(value: Any) -> int | float | None:
    """A record's field as a W&B scalar (bools as 0/1); None for anything else (a message, a dtype)."""
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, bool):
        return int(value)
    return value if isinstance(value, (int, float)) else None


class WandbLogger:
    """A Weights & Biases run fed with metrics records (a context manager too: it finishes
    the run with :func:`exit_status` of the exception that leaves it).

    ``project``, ``entity``, ``mode`` (online, offline, disabled; None: wandb's choice),
    ``name`` (default: the workdir's name), ``group``, ``tags``, ``notes``: as
    ``wandb.init`` takes them. ``config``: the run's config (``wandb.config``).
    ``out``: where its one warning goes, should wandb fail.
    """

    def __init__(self, project: str, workdir: str, *, config: Mapping[str, Any] | None = None,
                 entity: str | None = None, mode: str | None = None, name: str | None = None,
                 group: str | None = None, tags: Sequence[str] = (), notes: str | None = None,
                 out: TextIO | None = None):
        self.wandb = import_wandb()
        self.workdir = os.path.abspath(workdir)
        self.out = sys.stderr if out is None else out
        self.run: Any = None  # the wandb run; None once closed
        self.failed = False  # wandb failed once: said so, and logs no more
        self._step = 0  # wandb's steps only increase: a resumed run skips records of steps it has
        id_file = os.path.join(self.workdir, "wandb", "run_id")
        with self._guard("start"):
            self.run = self.wandb.init(
                project=project, entity=entity, mode=mode, name=name or os.path.basename(self.workdir), group=group,
                tags=list(tags), notes=notes, dir=self.workdir, id=_read(id_file), resume="allow", reinit="create_new",
                settings=self.wandb.Settings(silent=True, console="off"))
            # wandb's warnings while the run lasts (they print from its service): to the logger, not the terminal
            self.wandb.termsetup(self.wandb.Settings(silent=True), logging.getLogger("wandb"))
            self.run.config.update(dict(config or {}), allow_val_change=True)  # a resumed run may change some
            if not self.run.disabled:
                with open(id_file, "w", encoding="utf-8") as f:  # wandb made the directory
                    f.write(self.run.id + "\n")
                self._step = self.run.step

    @classmethod
    def from_config(cls, settings: WandbConfig, workdir: str, config: Mapping[str, Any],
                    out: TextIO | None = None) -> "WandbLogger":
        """The logger a run's ``tracker.wandb`` section describes."""
        return cls(settings.project, workdir, config=config, entity=settings.entity, mode=settings.mode,
                   name=settings.name, group=settings.group, tags=settings.tags, notes=settings.notes, out=out)

    def log(self, record: Mapping[str, Any]) -> None:
        """Logs a metrics record: each numeric field as ``kind/field`` (``inference/DTYPE/field``
        for a record naming a ``dtype``) at the record's ``step``; a ``message`` as the summary's
        ``kind/message``. Records of steps the W&B run is past (logged before a resume) are skipped."""
        if not self.active:
            return
        kind = str(record.get("kind", "train"))
        prefix = f"{kind}/{record['dtype']}" if isinstance(record.get("dtype"), str) else kind
        values = {f"{prefix}/{key}": number for key, number in ((k, _number(v)) for k, v in record.items())
                  if key not in ("kind", "step") and number is not None}
        step = int(record.get("step", self._step))
        with self._guard("log"):
            if isinstance(record.get("message"), str):
                self.run.summary[f"{kind}/message"] = record["message"]
            if values and step >= self._step:
                self.run.log(values, step=step)
                self._step = step

    write = log  # the interface of train.MetricsWriter

    @property
    def active(self) -> bool:
        """A W&B run is open, and wandb has not failed."""
        return self.run is not None and not self.failed

    def log_precision(self, explanation: precision.Explanation | None, **fields: Any) -> None:
        """The precision report in the run's summary: ``fields`` (the policy, notes) as
        ``precision/NAME``, and from ``explanation`` the shares of matmul/conv FLOPs in half
        precision and FP8, its text, and ``precision/modules``, a table of it by module."""
        if not self.active:
            return
        report = {f"precision/{k}": v for k, v in fields.items()}
        with self._guard("log the precision report"):
            if explanation is not None:
                report.update({"precision/half_share": _share(explanation.half_share),
                               "precision/float32_uncovered_share": _share(explanation.uncovered_share),
                               "precision/explain": explanation.table(),
                               "precision/modules": self._module_table(explanation)})
                if explanation.shows_fp8:
                    report["precision/fp8_share"] = _share(explanation.fp8_share)
            self.run.summary.update(report)

    def _module_table(self, explanation: precision.Explanation) -> Any:
        """The explanation's table as a ``wandb.Table``, a row per module (FP8 columns where it shows FP8)."""
        fp8 = explanation.shows_fp8
        columns = ["module", "params", "matmul/conv", "FLOPs", "half share", "float32 because"]
        rows = [[m.path or "(top)", ",".join(m.param_dtypes), ",".join(m.matmul_dtypes), m.total_flops,
                 _share(m.half_share), m.f32_reason] + ([_share(m.fp8_share), m.not_fp8_reason, m.fp8_recipe]
                                                        if fp8 else [])
                for m in explanation.modules]
        return self.wandb.Table(columns=columns + (["fp8 share", "not fp8 because", "fp8 recipe"] if fp8 else []),
                                data=rows)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The end-of-run summary (``summary.json``'s content) into the run's summary."""
        if self.active:
            with self._guard("log the summary"):
                self.run.summary.update(dict(summary))

    def close(self, exit_code: int = 0) -> None:
        """Finishes the W&B run (uploading what is left, online) with ``exit_code``; idempotent."""
        run, self.run = self.run, None
        if run is None:
            return
        try:
            with self._guard("finish"):  # also after a failure: the run may still end cleanly
                run.finish(exit_code=exit_code)
        finally:
            self._restore_terminal()

    def _restore_terminal(self) -> None:
        """wandb's terminal output as it was before the run."""
        with contextlib.suppress(Exception):
            self.wandb.termsetup(self.wandb.sdk.wandb_setup.singleton().settings, None)  # no service started

    def __enter__(self) -> "WandbLogger":
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        self.close(exit_status(error))

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """A wandb failure: one warning on ``out`` (the first), the details in the log, and no more W&B logging."""
        try:
            yield
        except Exception as e:  # whatever wandb raises (network, service, filesystem): training goes on
            logging.getLogger("train").warning("Weights & Biases failed to %s", what, exc_info=True)
            if self.failed:
                return
            self.failed = True
            cause = " ".join(str(e).split())[:300] or "no details"  # one line; the log has the traceback
            print(f"warning: Weights & Biases failed to {what} ({type(e).__name__}: {cause}); the run goes on "
                  f"without it: metrics.jsonl keeps every record", file=self.out)


def _read(path: str) -> str | None:
    """The stripped text of ``path`` (None: no file, or an empty one)."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


def _share(value: float) -> float | None:
    """A share of FLOPs for W&B (None where there are no FLOPs to share)."""
    return None if math.isnan(value) else float(value)
