"""Fashion-MNIST (60k train / 10k test 28x28 grey images) from IDX files."""

from __future__ import annotations

import gzip
import os

import numpy as np

from train.data.base import ClassificationData, DataError

#: Where Debian's ``dataset-fashion-mnist`` package puts the files.
DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
         "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
HOW_TO_GET = ("Install them with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu, files land in "
              f"{DEFAULT_DIR}), or download the four IDX files from "
              "https://github.com/zalandoresearch/fashion-mnist and set data.path=DIR.")


def read_idx(path: str) -> np.ndarray:
    """Reads an IDX file (optionally gzipped) into an array."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:  # unreadable, truncated, or not gzip at all (BadGzipFile is an OSError)
        raise DataError(f"{path} cannot be read: {e}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} but the file holds {body.size} values")
    return body.reshape(dims)


def _find(directory: str, stem: str) -> str | None:
    for name in (stem + ".gz", stem):
        candidate = os.path.join(directory, name)
        if os.path.exists(candidate):
            return candidate
    return None


def load_fashion_mnist(path: str | None = None) -> ClassificationData:
    """Fashion-MNIST as (28, 28) float images standardised with the train mean and std."""
    directory = os.path.expanduser(path or DEFAULT_DIR)
    found = {key: _find(directory, stem) for key, stem in FILES.items()}
    missing = [FILES[k] + "[.gz]" for k, v in found.items() if v is None]
    if missing:
        raise DataError(f"Fashion-MNIST files not found in {directory}: missing {', '.join(missing)}. "
                        + HOW_TO_GET)
    arrays = {key: read_idx(p) for key, p in found.items()}
    x_train = arrays["x_train"].astype(np.float32) / 255.0
    x_test = arrays["x_test"].astype(np.float32) / 255.0
    mean, std = x_train.mean(), x_train.std()
    return ClassificationData("fashion_mnist", (x_train - mean) / std, arrays["y_train"].astype(np.int32),
                              (x_test - mean) / std, arrays["y_test"].astype(np.int32), num_classes=10)
