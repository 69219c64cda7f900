"""Weights from elsewhere: another run's checkpoint, a Hugging Face Flax model or an export,
matched to the model being trained (:mod:`.pretrained`, :mod:`.huggingface`); and a run's
weights written for serving, what of that needs no model (:mod:`.export`: the files, a
quantized base read back, LoRA adapters' layouts).

May import :mod:`precision`, :mod:`train.parallel`, :mod:`train.data` and :mod:`train.config`
(docs/design.md).
"""
