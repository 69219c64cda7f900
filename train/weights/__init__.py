"""Weights from elsewhere: another run's checkpoint or a Hugging Face Flax model, matched to
the model being trained (:mod:`.pretrained`, :mod:`.huggingface`).

May import :mod:`precision`, :mod:`train.parallel`, :mod:`train.data` and :mod:`train.config`
(docs/design.md).
"""
