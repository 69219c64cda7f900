"""A QLoRA run served as it stored its weights: ``--dtype nf4``.

A run fine-tuned on a frozen base in NormalFloat4 codes (``finetune.base: nf4``, QLoRA's base:
:mod:`precision.quantized_weights`) keeps each base matrix as 4-bit level indices in blocks of
64 with a float32 scale per block, and its LoRA adapters beside it. Serving it in ``nf4`` keeps
both as trained: the codes and scales as the checkpoint holds them (half a byte per value, and
4 bytes per 64), never requantized; the adapters unmerged, ``x @ A @ B * alpha / rank`` beside
each adapted matmul, as qwix computed them in training (merging them into a weight of 16 levels
would round them away); the rest (biases, norms, adapters) as ``--dtype bf16`` serves it. The
model reads each base matrix through its autocast as training read it
(:func:`precision.quantized_weights.read_in_program`): dequantized into the operand of the matmul
that reads it, no bfloat16 copy kept.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from flax import nnx, traverse_util

from precision.quantized_weights import QuantizedWeight
from train.finetune import FineTune, finetune_model
from train.inspections.export import MergedRun, run_lora
from train.serving.tokenizer import SampleError
from train.weights.export import ExportError, adapter_pairs

__all__ = ["StoredBase", "stored_base"]

Flat = dict[tuple[str, ...], Any]


class StoredBase(NamedTuple):
    """A run's weights as stored: ``model`` (the run's, with its LoRA adapters if it has any),
    ``params`` (nested float32 arrays: each base matrix its codes read back, the adapters
    unmerged) and ``codes`` (``{path: QuantizedWeight}``: the base matrices as saved)."""

    model: Any
    params: Any
    codes: dict[tuple[str, ...], QuantizedWeight]
    adapters: int  # adapted weights

    @property
    def code(self) -> str:
        return next(iter(self.codes.values())).code


def stored_base(run: MergedRun) -> StoredBase | None:
    """The weights of ``run`` as its checkpoint stores them, when it stores a base in codes (a
    fine-tuning with ``finetune.base`` int8 or nf4); None for a run that stores floats."""
    if not run.codes:
        return None
    flat = {k: np.asarray(v, np.float32) if np.issubdtype(np.asarray(v).dtype, np.floating) else np.asarray(v)
            for k, v in run.unmerged.items()}
    pairs = adapter_pairs(flat)
    model = run.model
    if pairs:
        try:
            spec = run_lora(run.config, "served unmerged")
        except ExportError as e:
            raise SampleError(f"{run.path}: {e}") from None
        model = finetune_model(nnx.clone(model) if isinstance(model, nnx.Module) else model, FineTune(lora=spec),
                               *run.sample)
    return StoredBase(model, traverse_util.unflatten_dict(flat), run.codes, len(pairs))
