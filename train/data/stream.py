"""A user's data as a stream: any iterable of examples (a generator, an iterator,
an object whose ``__iter__`` starts a new pass, a ``grain.IterDataset``).

Batch ``i`` of a run is the next ``batch_size`` examples of the stream, in the
stream's own order (a stream is not shuffled: shuffle it yourself, e.g. grain's
``MapDataset.shuffle`` before ``to_iter_dataset``). Batch ``i`` holds examples
``i * batch_size .. (i + 1) * batch_size - 1``, so the data position of a
checkpoint at step ``s`` is ``s * batch_size`` examples. A re-iterable stream
(``iter(x) is not x``) starts a new pass at its end; a one-shot iterator that
runs out is an error.

Resume: an iterator with grain's ``get_state()`` / ``set_state()`` (a
``grain.IterDataset``'s, a ``grain.DataLoader``'s) has its state recorded at
every batch boundary and saved in the checkpoint, and a resumed run sets it; any
other stream is replayed: read from its start and dropped up to the position.
"""

from __future__ import annotations

import base64
import collections
import itertools
import json
from typing import Any, Iterator

import jax
import numpy as np

from train.data.base import Batch, DataError, zero_padded
from train.references import one_line

__all__ = ["EvalStream", "TrainStream", "is_stream", "stack_examples"]

_STATES_KEPT = 4096  # batch boundaries whose iterator state is kept (the loop reads a few calls ahead)


def is_stream(split: Any) -> bool:
    """Whether ``split`` is read as a stream: iterable, but neither a dict of arrays
    nor a random-access source (``len()`` and ``[i]``)."""
    random_access = hasattr(split, "__len__") and hasattr(split, "__getitem__")
    return not isinstance(split, (dict, str, bytes)) and not random_access and hasattr(split, "__iter__")


def stack_examples(examples: list, where: str) -> Batch:
    """Examples (each a dict of arrays with the same keys and shapes) stacked into a batch."""
    if not all(isinstance(e, dict) for e in examples):
        bad = next(e for e in examples if not isinstance(e, dict))
        raise DataError(f"{where}: each example must be a dict of arrays, got {type(bad).__name__}")
    try:  # each array stacked, the inputs' several included (a dict or tuple of arrays)
        return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *examples)
    except (ValueError, KeyError, TypeError) as e:
        shapes = sorted({str(jax.tree_util.tree_map(np.shape, x)) for x in examples})[:3]
        raise DataError(f"{where}: examples differ in keys or shapes ({one_line(e)}); every example "
                        f"needs the same keys and shapes, e.g. {'; '.join(shapes)}") from None


class _Ended(Exception):
    """A one-shot iterator ran out."""


class _Cursor:
    """An iterator over a stream and how many examples it has given; a re-iterable
    stream starts a new pass where an iterator ends."""

    def __init__(self, split: Any, where: str):
        self.split, self.where = split, where
        self.iterator = iter(split)
        self.reiterable = self.iterator is not split
        self.checkpointable = hasattr(self.iterator, "get_state") and hasattr(self.iterator, "set_state")
        self.position = 0

    def next(self) -> Any:
        try:
            example = next(self.iterator)
        except StopIteration:
            if not self.reiterable:
                raise _Ended from None
            self.close()
            self.iterator = iter(self.split)  # a new pass
            example = next(self.iterator, _Ended)
            if example is _Ended:
                raise DataError(f"{self.where}: the stream gives no examples") from None
        except Exception as e:  # noqa: BLE001 - the user's iterator raised
            raise DataError(f"{self.where}: reading example {self.position:,} of the stream failed: "
                            f"{one_line(e)}") from None
        self.position += 1
        return example

    def close(self) -> None:
        if self.reiterable and callable(getattr(self.iterator, "close", None)):
            self.iterator.close()


class TrainStream:
    """The train split as a stream, read by position: :meth:`batch` ``i`` is the
    examples ``i * n .. (i + 1) * n - 1`` (``n`` the batch size, or this process's
    rows of it where the stream is the process's own share, ``sharded``)."""

    arrays = None
    size = None

    def __init__(self, split: Any, where: str, sharded: bool = False):
        self.where, self.sharded, self._split = where, sharded, split
        self._main = _Cursor(split, where)
        self._recent: list = []  # examples [position - len(_recent), position): reads just behind are served again
        self._largest = 1
        self._unit: int | None = None  # examples per batch of the newest read
        self._states: collections.OrderedDict[int, Any] = collections.OrderedDict()
        try:
            first = self._read(0, 1, 0, 1)[0]
        except DataError:
            raise DataError(f"{where}: no examples") from None
        if not isinstance(first, dict) or "inputs" not in first:
            keys = sorted(first) if isinstance(first, dict) else type(first).__name__
            raise DataError(f"{where}: each example must be a dict of arrays with an 'inputs' entry (the model's "
                            f"input); got {keys}")
        self.example = first

    def describe(self) -> str:
        return "streamed"

    def batch(self, index: int, batch_size: int, rows: slice = slice(None)) -> Batch:
        """Batch ``index``: the next examples of the stream (``rows`` of it)."""
        count = len(range(*rows.indices(batch_size)))
        unit = count if self.sharded else batch_size
        examples = self._read(index * unit, unit, index, unit)
        return stack_examples(examples if self.sharded else examples[rows], self.where)

    def batch_stack(self, first: int, count: int, batch_size: int, rows: slice = slice(None)) -> Batch:
        """Batches ``first .. first + count - 1`` stacked (leading axis ``count``)."""
        batches = [self.batch(index, batch_size, rows) for index in range(first, first + count)]
        return {k: np.stack([b[k] for b in batches]) for k in batches[0]}

    def head(self, count: int) -> Batch:
        """The first ``count`` examples."""
        return stack_examples(self._read(0, count, 0, count), self.where)

    def checkpoint_state(self, step: int) -> dict | None:
        """The data position of a checkpoint at ``step``: the examples read before its
        batch and, where the iterator is grain-checkpointable, its state there."""
        if self._unit is None:
            return None
        position = step * self._unit
        saved: dict[str, Any] = {"examples": position}
        state = self._states.get(position)
        if state is not None and not (self.sharded and jax.process_count() > 1):  # process 0's state is saved
            encoded = _encode_state(state)
            if encoded is not None:
                saved["iterator_state"] = encoded
        return saved

    def resume(self, step: int, saved: dict | None) -> str | None:
        """Continues the stream at the checkpoint at ``step``: sets the saved iterator state,
        or (none saved, or not grain-checkpointable) replays: the next read skips to the position."""
        if step == 0:
            return None
        saved = saved or {}
        position, state = saved.get("examples"), saved.get("iterator_state")
        if state is not None and position is not None and self._main.checkpointable:
            self._main.iterator.set_state(_decode_state(state))
            self._main.position, self._recent = position, []
            return f"data: the stream continues from its saved iterator state at example {position:,} (batch {step})"
        how = "its iterator has no get_state/set_state" if not self._main.checkpointable else "no state was saved"
        what = f"{position:,} examples" if position is not None else f"{step} batches"
        return f"data: replaying the stream to resume ({how}): reading and dropping the first {what}"

    # ------------------------------------------------------------------ reading by position

    def _read(self, start: int, count: int, index: int, unit: int) -> list:
        """Examples ``start .. start + count - 1``; ``index`` and ``unit`` (examples per batch)
        for the messages and the iterator states recorded at batch boundaries."""
        self._unit, self._largest = unit, max(self._largest, count)
        main = self._main
        behind = main.position - len(self._recent)
        if start < behind:
            return self._reread(start, count, index)
        if start < main.position:
            examples = self._recent[start - behind:start - behind + count]
        else:
            self._advance(start - main.position, index, unit, keep=False)
            examples = []
        examples += self._advance(count - len(examples), index, unit, keep=True)
        return examples

    def _advance(self, count: int, index: int, unit: int, keep: bool) -> list:
        """The next ``count`` examples of the main iterator (kept in ``_recent`` if ``keep``)."""
        main, taken = self._main, []
        if not keep:
            self._recent = []
        try:
            for _ in range(count):
                if main.checkpointable and main.position % unit == 0:
                    self._record(main.position)
                example = main.next()
                if keep:
                    taken.append(example)
        except _Ended:
            raise DataError(
                f"{self.where}: the stream ended after {main.position:,} examples, at batch {index} (examples "
                f"{index * unit:,}..{(index + 1) * unit - 1:,}); a one-shot iterator (a generator) is read once: "
                f"make it endless, return a re-iterable (a grain IterDataset, an object whose __iter__ starts a "
                f"new pass), or lower steps") from None
        if main.checkpointable and main.position % unit == 0:
            self._record(main.position)
        self._recent = (self._recent + taken)[-2 * self._largest:]
        return taken

    def _record(self, position: int) -> None:
        if position not in self._states:
            self._states[position] = self._main.iterator.get_state()
            while len(self._states) > _STATES_KEPT:
                self._states.popitem(last=False)

    def _reread(self, start: int, count: int, index: int) -> list:
        """Examples the main iterator has passed: from a fresh iterator (set to the recorded
        state there, or read up to it); a one-shot iterator cannot go back."""
        if not self._main.reiterable:
            raise DataError(f"{self.where}: batch {index} (from example {start:,}) was read already and a one-shot "
                            f"iterator cannot go back (it is at example {self._main.position:,}); return a "
                            f"re-iterable (a list, a grain IterDataset, an object whose __iter__ starts a new pass)")
        side = _Cursor(self._split, self.where)
        state = self._states.get(start)
        if state is not None and side.checkpointable:
            side.iterator.set_state(state)
        else:
            for _ in range(start):
                side.next()
        examples = [side.next() for _ in range(count)]
        side.close()
        return examples


class EvalStream:
    """The eval split as a finite iterable: a re-iterable one is read again at every
    evaluation, a one-shot one read once (up to ``max_batches`` batches) and kept."""

    arrays = None
    size = None

    def __init__(self, split: Any, where: str):
        self.where, self._split = where, split
        iterator = iter(split)
        self.reiterable = iterator is not split
        first = next(iterator, None)
        if first is None:
            raise DataError(f"{where}: no examples")
        if not isinstance(first, dict) or "inputs" not in first:
            keys = sorted(first) if isinstance(first, dict) else type(first).__name__
            raise DataError(f"{where}: each example must be a dict of arrays with an 'inputs' entry; got {keys}")
        self.example = first
        if self.reiterable and callable(getattr(iterator, "close", None)):
            iterator.close()
        self._iterator = None if self.reiterable else itertools.chain([first], iterator)
        self._kept: list | None = None

    def describe(self) -> str:
        return "streamed" if self._kept is None else f"{len(self._kept)}"

    def batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[Batch]:
        """The examples in order, the last batch padded with zeros (``mask`` marks real examples)."""
        limit = None if max_batches is None else max_batches * batch_size
        iterator = iter(self._split) if self.reiterable else None
        if iterator is None and self._kept is None:
            self._kept = list(itertools.islice(self._iterator, limit))
        examples = itertools.islice(iterator, limit) if iterator is not None else iter(self._kept[:limit])
        try:
            while chunk := list(itertools.islice(examples, batch_size)):
                batch, pad = stack_examples(chunk, self.where), batch_size - len(chunk)
                if pad:
                    batch = jax.tree_util.tree_map(lambda v: zero_padded(v, batch_size), batch)
                yield {**batch, "mask": np.arange(batch_size) < len(chunk)}
        finally:
            if callable(getattr(iterator, "close", None)):
                iterator.close()  # a grain iterator's reading threads


def _encode_state(state: Any) -> Any:
    """An iterator state as JSON (grain's DataLoader gives bytes); None if it cannot be."""
    if isinstance(state, bytes):
        return {"base64": base64.b64encode(state).decode("ascii")}
    try:
        json.dumps(state)
    except (TypeError, ValueError):
        return None
    return state


def _decode_state(state: Any) -> Any:
    if isinstance(state, dict) and set(state) == {"base64"}:
        return base64.b64decode(state["base64"])
    return state
