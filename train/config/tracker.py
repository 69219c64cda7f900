"""The ``tracker`` section: where a run's metrics go besides ``WORKDIR/metrics.jsonl``:
TensorBoard (on unless ``tracker.tensorboard: false``) and Weights & Biases (off
unless ``tracker.wandb.project`` is set; see :mod:`train.tracking.wandb_logger`).

A section of its own module (the schema imports it): its base repeats the
schema's strictness, with the dotted key of each section in its errors.
"""

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from train.config.errors import invalid
from train.config.section import Section

__all__ = ["TrackerConfig", "WandbConfig", "WANDB_MODES", "TRACKER_KEYS", "missing_project", "settings_without_project"]

#: ``tracker.wandb.mode`` as wandb names its modes.
WANDB_MODES = ("online", "offline", "disabled")


_Section = Section


class WandbConfig(_Section):
    """A Weights & Biases run for the experiment (``wandb.init``'s arguments); off while ``project`` is null."""

    dotted_key: ClassVar[str] = "tracker.wandb"
    project: str | None = Field(None, min_length=1, description="W&B project to log to (null: no W&B; required "
                                                                "when tracker.wandb is given)")
    entity: str | None = Field(None, description="W&B user or team (null: your default entity)")
    mode: Literal[WANDB_MODES] | None = Field(None, description="online, offline (kept in WORKDIR/wandb; upload later "
                                                                "with wandb sync) or disabled; null: wandb's own "
                                                                "choice ($WANDB_MODE, `wandb offline`, else online)")
    name: str | None = Field(None, description="run name (null: the workdir's name)")
    group: str | None = Field(None, description="group the run belongs to (null: none)")
    tags: list[str] = Field([], description="tags of the run")
    notes: str | None = Field(None, description="a longer description of the run")

    @property
    def enabled(self) -> bool:
        """A project is named and the mode is not ``disabled``."""
        return self.project is not None and self.mode != "disabled"


class TrackerConfig(_Section):
    """Where metrics go besides ``metrics.jsonl``."""

    dotted_key: ClassVar[str] = "tracker"
    tensorboard: bool = Field(True, description="TensorBoard event files in WORKDIR/tensorboard")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases (null: off)")

    @field_validator("wandb", mode="before")
    @classmethod
    def _project_named(cls, wandb: Any) -> Any:
        if isinstance(wandb, dict) and settings_without_project(wandb):
            raise invalid(missing_project(settings_without_project(wandb)))
        return {} if wandb is None else wandb  # a section header with nothing under it: off


def settings_without_project(wandb: dict | WandbConfig) -> list[str]:
    """The ``tracker.wandb`` keys (of a mapping or a :class:`WandbConfig`) set to something
    while ``project`` is null: settings no run would read."""
    given = wandb if isinstance(wandb, dict) else {k: getattr(wandb, k) for k in wandb.model_fields_set}
    if given.get("project") is not None:
        return []
    return [k for k, v in given.items() if k != "project" and v not in (None, [])]


def missing_project(keys: list[str]) -> str:
    """The one line for ``tracker.wandb`` settings ``keys`` given without a project."""
    return (f"tracker.wandb.project is required to log to Weights & Biases (tracker.wandb.{keys[0]} is set); set "
            f"tracker.wandb.project=NAME, or leave tracker.wandb out")


#: Dotted keys of the section: a resumed run may change them (where its metrics go, not what it trains).
TRACKER_KEYS = ("tracker.tensorboard", *(f"tracker.wandb.{k}" for k in WandbConfig.model_fields))
