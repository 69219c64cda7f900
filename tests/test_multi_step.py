"""Several train steps per device call (``steps_per_call``): the same training,
step for step and bit for bit, with the host's per-call work paid once per call."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import precision
from helpers import assert_bitwise_equal, saved_leaves
from train import NonFiniteError, UserData, create_train_state, make_multi_step, make_train_step, read_metrics, run
from train.config import from_dict
from train.data import load_dataset, load_synthetic_text, train_batch_stack
from train.experiment.loop import plan_calls
from train.models import MLP


# ----------------------------------------------------------------------------- the plan of calls


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 60), length=st.integers(0, 80), per_call=st.integers(1, 12),
       every=st.lists(st.integers(0, 15), max_size=2))
def test_calls_cover_every_step_once_and_end_where_the_loop_needs_the_state(start, length, per_call, every):
    end = start + length
    calls = list(plan_calls(start, end, per_call, tuple(every)))
    steps = [first + i + 1 for first, count in calls for i in range(count)]
    assert steps == list(range(start + 1, end + 1))  # each step once, in order
    if calls:
        assert calls[0][1] == 1  # the compiling call is timed apart
    assert all(1 <= count <= per_call for _, count in calls)
    ends = {first + count for first, count in calls}
    for interval in every:
        if interval:
            assert {s for s in range(start + 1, end + 1) if s % interval == 0} <= ends
    # No call is cut shorter than it has to be.
    for first, count in calls[1:-1]:
        if count < per_call:
            assert any(interval and (first + count) % interval == 0 for interval in every)


# ----------------------------------------------------------------------------- stacked batches


class _ProtocolOnly:
    """A dataset object with ``train_batch`` only (no ``train_batch_stack``)."""

    def __init__(self, data):
        self.data = data

    def train_batch(self, index, batch_size, seed, rows=slice(None)):
        return self.data.train_batch(index, batch_size, seed, rows)


class _Source:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"inputs": self.x[i], "labels": self.y[i]}


_CLASSES = load_dataset("synthetic", num_train=100, num_test=10, input_shape=[3], num_classes=4)
_DATASETS = {
    "classification": _CLASSES,
    "text": load_synthetic_text(num_train=500, num_test=50, vocab_size=7, seq_len=6),
    "user arrays": UserData("arrays", {"inputs": _CLASSES.x_train, "labels": _CLASSES.y_train},
                            {"inputs": _CLASSES.x_test, "labels": _CLASSES.y_test}),
    "user source": UserData("source", _Source(_CLASSES.x_train, _CLASSES.y_train),
                            _Source(_CLASSES.x_test, _CLASSES.y_test), num_classes=4),
    "protocol only": _ProtocolOnly(_CLASSES),
}


@pytest.mark.parametrize("name", list(_DATASETS))
@pytest.mark.parametrize("rows", [slice(None), slice(8, 16)])
def test_a_stack_of_batches_is_the_batches_stacked_then_zero_padded(name, rows):
    data = _DATASETS[name]
    first, count, length = 4, 5, 7  # crosses an epoch boundary of the 100 examples at batches of 16
    stack = train_batch_stack(data, first, count, length, 16, 3, rows)
    for key, value in stack.items():
        expected = np.stack([data.train_batch(i, 16, 3, rows)[key] for i in range(first, first + count)])
        assert value.shape == (length,) + expected.shape[1:] and value.dtype == expected.dtype
        np.testing.assert_array_equal(value[:count], expected)
        assert not value[count:].any()


# ----------------------------------------------------------------------------- the multi-step program


def _state_and_batches(dropout=0.0):
    data = load_dataset("synthetic", num_train=256, num_test=8, input_shape=[12], num_classes=5)
    model = MLP(hidden=(32,), num_classes=5, dropout=dropout)
    state = create_train_state(model, "mixed_f16", optax.adamw(3e-3), jax.random.key(0), data.sample_input(1),
                               loss_scale=precision.DynamicLossScale(2.0 ** 15, period=2))
    return data, state


def test_a_call_of_several_steps_equals_the_steps_one_by_one_bit_for_bit():
    data, state = _state_and_batches(dropout=0.2)  # dropout: each step's key still comes from its number
    step = make_train_step(donate=False, accum_steps=2)
    singles, single_metrics = state, []
    for i in range(7):
        singles, m = step(singles, jax.device_put(data.train_batch(i, 16, 0)))
        single_metrics.append(m)
    multi = make_multi_step(step, 4, donate=False)
    grouped, stacked = state, []
    for first, count in [(0, 1), (1, 4), (5, 2)]:  # a full call and a short one: one program
        grouped, m = multi(grouped, jax.device_put(train_batch_stack(data, first, count, 4, 16, 0)), count)
        stacked += [jax.tree_util.tree_map(lambda x, i=i: x[i], m) for i in range(count)]
    assert int(grouped.step) == 7
    assert_bitwise_equal(jax.tree_util.tree_leaves((singles.params, singles.opt_state)),
                         jax.tree_util.tree_leaves((grouped.params, grouped.opt_state)))
    for one, other in zip(single_metrics, stacked):
        assert_bitwise_equal(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(other))
    assert multi._cache_size() == 1


def test_an_nnx_model_pinned_to_float32_with_batchnorm_trains_the_same_in_calls():
    from flax import nnx

    from tests.user_models import PinnedNNXMLP

    data = load_dataset("synthetic", num_train=256, num_test=8, input_shape=[12], num_classes=5)
    model = PinnedNNXMLP(12, 32, 5, rngs=nnx.Rngs(0))
    state = create_train_state(model, "mixed_bf16", optax.adam(3e-3), jax.random.key(0), data.sample_input(1))
    step = make_train_step(donate=False)
    singles = state
    for i in range(5):
        singles, _ = step(singles, jax.device_put(data.train_batch(i, 16, 0)))
    multi = make_multi_step(step, 3, donate=False)
    grouped = state
    for first, count in [(0, 3), (3, 2)]:
        grouped, metrics = multi(grouped, jax.device_put(train_batch_stack(data, first, count, 3, 16, 0)), count)
    assert_bitwise_equal(jax.tree_util.tree_leaves((singles.params, singles.model_state, singles.opt_state)),
                         jax.tree_util.tree_leaves((grouped.params, grouped.model_state, grouped.opt_state)))
    assert jax.tree_util.tree_leaves(grouped.model_state)  # BatchNorm statistics were carried through the loop


def test_a_short_call_trains_only_its_steps():
    data, state = _state_and_batches()
    multi = make_multi_step(make_train_step(donate=False), 5, donate=False)
    after, metrics = multi(state, jax.device_put(train_batch_stack(data, 0, 2, 5, 16, 0)), 2)
    assert int(after.step) == 2
    assert np.all(np.asarray(metrics["loss"])[:2] > 0) and not np.asarray(metrics["loss"])[2:].any()


def test_multi_step_rejects_a_bad_count_or_stack():
    with pytest.raises(ValueError, match="steps_per_call must be an integer >= 1, got 0"):
        make_multi_step(make_train_step(), 0)
    data, state = _state_and_batches()
    multi = make_multi_step(make_train_step(donate=False), 3, donate=False)
    with pytest.raises(ValueError, match="batches stack 2 batches, expected steps_per_call=3"):
        multi(state, jax.device_put(train_batch_stack(data, 0, 2, 2, 16, 0)), 2)


# ----------------------------------------------------------------------------- through train.run

TINY = {
    "steps": 13, "log_every": 2, "eval_every": 6, "checkpoint_every": 4, "progress": False,
    "inference_dtypes": [],
    "model": {"name": "mlp", "hidden": [32], "dropout": 0.1},
    "data": {"name": "digits", "batch_size": 16, "eval_batch_size": 100, "eval_batches": 1},
    "optimizer": {"name": "adamw", "lr": 3e-3},
    "precision": {"policy": "mixed_f16", "loss_scale": "dynamic", "growth_interval": 3},
}


def _config(workdir, **changes):
    return from_dict({**json.loads(json.dumps(TINY)), "workdir": str(workdir), **changes})


def _records(workdir):
    drop = ("steps_per_sec", "examples_per_sec")
    return [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(str(workdir))]


def test_a_run_in_calls_of_5_steps_is_the_run_step_by_step(tmp_path):
    one = run(_config(tmp_path / "one"))
    five = run(_config(tmp_path / "five", steps_per_call=5))
    records = _records(tmp_path / "five")
    assert records == _records(tmp_path / "one")  # same losses, scales, evals, at the same steps
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6, 8, 10, 12, 13]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [6, 12, 13]
    assert_bitwise_equal(saved_leaves(tmp_path / "one")[1], saved_leaves(tmp_path / "five")[1])
    assert saved_leaves(tmp_path / "five", 8)[0] == 8  # checkpoints land on their steps
    assert one["eval"] == five["eval"] and five["steps"] == 13


def test_a_run_in_calls_resumes_bit_for_bit_and_may_change_its_call_size(tmp_path):
    run(_config(tmp_path / "straight", steps_per_call=5))

    def interrupt(record):
        if record["kind"] == "train" and record["step"] == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt, match="saved a checkpoint at step"):
        run(_config(tmp_path / "resumed", steps_per_call=5), on_record=interrupt)
    run(_config(tmp_path / "resumed", steps_per_call=3))  # the call size does not change the training
    step_a, a = saved_leaves(tmp_path / "straight")
    step_b, b = saved_leaves(tmp_path / "resumed")
    assert step_a == step_b == 13
    assert_bitwise_equal(a, b)


def test_nonfinite_steps_inside_a_call_still_stop_the_run(tmp_path, doctor_off):
    config = _config(tmp_path / "run", steps=40, steps_per_call=8, checkpoint_every=0, max_nonfinite_steps=3,
                     precision={"policy": "mixed_f16", "loss_scale": "static", "initial_scale": 1e30})
    with pytest.raises(NonFiniteError, match=r"stopped at step \d+: gradients were non-finite for 3 consecutive "
                                             r"steps \(since step 1\)") as info:
        run(config)
    errors = [r for r in read_metrics(str(tmp_path / "run")) if r["kind"] == "error"]
    assert errors and errors[0]["first_nonfinite_step"] == 1 and errors[0]["step"] == 3
    # The step it says it stopped at is the step of the state it saved (the loop reads metrics behind it).
    stopped = int(re.search(r"stopped at step (\d+)", str(info.value)).group(1))
    assert f"checkpointed at step {stopped} " in str(info.value)


def test_steps_per_call_must_be_a_positive_integer(tmp_path):
    from train import ConfigError
    with pytest.raises(ConfigError, match="steps_per_call"):
        _config(tmp_path, steps_per_call=0)


def test_metrics_of_a_call_are_stacked_per_step():
    data, state = _state_and_batches()
    multi = make_multi_step(make_train_step(donate=False), 3, donate=False)
    _, metrics = multi(state, jax.device_put(train_batch_stack(data, 0, 3, 3, 16, 0)), jnp.int32(3))
    assert all(np.shape(v) == (3,) for v in metrics.values())
    assert list(np.asarray(metrics["skipped_steps"])) == [0, 0, 0]
