"""The ``sharding`` section: the layout of chosen params over the mesh, overriding the
tensor-parallel plan found in the model's program (:mod:`train.parallel.tensor`,
docs/tensor-parallelism.md)."""

from typing import Any

from pydantic import Field, field_validator

from train.config.errors import invalid
from train.config.section import Section
from train.parallel.tensor.planning import TensorLayoutError, parse_rules

__all__ = ["ShardingConfig"]


class ShardingConfig(Section):
    rules: list = Field([], description="[[regex, [axis, ...]], ...]: a param whose path (a/b/kernel) the regex "
                                        "finds gets one mesh axis per dimension (tensor, fsdp or null: whole), "
                                        "instead of the layout found in the program; the first rule that "
                                        "matches wins, e.g. [['head/kernel', [fsdp, null]]]")

    @field_validator("rules")
    @classmethod
    def _rules_parse(cls, rules: list) -> list:
        try:
            parse_rules(rules)
        except TensorLayoutError as e:
            raise invalid(str(e)) from None
        return rules

    def parsed(self) -> tuple[Any, ...]:
        """The rules as :class:`train.parallel.distributed.Layout` takes them."""
        return parse_rules(self.rules)
