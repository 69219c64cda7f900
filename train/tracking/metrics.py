"""Where metrics go: ``metrics.jsonl`` (one JSON object a line), TensorBoard
event files, and a progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any


class OutputError(RuntimeError):
    """A run's output (metrics, summary) could not be written; the message names the file and the cause."""


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan; keep the line parseable
    return value


class MetricsWriter:
    """Appends records to ``WORKDIR/metrics.jsonl`` and ``WORKDIR/tensorboard/``.

    A record is a flat dict with ``kind`` (``train``, ``eval``, ``inference``)
    and ``step``; every other numeric field becomes the TensorBoard scalar
    ``kind/field``. Resumed runs append to the same files.
    """

    def __init__(self, workdir: str, tensorboard: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        record = {k: _plain(v) for k, v in record.items()}
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:
            raise OutputError(f"could not write {self.path}: {e.strerror or e}; the checkpoints in "
                              f"{os.path.dirname(self.path)}/checkpoints are intact: make room (or make it "
                              f"writable again) and rerun the same command to resume") from None
        if self._tb is not None:
            kind, step = record.get("kind", "train"), record.get("step", 0)
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)):  # bools too
                    self._tb.add_scalar(f"{kind}/{key}", float(value), step)

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # a write that failed has been reported; closing says nothing new
            pass
        if self._tb is not None:
            self._tb.close()


class NullWriter:
    """A writer that keeps nothing: processes other than 0 of a multi-process run."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All records of ``WORKDIR/metrics.jsonl``, in order."""
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A tqdm progress bar over steps showing loss, loss scale and throughput
    (silent when disabled)."""

    def __init__(self, total: int, initial: int, enabled: bool = True):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                             mininterval=0.5)

    def update(self, steps: int, **fields: Any) -> None:
        if self._bar is None:
            return
        self._bar.update(steps)
        if fields:
            self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in fields.items()},
                                  refresh=False)

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
