"""Fine-tuning: LoRA adapters on any Flax model, frozen params that cost only their storage.

- :mod:`.spec`: :class:`FineTune`, what a run trains and how it stores the rest;
- :mod:`.lora`: adapters by qwix's model surgery, checked against the model;
- :mod:`.frozen`: frozen params: no gradient, master or optimizer state.

May import :mod:`train.data` (a model's sample inputs) and qwix; nothing else of ``train``.
"""

from train.finetune.frozen import FreezeError, frozen_paths, merge, param_leaves, param_paths, stored_frozen, trainable
from train.finetune.lora import LoRA, adapted_modules, is_adapter, with_lora
from train.finetune.spec import BASE_DTYPES, FineTune, base_dtype, finetune_frozen, finetune_model, \
    finetune_note

__all__ = ["FineTune", "LoRA", "FreezeError", "BASE_DTYPES", "with_lora", "is_adapter", "adapted_modules",
           "frozen_paths", "param_leaves", "param_paths", "trainable", "merge", "stored_frozen", "base_dtype", "finetune_frozen",
           "finetune_model", "finetune_note"]
