"""The base of every config section: strict fields, unknown keys refused, ``null``
unsetting a key that takes no null (its default applies, as if the key were not
given: the way to take back on the command line what a file sets), and an
assignment validated like a file's value, failing with one line naming the dotted key."""

import types
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from train.config.errors import ConfigError, error_message

__all__ = ["Section", "takes_null", "unset_nulls"]


def takes_null(annotation: Any) -> bool:
    """Whether a field of this type takes ``null`` as a value of its own (``X | None``, ``Any``)."""
    if annotation is Any or annotation is type(None):
        return True
    if typing.get_origin(annotation) is typing.Annotated:
        return takes_null(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(takes_null(a) for a in typing.get_args(annotation))
    return False


def unset_nulls(raw: dict, fields: dict) -> dict:
    """``raw`` without the keys set to None whose field (of pydantic ``fields``) has a
    default and takes no null: null unsets them. Other keys are left to validation (a
    required one then fails naming itself)."""
    return {k: v for k, v in raw.items()
            if not (v is None and k in fields and not fields[k].is_required() and not takes_null(fields[k].annotation))}


class Section(BaseModel):
    """Strict sections; an assignment is validated too and fails with a :class:`ConfigError`
    naming ``dotted_key`` + the field (the value before it is kept)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)
    dotted_key: ClassVar[str] = ""  # the section's key in errors ("optimizer", "tracker.wandb")

    @model_validator(mode="before")
    @classmethod
    def _null_unsets(cls, raw: Any) -> Any:
        """``key: null`` (``key=null`` on the command line) for a key that takes no null: as if not given."""
        return unset_nulls(raw, cls.model_fields) if isinstance(raw, dict) else raw

    def __setattr__(self, name: str, value: Any) -> None:
        before = self.__dict__.get(name)
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            if name in self.__dict__:  # pydantic has set the value when a model validator fails: undo
                self.__dict__[name] = before
            prefix = tuple(self.dotted_key.split(".")) if self.dotted_key else ()
            raise ConfigError(error_message(e.errors()[0], type(self), prefix)) from None
