"""The ``finetune`` section: LoRA adapters, frozen params and how the frozen base is stored
(:mod:`train.finetune`, docs/fine-tuning.md)."""

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from train.config.errors import invalid
from train.config.fields import Fraction, Number
from train.config.section import Section

__all__ = ["FinetuneConfig", "LoraConfig", "random_base_warning"]


def _regular_expressions(key: str, patterns: list[str] | None) -> list[str] | None:
    for pattern in patterns or ():
        try:
            re.compile(pattern)
        except re.error as e:
            raise invalid(f"{key}: {pattern!r} is not a regular expression ({e})") from None
    return patterns


class LoraConfig(Section):
    rank: int | None = Field(None, ge=1, description="rank of the low-rank adapters added beside the targets' "
                                                     "matmuls (e.g. 8); null: no adapters")
    alpha: Number | None = Field(None, gt=0, description="the adapters' update is scaled by alpha / rank "
                                                         "(null: alpha = rank)")
    targets: list[str] = Field([".+"], min_length=1, description="regular expressions matching whole module paths "
                                                                 "whose Dense / DenseGeneral / Einsum / Linear "
                                                                 "matmuls get adapters, e.g. ['block_\\d+/attn/.*'] "
                                                                 "(.+: every module with a name)")
    dropout: Fraction = Field(0.0, description="dropout on the adapters' input while training")

    @field_validator("targets")
    @classmethod
    def _targets_compile(cls, targets: list[str]) -> list[str]:
        return _regular_expressions("finetune.lora.targets", targets)


class FinetuneConfig(Section):
    lora: LoraConfig = Field(default_factory=LoraConfig, description="low-rank adapters (LoRA, by qwix)")
    freeze: list[str] | None = Field(None, description="regular expressions (searched) of param paths not "
                                                       "trained: no gradient, master or optimizer state; null: with "
                                                       "LoRA every param but the adapters, without it none")
    base: Literal["f32", "bf16", "f16", "int8", "nf4"] | None = Field(
        None, description="how frozen params are stored: f32, bf16, f16, or int8 / nf4 (weight matrices in 8-bit / "
                          "4-bit codes in blocks of 64, QLoRA's base; the rest in bf16); null: the policy's param dtype")

    @field_validator("freeze")
    @classmethod
    def _freeze_compiles(cls, freeze: list[str] | None) -> list[str] | None:
        return _regular_expressions("finetune.freeze", freeze)

    @field_validator("lora", mode="before")
    @classmethod
    def _empty_lora(cls, lora):
        return {} if lora is None else lora

    @property
    def active(self) -> bool:
        """Whether this run fine-tunes (adapters or frozen params)."""
        return self.lora.rank is not None or bool(self.freeze) or self.base is not None


def random_base_warning(config: Any) -> str | None:
    """A warning line for an experiment ``config`` that trains LoRA adapters without
    ``model.init_from``: the frozen base is then the run's own fresh init, random weights the
    adapters cannot make a fine-tuning of (a run's first lines and ``--check`` say so)."""
    if config.finetune.lora.rank is None or config.model.init_from is not None:
        return None
    return ("warning: finetune.lora without model.init_from: the frozen base is this run's fresh init (random "
            "weights), not a trained model; give model.init_from (a run's workdir or a Hugging Face Flax directory)")
