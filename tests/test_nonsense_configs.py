"""Issue 53 (7): nonsense that trained to the end and exited 0. Each case is run as a user
runs it (``python -m train configs/default.yaml key=value ...``, in-process): refused
before any compute in one line with exit status 2, or stopped in one line with exit 1;
and the same experiment made sane still runs."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from train.cli import main
from train.data import ClassificationData, DataError
from train.data import checks

ROOT = Path(__file__).resolve().parent.parent

DATA = '''
import numpy as np

def _split(x, y):
    return {"train": {"inputs": x, "labels": y}, "eval": {"inputs": x[:16], "labels": y[:16]}}

def _features(n=64):
    return np.random.default_rng(0).standard_normal((n, 8)).astype(np.float32)

def good():
    return _split(_features(), np.arange(64) % 3)

def all_nan():
    return _split(np.full((64, 8), np.nan, np.float32), np.arange(64) % 3)

def some_inf():
    x = _features()
    x[5, 2], x[9, 0] = np.inf, -np.inf
    return _split(x, np.arange(64) % 3)

def nan_in_eval_only():
    d = good()
    d["eval"]["inputs"] = d["eval"]["inputs"].copy()
    d["eval"]["inputs"][3, 3] = np.nan
    return d

def one_class():
    return dict(_split(_features(), np.zeros(64, np.int32)), num_classes=3)

def int8_eval():
    d = good()
    d["eval"]["inputs"] = (d["eval"]["inputs"] * 10).astype(np.int8)
    return d

def named_inputs_nan():  # a model's two named inputs (keyword arguments); NaN in one
    d = good()
    for split in ("train", "eval"):
        x = d[split]["inputs"]
        d[split]["inputs"] = {"sample": x, "timesteps": np.arange(len(x))}
    d["train"]["inputs"]["sample"][7, 1] = np.nan
    return d

def float16_eval():
    d = good()
    d["eval"]["inputs"] = d["eval"]["inputs"].astype(np.float16)
    return d
'''

LOSS = '''
import jax, jax.numpy as jnp, optax

def nan_loss(logits, batch):  # its value NaN, its gradients those of the finite cross-entropy
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"]).mean()
    return loss + jax.lax.stop_gradient(jnp.nan), {}
'''


@pytest.fixture
def user_files(tmp_path):
    (tmp_path / "data.py").write_text(DATA)
    (tmp_path / "loss.py").write_text(LOSS)
    return tmp_path


def _train(args, workdir, capsys, *, check=False):
    """``python -m train configs/default.yaml ARGS`` (tiny): (exit status, stderr lines, stdout)."""
    code = main([str(ROOT / "configs" / "default.yaml"), "steps=2", "log_every=1", "eval_every=0",
                 "checkpoint_every=0", "steps_per_call=1", "progress=false", "inference_dtypes=[]",
                 "data.batch_size=16", "data.eval_batch_size=16", "model.hidden=[16]", f"workdir={workdir}", *args]
                + (["--check"] if check else []))
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out


REFUSED = [
    (["data.name=synthetic", "data.input_shape=[]", "data.num_train=64", "data.num_test=16"],
     "error: the command line (data.input_shape=[]): data.input_shape: [] makes each input one number (no feature "
     "axis); the synthetic data needs at least one axis, e.g. data.input_shape=[32]"),
    (["data.name={d}/data.py:all_nan"],
     "all_nan: the train split's inputs hold 512 non-finite values (512 NaN, 0 inf) among 512: a model trained or "
     "evaluated on them gives a non-finite loss"),
    (["data.name={d}/data.py:some_inf"], "some_inf: the train split's inputs hold 2 non-finite values (0 NaN, 2 inf)"),
    (["data.name={d}/data.py:nan_in_eval_only"],
     "nan_in_eval_only: the eval split's inputs hold 1 non-finite value (1 NaN, 0 inf) among 128"),
    (["data.name={d}/data.py:named_inputs_nan"],
     "named_inputs_nan: the train split's inputs.sample hold 1 non-finite value (1 NaN, 0 inf) among 512"),
    (["data.num_classes=3"],
     "error: the command line (data.num_classes=3): data.num_classes: set to 3, but digits has 10 classes"),
    (["data.name={d}/data.py:good", "data.num_classes=10"],
     "error: the command line (data.num_classes=10): data.num_classes: set to 10, but good has 3 classes"),
    (["data.name=synthetic", "data.num_classes=1", "data.num_train=64", "data.num_test=16"],
     "error: the command line (data.num_classes=1): data.num_classes: 1 class: a classifier needs at least 2"),
    (["data.name=synthetic_text", "data.num_classes=1"],
     "error: the command line (data.num_classes=1): data.num_classes: a vocabulary of 1 token: a language model "
     "needs at least 2"),
    (["data.name={d}/data.py:one_class"], "train split: every label is 0: with one class among the training labels"),
    (["optimizer.lr=1e+308"],
     "error: the command line (optimizer.lr=1e+308): optimizer.lr: 1e+308 is far beyond any learning rate that "
     "trains (in float32, where the schedule computes it, it is inf)"),
    (["optimizer.lr=5000"], "optimizer.lr: 5000 is far beyond any learning rate that trains: its first updates"),
    (["data.name={d}/data.py:int8_eval"],
     "int8_eval: the eval split's inputs are int8 (integer), the train split's float32 (floating-point)"),
]


@pytest.mark.parametrize("check", [False, True], ids=["run", "--check"])
@pytest.mark.parametrize("args, message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_nonsense_is_refused_in_one_line_before_any_compute(args, message, check, user_files, capsys):
    workdir = user_files / "run"
    code, err, _ = _train([a.format(d=user_files) for a in args], workdir, capsys, check=check)
    assert code == 2 and len(err) == 1, err
    assert message.format(d=user_files) in err[0] and "Traceback" not in err[0]
    assert not (workdir / "checkpoints").exists() and not (workdir / "metrics.jsonl").exists()


def test_a_loss_that_is_nan_every_step_of_a_short_run_stops_it_with_exit_1(user_files, capsys, doctor_off):
    """Shorter than max_nonfinite_steps (100), the run used to end with exit 0 and a NaN loss."""
    code, err, _ = _train([f"task={user_files}/loss.py:nan_loss", "steps=3"], user_files / "run", capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("error: training stopped at step 3: the loss itself was non-finite, while its gradients "
                             "were finite, for all 3 steps of this run (since step 1; max_nonfinite_steps=100)")


NAN_MODEL = '''
import flax.linen as nn
import jax.numpy as jnp


class NaNOut(nn.Module):  # its output NaN at every step, in float32 too: no loss scale can help
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x.reshape(x.shape[0], -1)) * jnp.nan
'''


def test_a_model_whose_output_is_nan_every_step_stops_with_exit_1_and_the_doctors_verdict(tmp_path, capsys):
    """Under the default config's mixed_f16: 20 of 20 steps skipped, the loss scale driven from 32768
    to 1, 'final train loss nan', exit 0 (the streak rule counts steps at the minimum scale: 5 of 20)."""
    (tmp_path / "nan_model.py").write_text(NAN_MODEL)
    workdir = tmp_path / "run"
    code = main([str(ROOT / "configs" / "default.yaml"), f"model.name={tmp_path}/nan_model.py:NaNOut", "steps=20",
                 "log_every=5", "eval_every=0", "checkpoint_every=0", "progress=false", "inference_dtypes=[]",
                 f"workdir={workdir}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("error: training stopped at step 20: none of the 20 steps of this run was applied: "
                             "each was skipped for a non-finite loss or gradients (at loss scales from 32768 down "
                             "to 1), so the run trained nothing. At step 1, the first non-finite gradient was in "
                             "params/"), err[0]
    assert "The doctor, on step 1's batch: " in err[0]
    assert "is non-finite in float32 too: the model's math, not precision" in err[0]  # the verdict: not precision
    assert f"checkpointed at step 20 in {workdir}/checkpoints" in err[0]  # nothing lost
    assert (workdir / "checkpoints" / "20").is_dir() and (workdir / "diagnosis.json").exists()
    kinds = [json.loads(line)["kind"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("train") == 4 and "error" in kinds and "diagnosis" in kinds


SANE = [
    ["data.name={d}/data.py:good", "data.num_classes=3"],  # the number the data knows: fine
    ["data.name={d}/data.py:float16_eval"],  # float16 beside float32: one kind
    ["data.num_classes=10"],
    ["data.name=synthetic", "data.input_shape=[1]", "data.num_classes=2", "data.num_train=64", "data.num_test=16"],
    ["optimizer.lr=1000"],
]


@pytest.mark.parametrize("args", SANE, ids=[" ".join(a) for a in SANE])
def test_the_sane_neighbours_pass_the_checks(args, user_files, capsys):
    code, err, out = _train([a.format(d=user_files) for a in args], user_files / "run", capsys, check=True)
    assert code == 0 and not err and out.startswith("ok: "), err


def test_a_sane_user_experiment_still_trains_through_the_cli(user_files, capsys):
    code, err, out = _train([f"data.name={user_files}/data.py:good", "data.num_classes=3"], user_files / "run",
                            capsys)
    assert code == 0 and not err, err
    assert "final train loss" in out and (user_files / "run" / "summary.json").exists()


def test_labels_of_one_class_in_a_shipped_dataset_are_refused(tmp_path, capsys):
    """Fashion-MNIST files whose training labels are all one class (the generic check, not the user data's)."""
    rng = np.random.default_rng(0)
    for stem, values in (("train-images-idx3-ubyte", rng.integers(0, 256, (64, 28, 28), dtype=np.uint8)),
                         ("train-labels-idx1-ubyte", np.full(64, 7, np.uint8)),
                         ("t10k-images-idx3-ubyte", rng.integers(0, 256, (16, 28, 28), dtype=np.uint8)),
                         ("t10k-labels-idx1-ubyte", rng.integers(0, 10, 16, dtype=np.uint8))):
        header = bytes([0, 0, 8, values.ndim]) + b"".join(n.to_bytes(4, "big") for n in values.shape)
        with gzip.open(tmp_path / f"{stem}.gz", "wb") as f:
            f.write(header + values.tobytes())
    code, err, _ = _train(["data.name=fashion_mnist", f"data.path={tmp_path}"], tmp_path / "run", capsys, check=True)
    assert code == 2 and len(err) == 1, err
    assert "fashion_mnist: every training label is 7: with one class among the training labels (of 10)" in err[0]


def test_a_huge_split_is_checked_on_a_sample_and_says_so(monkeypatch):
    x = np.zeros((1000, 10), np.float32)
    x[::10, 0] = np.nan  # one row in ten: a sample of evenly spaced rows finds some
    data = ClassificationData("big", x, np.arange(1000) % 2, x[:0], np.zeros(0, np.int32), 2)
    monkeypatch.setattr(checks, "MAX_SCANNED", 2000)
    with pytest.raises(DataError, match=r"big: the train split's inputs hold \d+ non-finite values \(\d+ NaN, 0 inf\) "
                                        r"among 2,000 of a sample of 200 evenly spaced examples \(the split is too "
                                        r"large to scan in full\)"):
        checks.check_data(data)
    monkeypatch.setattr(checks, "MAX_SCANNED", 10 ** 6)  # in full: every one counted
    with pytest.raises(DataError, match=r"hold 100 non-finite values \(100 NaN, 0 inf\) among 10,000"):
        checks.check_data(data)
