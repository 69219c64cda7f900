"""Every name a config gives, resolved once, before anything is built.

A config names its data (``data.name``), its model (``model.name``), its task
(``task``), its optimizer and schedule (``optimizer.name``, ``optimizer.schedule``):
a built-in, one of optax's by name, or the user's own code (``package.module:Name``,
``path/to/file.py:Name``). :func:`resolve_names` looks each one up in this one
place (it imports the user's files and checks that each names something callable)
and returns :class:`Names`; the builders (:mod:`.builders`, :mod:`.optimizers`) read
the resolved values and never a name. Each failure is one line naming the key.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from train.config import ConfigError
from train.config.fields import OPTIMIZERS, SCHEDULES, optax_optimizers, optax_schedules
from train.data import DATASETS, DataError
from train.models import MODELS
from train.references import UserCodeError, is_reference, resolve
from train.training.tasks import TASK_NAMES

__all__ = ["Names", "Resolved", "resolve_data", "resolve_model", "resolve_names", "resolve_optimizer",
           "resolve_schedule", "resolve_task"]


class Resolved(NamedTuple):
    """What one name of a config stands for.

    ``target`` is the function or class it names; ``None`` for a built-in that its
    builder knows by name (a shipped dataset, ``adam``, ``cosine``, the built-in tasks).
    """

    key: str
    name: str
    target: Callable | None

    @property
    def builtin(self) -> bool:
        """Whether the name is one its builder knows (shipped with the project)."""
        return self.target is None or self.key == "model.name" and self.name in MODELS

    @property
    def label(self) -> str:
        """How errors name it: ``optax.lamb``, ``optax.contrib.muon``, ``my_models.py:Net``."""
        module = getattr(getattr(self.target, "func", self.target), "__module__", "") or ""
        if ":" in self.name or not module.startswith("optax"):
            return self.name
        return f"optax.contrib.{self.name}" if module.startswith("optax.contrib") else f"optax.{self.name}"


class Names(NamedTuple):
    """The resolved names of one experiment config."""

    data: Resolved
    task: Resolved
    model: Resolved
    optimizer: Resolved
    schedule: Resolved


#: What each key's reference must name, for the errors.
_KINDS = {"data.name": "a function returning data", "task": "a function fn(outputs, batch) -> (loss, metrics)",
          "model.name": "a model class or factory", "optimizer.name": "an optimizer factory",
          "optimizer.schedule": "a schedule factory"}


def resolve_names(config: Any) -> Names:
    """Every name ``config`` gives (data, task, model, optimizer, schedule), resolved: first
    those the project and optax know, then the user's code, imported in one pass.

    Raises:
      DataError: ``data.name`` does not name a dataset or a data function.
      ConfigError: any other name does not resolve, naming its key.
    """
    given = {"data.name": config.data.name, "task": config.task, "model.name": config.model.name,
             "optimizer.name": config.optimizer.name, "optimizer.schedule": config.optimizer.schedule}
    return Names(*_resolve(given).values())


def resolve_data(name: str) -> Resolved:
    """``data.name``: a shipped dataset (by name) or the user's data function."""
    return _resolve({"data.name": name})["data.name"]


def resolve_task(spec: str | Callable) -> Resolved:
    """``task``: a built-in task (``auto``: the data's, decided when the data is built), the
    user's loss function, or a reference to one."""
    return _resolve({"task": spec})["task"]


def resolve_model(name: str) -> Resolved:
    """``model.name``: a built-in model or the user's Linen / NNX class or factory."""
    return _resolve({"model.name": name})["model.name"]


def resolve_optimizer(name: str) -> Resolved:
    """``optimizer.name``: a built-in (adam, adamw, lion, sgd), any optax optimizer by name,
    or the user's factory."""
    return _resolve({"optimizer.name": name})["optimizer.name"]


def resolve_schedule(name: str) -> Resolved:
    """``optimizer.schedule``: a built-in (constant, cosine, linear), any optax schedule by
    name, or the user's factory."""
    return _resolve({"optimizer.schedule": name})["optimizer.schedule"]


def _resolve(given: dict[str, Any]) -> dict[str, Resolved]:
    """``{key: name}`` resolved, built-ins and optax's first, the user's code after."""
    found = {key: _known(key, name) for key, name in given.items()}
    references = {key: name for key, name in given.items() if found[key] is None}
    for key, target in _import_all(references).items():
        found[key] = Resolved(key, str(given[key]).strip(), target)
    return found


def _known(key: str, name: Any) -> Resolved | None:
    """``name`` as the project or optax knows it under ``key`` (None: a reference to the user's code)."""
    if callable(name):  # the Python API's own function (a task's loss)
        return Resolved(key, getattr(name, "__name__", "custom"), name)
    name = str(name).strip()
    if key == "data.name" and name in DATASETS or key == "task" and name in TASK_NAMES:
        return Resolved(key, name, None)
    if key == "model.name" and name in MODELS:
        return Resolved(key, name, MODELS[name])
    catalogs = {"optimizer.name": (OPTIMIZERS, optax_optimizers), "optimizer.schedule": (SCHEDULES, optax_schedules)}
    if key in catalogs:
        builtins, optax_catalog = catalogs[key]
        if name in builtins:
            return Resolved(key, name, None)
        if name in optax_catalog():
            return Resolved(key, name, optax_catalog()[name])
    if key == "task" and not is_reference(name):
        raise ConfigError(f"task: unknown task {name!r}; valid: {', '.join(TASK_NAMES)}, or a loss "
                          f"module:function / path/to/file.py:function")
    return None


def _import_all(references: dict[str, str]) -> dict[str, Callable]:
    """The user's objects ``{key: reference}`` names, each callable: the one place a config's
    names import user code."""
    found = {}
    for key, reference in references.items():
        try:
            target = resolve(str(reference), key)
            if not callable(target):
                raise UserCodeError(f"{key}: {reference} is a {type(target).__name__}, not {_KINDS[key]}")
        except UserCodeError as e:
            raise (DataError if key == "data.name" else ConfigError)(str(e)) from None
        found[key] = target
    return found
