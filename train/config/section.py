"""The base of every config section: strict fields, unknown keys refused, and an
assignment validated like a file's value, failing with one line naming the dotted key."""

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from train.config.errors import ConfigError, error_message

__all__ = ["Section"]


class Section(BaseModel):
    """Strict sections; an assignment is validated too and fails with a :class:`ConfigError`
    naming ``dotted_key`` + the field (the value before it is kept)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)
    dotted_key: ClassVar[str] = ""  # the section's key in errors ("optimizer", "tracker.wandb")

    def __setattr__(self, name: str, value: Any) -> None:
        before = self.__dict__.get(name)
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            if name in self.__dict__:  # pydantic has set the value when a model validator fails: undo
                self.__dict__[name] = before
            prefix = tuple(self.dotted_key.split(".")) if self.dotted_key else ()
            raise ConfigError(error_message(e.errors()[0], type(self), prefix)) from None
