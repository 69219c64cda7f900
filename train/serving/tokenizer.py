"""Text to token ids and back: a run's character vocabulary, or a Hugging Face tokenizer.

A character-level run (Shakespeare, or any text file) has its vocabulary in its data:
every character of the text, sorted (:func:`train.data.text.load_text`). A character
outside it cannot be encoded, and is refused naming it, where it is, and what the
vocabulary holds. A Hugging Face model is served with the tokenizer saved beside it
(``tokenizer.json``, or ``vocab.json`` + ``merges.txt``...), read by transformers'
``AutoTokenizer`` offline.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from train.data.text import encode
from train.weights.export import HF_FILES

__all__ = ["SampleError", "CharTokenizer", "HuggingFaceTokenizer", "huggingface_tokenizer", "TOKENIZER_FILES"]

#: Files of a Hugging Face directory that make a tokenizer.
TOKENIZER_FILES = tuple(f for f in HF_FILES if f not in ("config.json", "generation_config.json"))


class SampleError(ValueError):
    """Sampling cannot start: bad input or a model that cannot be sampled (one line)."""


class CharTokenizer:
    """A character vocabulary (sorted, as the run's data made it): one id per character."""

    def __init__(self, vocab: str):
        self.vocab = vocab
        self.size = len(vocab)

    def describe(self) -> str:
        return f"its {self.size} characters"

    @property
    def default_prompt(self) -> str:
        """What ``sample`` continues without a prompt: a newline, or the vocabulary's first character
        where it has no newline (a synthetic text's)."""
        return "\n" if "\n" in self.vocab else self.vocab[0]

    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text``; :class:`SampleError` for a character the vocabulary lacks."""
        missing = sorted(set(text) - set(self.vocab))
        if missing:
            where = next(i for i, c in enumerate(text) if c in missing)
            shown = "".join(c for c in self.vocab if c.isprintable() and not c.isspace())
            spaces = "".join(c for c in self.vocab if c.isspace())
            raise SampleError(f"the prompt has {len(missing)} character{'s' * (len(missing) > 1)} outside the "
                              f"model's vocabulary ({', '.join(repr(c) for c in missing[:5])}; the first "
                              f"at position {where}); it knows {self.size} characters: {shown!r}"
                              + (f" and the whitespace {spaces!r}" if spaces else " (no whitespace)"))
        return encode(text, self.vocab)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[i] for i in np.asarray(ids).ravel())


class HuggingFaceTokenizer:
    """A tokenizer saved beside a Hugging Face model, read with transformers' ``AutoTokenizer``."""

    def __init__(self, tokenizer: Any, directory: str):
        self.tokenizer = tokenizer
        self.directory = directory
        self.size = len(tokenizer)

    def describe(self) -> str:
        return f"the tokenizer in {self.directory} ({self.size} tokens)"

    #: What ``sample`` continues without a prompt.
    default_prompt = "\n"

    def encode(self, text: str) -> np.ndarray:
        ids = self.tokenizer(text)["input_ids"]
        if not ids:
            raise SampleError("the prompt is empty after tokenization: give at least one token of text")
        unknown = getattr(self.tokenizer, "unk_token_id", None)
        if unknown is not None and unknown in ids:
            raise SampleError(f"the prompt has text the tokenizer in {self.directory} cannot encode (token "
                              f"{self.tokenizer.unk_token!r} at token {ids.index(unknown)})")
        return np.asarray(ids, np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).ravel()])


def huggingface_tokenizer(directory: str) -> HuggingFaceTokenizer | None:
    """The tokenizer saved in ``directory``, or None if it holds no tokenizer files."""
    directory = os.path.expanduser(directory)
    if not any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES):
        return None
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable tokenizer is reported the same way
        raise SampleError(f"{directory}: its tokenizer cannot be read ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return HuggingFaceTokenizer(tokenizer, directory)
