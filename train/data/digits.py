"""scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package)."""

import numpy as np

from train.data.base import ClassificationData

TEST_SIZE = 297


def load_digits_data(path: str | None = None) -> ClassificationData:
    """Digits as (8, 8) float images in [0, 1]; a fixed split: 1500 train, 297 test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    n = len(x) - TEST_SIZE
    return ClassificationData("digits", x[:n], y[:n], x[n:], y[n:], num_classes=10)
