"""Generated data for tests and benchmarks: learnable, deterministic, any size."""

from __future__ import annotations

import numpy as np

from train.data.base import ClassificationData, DataError, TextData, host_memory_bytes


def load_synthetic(num_train: int = 4096, num_test: int = 1024, input_shape=(32,), num_classes: int = 10,
                   seed: int = 0) -> ClassificationData:
    """Gaussian inputs labelled by a fixed random linear teacher (so accuracy can rise)."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in input_shape)
    if not shape:
        raise DataError(f"data.input_shape: [] makes each input one number (no feature axis); the synthetic data "
                        f"needs at least one axis, e.g. data.input_shape=[32] (its linear teacher on one number "
                        f"gives at most 2 of the {num_classes} classes, by the number's sign)")
    if min(shape) < 1:
        raise DataError(f"data.input_shape: every size must be >= 1, got {list(shape)}")
    if num_classes < 2:
        raise DataError(f"data.num_classes: {num_classes} class: a classifier needs at least 2 (with one, every "
                        f"label is 0, the loss is 0 whatever the model does, and nothing trains)")
    nbytes = (num_train + num_test) * int(np.prod(shape)) * 4
    memory = host_memory_bytes()
    if memory and nbytes > memory // 2:
        raise DataError(f"synthetic data of {num_train + num_test} examples of shape {shape} takes "
                        f"{nbytes / 1e9:.3g} GB, more than half the {memory / 1e9:.3g} GB of memory here; reduce "
                        f"data.num_train, data.num_test or data.input_shape")
    x = rng.standard_normal((num_train + num_test,) + shape, dtype=np.float32)
    teacher = rng.standard_normal((int(np.prod(shape)), num_classes)).astype(np.float32)
    y = np.argmax(x.reshape(len(x), -1) @ teacher, axis=-1).astype(np.int32)
    return ClassificationData("synthetic", x[:num_train], y[:num_train], x[num_train:], y[num_train:],
                              num_classes)


def load_synthetic_text(num_train: int = 200_000, num_test: int = 20_000, vocab_size: int = 64,
                        seq_len: int = 128, seed: int = 0) -> TextData:
    """Tokens from a random sparse bigram chain: predictable, unlike uniform noise."""
    if vocab_size < 2:
        raise DataError(f"data.num_classes: a vocabulary of {vocab_size} token: a language model needs at least 2 "
                        f"(with one, every next token is known, the loss is 0 and nothing trains)")
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, (vocab_size, 4))
    choices = rng.integers(0, 4, num_train + num_test)
    ids = np.empty(num_train + num_test, np.int32)
    ids[0] = 0
    for i in range(1, len(ids)):
        ids[i] = successors[ids[i - 1], choices[i]]
    vocab = "".join(chr(0x100 + i) for i in range(vocab_size))
    return TextData("synthetic_text", ids[:num_train], ids[num_train:], vocab, seq_len)
