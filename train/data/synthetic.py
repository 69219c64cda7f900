"""Generated data for tests and benchmarks: learnable, deterministic, any size."""

from __future__ import annotations

import numpy as np

from train.data.base import ClassificationData, DataError, TextData, host_memory_bytes


def load_synthetic(num_train: int = 4096, num_test: int = 1024, input_shape=(32,), num_classes: int = 10,
                   seed: int = 0) -> ClassificationData:
    """Gaussian inputs labelled by a fixed random linear teacher (so accuracy can rise)."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in input_shape)
    if min(shape, default=1) < 1:
        raise DataError(f"data.input_shape: every size must be >= 1, got {list(shape)}")
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
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, (vocab_size, 4))
    choices = rng.integers(0, 4, num_train + num_test)
    ids = np.empty(num_train + num_test, np.int32)
    ids[0] = 0
    for i in range(1, len(ids)):
        ids[i] = successors[ids[i - 1], choices[i]]
    vocab = "".join(chr(0x100 + i) for i in range(vocab_size))
    return TextData("synthetic_text", ids[:num_train], ids[num_train:], vocab, seq_len)
