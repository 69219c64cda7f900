"""A user's data as a stream (a generator, a grain IterDataset): trained from YAML
in the stream's order, resumed at the same example (grain's iterator state, or a
replay) bit-exactly, per-process rows, eval streams, and clear errors; a grain
MapDataset read by random access."""

import io
import textwrap

import grain
import numpy as np
import pytest

import train
from helpers import assert_bitwise_equal, saved_leaves
from train import DataError, UserData, load_config
from train.references import resolve

STEPS, BATCH = 12, 8

DATA_FILE = '''
import grain
import numpy as np

N = 256
X = np.random.default_rng(1).normal(size=(N, 8)).astype(np.float32)
Y = np.argmax(X @ np.random.default_rng(0).normal(size=(8, 3)), 1).astype(np.int32)
EVAL = {"inputs": X[:64], "labels": Y[:64]}
READS = []  # indices the grain source was asked for


def make():
    """A one-shot generator: replayed on resume."""
    return {"train": ({"inputs": X[i], "labels": Y[i]} for i in range(N)), "eval": EVAL, "num_classes": 3}


class Counting:
    def __len__(self):
        return N

    def __getitem__(self, i):
        READS.append(int(i))
        return {"inputs": X[i], "labels": Y[i]}


def make_grain():
    """The same examples in the same order as a grain IterDataset: resumed from its state."""
    ds = grain.MapDataset.source(Counting()).to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return {"train": ds, "eval": EVAL, "num_classes": 3}
'''

CONFIG = '''
steps: {steps}
log_every: 1
eval_every: 0
checkpoint_every: 0
progress: false
compile_cache: null
inference_dtypes: []
model: {{name: mlp, hidden: [16]}}
data: {{name: "{data}", batch_size: {batch}, eval_batch_size: 32}}
optimizer: {{name: adam, lr: 0.01}}
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    (root / "streams.py").write_text(DATA_FILE)
    for name in ("make", "make_grain"):
        (root / f"{name}.yaml").write_text(CONFIG.format(steps=STEPS, batch=BATCH, data=f"{root}/streams.py:{name}"))
    return root


@pytest.fixture(scope="module")
def straight(files):
    """An uninterrupted run on the generator, from YAML."""
    workdir = files / "straight"
    out = io.StringIO()
    train.run(load_config(files / "make.yaml", [f"workdir={workdir}"]), out=out)
    return workdir, out.getvalue()


def _interrupted_and_resumed(files, name, workdir, before_resume=lambda: None):
    """Runs config ``name`` until a Ctrl-C after step 5, then again to the end: (start, output)."""
    config = load_config(files / f"{name}.yaml", [f"workdir={workdir}"])

    def interrupt(record):
        if record["kind"] == "train" and record["step"] == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt, match="saved a checkpoint at step") as info:
        train.run(config, out=io.StringIO(), on_record=interrupt)
    start = int(str(info.value).split("saved a checkpoint at step ")[1].split()[0])
    assert 0 < start < STEPS
    before_resume()
    out = io.StringIO()
    train.run(config, out=out)
    return start, out.getvalue()


def test_a_generator_from_yaml_trains_in_its_order(straight):
    workdir, out = straight
    losses = [r["loss"] for r in train.read_metrics(str(workdir)) if r["kind"] == "train"]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert "on make: streamed train / 64 eval examples of shape (8,), 3 classes" in out


def test_a_generator_resumes_by_replay_bit_exactly(files, straight):
    start, out = _interrupted_and_resumed(files, "make", files / "replayed")
    assert f"replaying the stream to resume (its iterator has no get_state/set_state): reading and dropping the " \
           f"first {start * BATCH} examples" in out
    assert_bitwise_equal(saved_leaves(straight[0])[1], saved_leaves(files / "replayed")[1])


def test_a_grain_iter_dataset_resumes_from_its_state_without_replay(files, straight):
    reads = resolve(f"{files}/streams.py:READS", "test")
    reads.clear()
    start, out = _interrupted_and_resumed(files, "make_grain", files / "grain", before_resume=reads.clear)
    assert f"the stream continues from its saved iterator state at example {start * BATCH}" in out
    skipped = [i for i in reads if BATCH <= i < start * BATCH]
    assert not skipped and max(reads) == STEPS * BATCH - 1  # no replay: only the head (model checks) and the rest
    assert_bitwise_equal(saved_leaves(straight[0])[1], saved_leaves(files / "grain")[1])


def _examples(n):
    return [{"inputs": np.full(2, i, np.float32), "labels": np.int32(i % 2)} for i in range(n)]


EVAL = {"inputs": np.zeros((4, 2), np.float32), "labels": np.array([0, 1, 0, 1], np.int32)}


def test_a_one_shot_iterator_that_runs_out_says_so_in_one_line():
    data = UserData("short", iter(_examples(10)), EVAL, num_classes=2)
    data.train_batch(0, 4, 0)
    data.train_batch(1, 4, 0)
    with pytest.raises(DataError) as info:
        data.train_batch(2, 4, 0)
    message = str(info.value)
    assert "\n" not in message
    assert "the stream ended after 10 examples, at batch 2" in message and "lower steps" in message


def test_a_re_iterable_starts_a_new_pass_and_batches_are_the_stream_in_order():
    data = UserData("list", _Passes(10), EVAL, 2)
    firsts = [data.train_batch(i, 4, seed=0)["inputs"][:, 0].tolist() for i in range(3)]
    assert firsts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    stacked = data.train_batch_stack(3, 2, 4, seed=0)["inputs"][..., 0]
    np.testing.assert_array_equal(stacked, [[2, 3, 4, 5], [6, 7, 8, 9]])
    np.testing.assert_array_equal(data.train_batch(1, 4, seed=0)["inputs"][:, 0], [4, 5, 6, 7])  # read again
    assert data.describe() == "list: streamed train / 4 eval examples of shape (2,), 2 classes"


class _Passes:
    """A re-iterable: every iter() is a new pass."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(_examples(self.n))


def test_each_process_keeps_its_rows_of_a_global_stream():
    whole = UserData("g", iter(_examples(64)), EVAL, num_classes=2)
    halves = [UserData("g", iter(_examples(64)), EVAL, num_classes=2) for _ in range(2)]
    for index in range(3):
        full = whole.train_batch(index, 8, 0)["inputs"][:, 0]
        parts = [h.train_batch(index, 8, 0, rows=slice(4 * p, 4 * p + 4))["inputs"][:, 0] for p, h in enumerate(halves)]
        np.testing.assert_array_equal(np.concatenate(parts), full)
        np.testing.assert_array_equal(full, np.arange(8 * index, 8 * index + 8))
    arrays = {"inputs": np.arange(80.0).reshape(40, 2), "labels": np.arange(40) % 2}  # a process's own share of arrays
    share = UserData("a", arrays, EVAL, num_classes=2, sharded=True).train_batch(3, 8, 0, rows=slice(4, 8))
    alone = UserData("a", arrays, EVAL, num_classes=2).train_batch(3, 4, 0)  # its 4 rows: a batch of 4 of its own
    np.testing.assert_array_equal(share["inputs"], alone["inputs"])


def test_a_function_taking_process_arguments_gets_them_and_streams_its_own_share(tmp_path, monkeypatch):
    (tmp_path / "shards.py").write_text(textwrap.dedent('''
        import numpy as np
        def make(process_index, process_count, offset=0):
            rows = range(offset + process_index, 10_000, process_count)
            return {"train": ({"inputs": np.full(2, i, np.float32), "labels": np.int32(i % 2)} for i in rows),
                    "eval": {"inputs": np.zeros((4, 2), np.float32), "labels": np.array([0, 1, 0, 1])},
                    "num_classes": 2}
    '''))
    monkeypatch.setattr(train.data.user.jax, "process_index", lambda: 1)
    monkeypatch.setattr(train.data.user.jax, "process_count", lambda: 2)
    spec = type("DataConfig", (), {"name": f"{tmp_path}/shards.py:make", "options": {"offset": 100}})()
    data = train.build_data(spec, seed=0)
    batch = data.train_batch(2, 8, 0, rows=slice(4, 8))["inputs"][:, 0]  # its 4 rows, from its own stream
    np.testing.assert_array_equal(batch, [117, 119, 121, 123])
    spec.options = {"process_index": 0}
    with pytest.raises(DataError, match="data.options.process_index: set by the run"):
        train.build_data(spec, seed=0)


def test_eval_streams_one_shot_kept_and_re_iterable_read_again():
    one_shot = UserData("e", _examples(8), iter(_examples(6)), num_classes=2)
    first = [b["inputs"][:, 0].tolist() for b in one_shot.eval_batches(4, max_batches=1)]
    assert first == [[0, 1, 2, 3]] and [b["inputs"][:, 0].tolist() for b in one_shot.eval_batches(4)] == first
    again = UserData("e", _examples(8), _Passes(6), num_classes=2)
    for _ in range(2):
        batches = list(again.eval_batches(4))
        assert [b["mask"].sum() for b in batches] == [4, 2] and batches[1]["inputs"][:, 0].tolist() == [4, 5, 0, 0]


def test_a_grain_map_dataset_is_read_by_random_access_with_epochs():
    source = grain.MapDataset.source(_examples(20)).map(lambda e: {**e, "inputs": e["inputs"] * 2})
    data = UserData("map", source, EVAL, num_classes=2)
    epoch = np.concatenate([data.train_batch(i, 4, seed=3)["inputs"][:, 0] for i in range(5)])
    assert sorted(epoch / 2) == list(range(20))
    np.testing.assert_array_equal(data.train_batch(2, 4, seed=3)["inputs"],
                                  UserData("map", source, EVAL, num_classes=2).train_batch(2, 4, seed=3)["inputs"])
    assert data.describe() == "map: 20 train / 4 eval examples of shape (2,), 2 classes"


def test_stream_errors_name_the_split():
    with pytest.raises(DataError, match="train split: no examples"):
        UserData("e", iter([]), EVAL, num_classes=2)
    with pytest.raises(DataError, match="an 'inputs' entry"):
        UserData("e", iter([{"x": np.zeros(2)}]), EVAL, num_classes=2)
    with pytest.raises(DataError, match="give num_classes with a classification source or stream"):
        UserData("e", iter(_examples(4)), EVAL)
    broken = UserData("e", (e if i < 5 else {"inputs": np.zeros(3)} for i, e in enumerate(_examples(9))), EVAL, 2)
    with pytest.raises(DataError, match="examples differ in keys or shapes"):
        broken.train_batch(1, 4, 0)
