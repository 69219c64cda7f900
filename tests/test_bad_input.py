"""Bad input fails early and clearly: property tests of the policy grammar and of
configs, and model/data mismatches caught before any compute."""

import os
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precision import Policy, PolicyError, get_policy
from train.config import ConfigError, ExperimentConfig, apply_overrides, from_dict, load_config

ROOT = Path(__file__).resolve().parent.parent

TOKENS = ["p", "c", "o", "params", "compute", "output", "param", "=", ",", " ", "f32", "f16", "bf16", "f64",
          "float16", "bfloat16", "half", "full", "fp16", "fp32", "int8", "O1", "O2", "o3", "mixed_f16", "pure_bf16",
          "==", ",,", "", "x"]


@settings(max_examples=500)
@given(st.lists(st.sampled_from(TOKENS), max_size=9))
def test_any_token_soup_parses_or_raises_policy_error(tokens):
    """Near-misses of the grammar (its own words in any order) as well as valid specs."""
    spec = "".join(tokens)
    try:
        policy = get_policy(spec)
    except PolicyError as e:
        assert str(e)  # says what was wrong
        return
    assert get_policy(str(policy)) == policy


@settings(max_examples=300)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_any_unicode_string_parses_or_raises_policy_error(text):
    try:
        policy = get_policy(text)
    except PolicyError:
        return
    assert get_policy(str(policy)) == policy


@given(st.sampled_from(["f32", "bf16", "f16", "f64"]), st.sampled_from(["f32", "bf16", "f16", "f64"]),
       st.sampled_from(["f32", "bf16", "f16", "f64"]))
def test_every_policy_round_trips_through_its_string(p, c, o):
    policy = Policy(p, c, o)
    assert get_policy(str(policy)) == policy


# ----------------------------------------------------------------------------- configs

SECTION_KEYS = {
    "": ["seed", "workdir", "steps", "accum_steps", "log_every", "eval_every", "checkpoint_every",
         "keep_checkpoints", "max_nonfinite_steps", "inference_dtypes", "progress", "task", "stepz"],
    "model": ["name", "hidden", "num_classes", "width", "stage_sizes", "num_layers", "dropout", "layers", "dtype",
              "options", "features"],
    "data": ["name", "options", "batch_size", "eval_batch_size", "eval_batches", "seq_len", "val_fraction",
             "num_train", "input_shape", "num_classes", "prefetch", "path", "batchsize"],
    "optimizer": ["name", "lr", "schedule", "warmup_steps", "min_lr", "weight_decay", "b1", "momentum",
                  "max_grad_norm", "nesterov"],
    "precision": ["policy", "rules", "loss_scale", "initial_scale", "growth_interval", "growth_factor",
                  "backoff_factor", "min_scale", "max_scale", "hysteresis", "skip_with"],
    "mesh": ["data", "fsdp", "fsdp_min_size"],
    "distributed": ["coordinator_address", "num_processes", "process_id", "cluster_detect", "timeout_seconds"],
}
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0, 1, 2, 7, 1e-3, -1.5, 1e30, float("nan")]),
    st.sampled_from(["", "mlp", "gpt", "resnet", "digits", "synthetic", "adam", "sgd", "cosine", "f16", "mixed_f16",
                     "dynamic", "static", "none", "bogus", "1e-3", "localhost:1", "a:b", "pkg.mod:Net", "net.py:Net",
                     "data:load", "lm", "language_model", "classification", "a:b:c", "mod:", "bfloat16", "int8"]),
    st.lists(st.integers(-2, 64), max_size=3), st.lists(st.sampled_from(["LayerNorm", "f32", "x"]), max_size=2),
    st.dictionaries(st.sampled_from(["a", "name"]), st.integers(0, 2), max_size=2))


KEYS = set(ExperimentConfig.model_fields) | {"stepz"}


@st.composite
def raw_configs(draw):
    raw = {}
    for _ in range(draw(st.integers(1, 5))):
        section = draw(st.sampled_from(list(SECTION_KEYS)))
        key = draw(st.sampled_from(SECTION_KEYS[section]))
        if section:
            node = raw.setdefault(section, {})
            if not isinstance(node, dict):
                continue
        else:
            node = raw
        node[key] = draw(VALUES)
    if draw(st.booleans()):
        raw[draw(st.sampled_from(["model", "data", "precision"]))] = draw(VALUES)  # a section that is not a mapping
    return raw


@settings(max_examples=500, deadline=None)
@given(raw_configs())
def test_any_config_is_valid_or_a_config_error_naming_a_key(raw):
    try:
        config = from_dict(raw)
    except ConfigError as e:
        message = str(e)
        assert message and "Traceback" not in message and "\n" not in message
        head = message.removeprefix("unknown key '").split(" ")[0].split(":")[0].split("'")[0]
        assert head.split(".")[0].split("[")[0] in KEYS, message  # names the key
        return
    assert config.steps >= 1 and config.data.batch_size >= 1
    assert config.model.name in ("mlp", "gpt", "resnet") or ":" in config.model.name
    assert config.task in ("auto", "lm", "classification") or ":" in config.task


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([f"{s}.{k}" if s else k for s, keys in SECTION_KEYS.items() for k in keys]
                                          + ["model", "mesh", "nokey", "data.", ".x", ""]),
                          st.sampled_from(["", "1", "-1", "0", "x", "[1, 2]", "{a: 1}", "null", "true", "1e-3",
                                           "[", "'", ": :", "mixed_f16", "p=f32,c=f16"])), max_size=4))
def test_any_overrides_are_valid_or_a_config_error(pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        from_dict(apply_overrides({}, overrides))
    except ConfigError as e:
        assert str(e)


@pytest.mark.parametrize("overrides,message", [
    (["data.batch_size=0"], "data.batch_size must be >= 1, got 0"),
    (["steps=-5"], "steps must be >= 1, got -5"),
    (["data.eval_batch_size=-1"], "data.eval_batch_size must be >= 1"),
    (["model.hidden=[64, -3]"], "model 'mlp' cannot take digits inputs of shape (8, 8)"),
    (["model.num_classes=5"], "model 'mlp' outputs logits of shape (5,) for digits"),
    (["model.name=resnet", "model.num_classes=3"], "needs (10,) (10 classes"),
    (["model.name=gpt"], "model 'gpt' cannot take digits inputs of shape (8, 8)"),
    (["model.name=gpt", "data.name=synthetic_text", "data.num_classes=64", "model.block_size=16", "data.seq_len=32"],
     "model 'gpt' cannot take synthetic_text inputs of shape (32,)"),
    (["model.name=gpt", "data.name=synthetic_text", "data.num_classes=64", "model.vocab_size=8"],
     "needs (128, 64) (64 classes per token)"),
    (["data.name=fashion_mnist", "data.path=/nonexistent/dir"], "/nonexistent/dir"),
    (["data.name=shakespeare", "data.path=/nonexistent/plays.txt"], "/nonexistent/plays.txt"),
])
def test_bad_sizes_data_and_model_data_mismatches_fail_before_any_compute(tmp_path, capsys, overrides, message):
    from train.cli import main

    workdir = tmp_path / "run"
    base = tmp_path / "base.yaml"
    base.write_text("progress: false\n")
    code = main([str(base), f"workdir={workdir}", *overrides])  # the CLI, in process (test_train_config: as a program)
    stderr = capsys.readouterr().err
    text = " ".join(stderr.split())
    assert code == 2, stderr[-2000:]
    assert message in text and "Traceback" not in text
    assert not workdir.exists()  # nothing was computed or written


def test_unreadable_and_malformed_data_files_name_the_file(tmp_path):
    from train.data import DataError, load_dataset

    broken = tmp_path / "fmnist"
    broken.mkdir()
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"):
        (broken / name).write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        load_dataset("fashion_mnist", path=str(broken))
    binary = tmp_path / "text.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path in (binary, empty, tmp_path):
        with pytest.raises(DataError, match=str(path)):
            load_dataset("shakespeare", path=str(path), seq_len=32)


def test_a_config_file_that_is_not_a_config(tmp_path):
    for text, message in [("- a\n- b\n", "top level must be a mapping"), ("steps: [\n", "not valid YAML"),
                          ("model: 3\n", "model must be a mapping")]:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(path)


# ----------------------------------------------------------------------------- everything before compute: --check


def _sys_dir_unwritable():
    try:
        with open("/sys/.mp-write-probe", "w"):
            pass
    except OSError:
        return True
    os.remove("/sys/.mp-write-probe")
    return False


USER_FILES = {
    "models.py": """
import flax.linen as nn, jax.numpy as jnp
class NoParams(nn.Module):
    num_classes: int = 10
    @nn.compact
    def __call__(self, x):
        return jnp.zeros((x.shape[0], self.num_classes)) + x.reshape(x.shape[0], -1)[:, :1]
class IntParam(nn.Module):
    num_classes: int = 10
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        w = self.param("w", lambda k, s: jnp.ones(s, jnp.int32), (x.shape[1], self.num_classes))
        return x @ w.astype(jnp.float32)
""",
    "exits.py": "import sys\nsys.exit(0)\n",
    "data.py": """
import numpy as np
X = np.ones((20, 4), np.float32)
def ragged():
    return {"train": {"inputs": [[1.0, 2.0], [1.0]], "labels": [0, 1]}, "eval": {"inputs": [[1.0, 2.0]], "labels": [0]}}
def eval_shape():
    return {"train": {"inputs": X, "labels": np.zeros(20, int)},
            "eval": {"inputs": np.ones((8, 5), np.float32), "labels": np.zeros(8, int)}}
def labels(value, num_classes=None):
    y = np.zeros(20, int)
    y[3] = value
    out = {"train": {"inputs": X, "labels": y}, "eval": {"inputs": X, "labels": np.zeros(20, int)}}
    return {**out, "num_classes": num_classes} if num_classes else out
def complex_inputs():
    return {"train": {"inputs": X.astype(np.complex64), "labels": np.arange(20) % 2},
            "eval": {"inputs": X.astype(np.complex64), "labels": np.arange(20) % 2}}
def one_class():
    return {"train": {"inputs": X, "labels": np.full(20, 2)}, "eval": {"inputs": X, "labels": np.arange(20) % 3},
            "num_classes": 10}
def word_classes():
    return {"train": {"inputs": X, "labels": np.arange(20) % 2}, "eval": {"inputs": X, "labels": np.arange(20) % 2},
            "num_classes": "ten"}
def scalar_inputs():
    return {"train": {"inputs": np.arange(40, dtype=np.float32), "labels": np.arange(40) % 10},
            "eval": {"inputs": np.arange(10, dtype=np.float32), "labels": np.arange(10)}}
""",
    "tasks.py": """
import jax.numpy as jnp
def int_loss(outputs, batch):
    return jnp.sum(batch["labels"]), {}
""",
}


@pytest.fixture
def user_files(tmp_path):
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "afile").write_text("x")
    return tmp_path


def _check(args, capsys):
    """``python -m train configs/default.yaml ARGS --check``: (exit status, stderr lines)."""
    from train.cli import main

    code = main([str(ROOT / "configs" / "default.yaml"), "progress=false", *args, "--check"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


CHECKED = [
    (["workdir={d}/afile"], "workdir: {d}/afile is a file, not a directory"),
    (["workdir={d}/afile/run"], "workdir: {d}/afile is a file, not a directory"),
    (["workdir=''"], "workdir must not be empty"),
    # a bad value given on the command line is credited to it, not to the config file
    (["tracker.wandb.project=p", "tracker.wandb.mode=sometimes"],
     "error: the command line (tracker.wandb.mode=sometimes): tracker.wandb.mode: unknown value 'sometimes'"),
    (["workdir={d}/fresh", "model.init_from={d}/nothing"],  # a fresh workdir: one with checkpoints would resume
     "error: the command line (model.init_from={d}/nothing): model.init_from: "),
    (["compile_cache={d}/afile"], "compile_cache: {d}/afile is a file, not a directory"),
    (["data.name=synthetic", "data.input_shape=[-3]"], "data.input_shape[0] must be >= 1, got -3"),
    (["model.hidden=[1000000000000]"], "model 'mlp' has 7.7e+13 parameters: its train state"),
    (["data.name={d}/data.py:ragged"], "'inputs' rows differ in shape"),
    (["data.name={d}/data.py:eval_shape", "data.batch_size=8"], "the eval split's inputs have shape (5,), the train split's (4,)"),
    (["model.name={d}/models.py:NoParams"], "has no parameters (no 'params' collection)"),
    (["model.name={d}/models.py:IntParam"], "has params that are not floating point (w)"),
    (["model.name={d}/exits.py:Net"], "called sys.exit(0)"),
    (["data.name={d}/data.py:labels", "data.options={{value: 900000000}}", "data.batch_size=8"],
     "model 'mlp' has 2.31e+11 parameters"),
    (["data.name={d}/data.py:labels", "data.options={{value: 12, num_classes: 10}}", "data.batch_size=8"],
     "label 12 is outside [0, 10)"),
    (["data.name={d}/data.py:labels", "data.options={{value: -1}}", "data.batch_size=8"], "label -1 is outside"),
    (["model.name=gpt", "data.name=synthetic_text", "data.seq_len=300000"],
     "synthetic_text: the train split has 4096 tokens, too few for windows of data.seq_len=300000"),
    (["optimizer.lr=.inf"], "optimizer.lr must be a finite number, got inf"),
    (["optimizer.b1=1.5"], "optimizer.b1 must be < 1, got 1.5"),
    (["optimizer.b2=-0.1"], "optimizer.b2 must be >= 0"),
    (["optimizer.eps=0"], "optimizer.eps must be > 0, got 0"),
    (["optimizer.eps=.nan"], "optimizer.eps must be > 0, got nan"),
    (["optimizer.weight_decay=.nan"], "optimizer.weight_decay"),
    (["optimizer.min_lr=-1"], "optimizer.min_lr must be >= 0"),
    (["optimizer.name=sgd", "optimizer.momentum=-1"], "optimizer.momentum must be >= 0"),
    (["model.dropout=1.5"], "model.dropout must be < 1, got 1.5"),
    (["model.dropout=.nan"], "model.dropout must be a finite number"),
    (["precision.initial_scale=1e39"], "precision: initial_scale must be finite and >= 0 in float32 (at most 3.403e+38), got 1e+39"),
    (["precision.policy=mixed_bf16", "precision.growth_factor=0.5"], "precision: growth_factor must be a number > 1"),
    (["precision.backoff_factor=2"], "precision: backoff_factor must be a number in (0, 1], got 2.0"),
    (["precision.policy=p=f32,  c=f17"], "Invalid precision policy 'p=f32,  c=f17': unknown dtype 'f17' at position 10"),
    # issue 39 (7, 8): nonsense that trained with exit 0, and a traceback
    (["data.name={d}/data.py:complex_inputs", "data.batch_size=8"], "inputs are complex (complex64); models train "
                                                                     "on real numbers"),
    (["data.name={d}/data.py:one_class", "data.batch_size=8"], "train split: every label is 2: with one class"),
    (["data.name={d}/data.py:word_classes", "data.batch_size=8"],
     "num_classes must be a whole number (how many classes), got 'ten'"),
    (["task={d}/tasks.py:int_loss"], "returns a loss of dtype int32: nothing can train on it"),
    # issue 39 (5): a loss scale of 0 skipped every step and exited 0; min_lr above lr decayed upwards
    (["precision.loss_scale=static", "precision.initial_scale=0"],
     "the command line (precision.initial_scale=0): precision.initial_scale must be > 0, got 0"),
    (["precision.loss_scale=dynamic", "precision.initial_scale=0"], "precision.initial_scale must be > 0, got 0"),
    (["precision.min_scale=0"], "precision.min_scale must be > 0, got 0"),
    (["optimizer.min_lr=1", "optimizer.lr=0.1"], "optimizer.min_lr (1) must not exceed optimizer.lr (0.1)"),
    # issue 39 (12): a typo on the command line was blamed on the config file
    (["optimizer.lrr=1"], "error: the command line (optimizer.lrr=1): unknown key 'optimizer.lrr'. Did you mean"),
    (["optimizr.lr=1"], "error: the command line (optimizr.lr=1): unknown key 'optimizr'."),
]


@pytest.mark.parametrize("args, message", CHECKED, ids=[" ".join(a) for a, _ in CHECKED])
def test_bad_input_is_one_line_exit_2_before_any_compute(args, message, user_files, capsys):
    code, err = _check([a.format(d=user_files) for a in args], capsys)
    assert code == 2 and len(err) == 1, err
    assert message.format(d=user_files) in err[0] and "Traceback" not in err[0]


@pytest.mark.skipif(not _sys_dir_unwritable(), reason="needs a directory this user cannot write (/sys)")
@pytest.mark.parametrize("workdir", ["/sys/mp-test/run", "/sys/kernel"])
def test_a_workdir_that_cannot_be_written_is_one_line(workdir, capsys):
    code, err = _check([f"workdir={workdir}"], capsys)
    assert code == 2 and len(err) == 1
    # the error names where the key was set: here the command line, not the config file
    assert re.fullmatch(rf"error: the command line \(workdir={workdir}\): workdir: {workdir} is not writable "
                        rf"\((Permission denied|Operation not permitted)\); give a directory you can write to", err[0])


def test_check_refuses_what_the_run_refuses_when_it_builds_the_state(tmp_path, capsys):
    """Issue 39 (4): --check passed a config the run stops on (the strict coverage check of a
    model whose layers pin float32 with autocast off)."""
    from train.cli import main

    code = main([str(ROOT / "examples" / "user_models" / "linen_lm.yaml"), "precision.autocast=false",
                 "precision.strict=true", f"workdir={tmp_path}", "--check"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "precision.strict: policy p=f32,c=bf16,o=f32 leaves 100%" in err[0]
    assert not any(tmp_path.iterdir())


def test_a_config_error_names_the_file_when_the_key_came_from_it(tmp_path, capsys):
    config = tmp_path / "typo.yaml"
    config.write_text("optimizer:\n  lrr: 0.1\n")
    from train.cli import main

    assert main([str(config), "optimizer.lr=0.1", "--check"]) == 2
    assert f"error: {config}: unknown key 'optimizer.lrr'" in capsys.readouterr().err


def test_scalar_inputs_get_a_note_in_the_run_header(user_files, capsys):
    from train.cli import main

    code = main([str(ROOT / "configs" / "default.yaml"), f"data.name={user_files}/data.py:scalar_inputs",
                 "data.batch_size=8", "steps=1", f"workdir={user_files}/run", "progress=false", "inference_dtypes=[]",
                 "data.eval_batch_size=8"])
    out = capsys.readouterr().out
    assert code == 0 and "note: scalar_inputs's inputs are one number per example (shape ())" in out


def test_no_arguments_ask_for_the_config_only(capsys):
    from train.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "give the experiment's config file" in err and "key=value" not in \
        err.splitlines()[-1].split("(")[0]


def test_check_writes_nothing_and_says_what_it_checked(tmp_path, capsys):
    from train.cli import main

    code = main([str(ROOT / "configs" / "default.yaml"), f"workdir={tmp_path / 'new' / 'run'}", "--check"])
    assert code == 0 and capsys.readouterr().out.startswith("ok: mlp on digits")
    assert not (tmp_path / "new").exists()


def test_steps_per_call_far_beyond_steps_is_capped_at_the_steps_to_run(tmp_path):
    from train import load_config, run

    config = load_config(ROOT / "configs" / "default.yaml", ["steps=3", "steps_per_call=1000000", "progress=false",
                                                              "inference_dtypes=[]", f"workdir={tmp_path}",
                                                              "compile_cache=null"])
    assert run(config, out=open(os.devnull, "w"))["steps"] == 3


# A coordinator nobody reaches (either process): tests/test_distributed_aborts.py.


# ----------------------------------------------------------------------------- generated bad configs

BAD_VALUES = {
    "optimizer.lr": ["0", "-1", ".inf", ".nan", "'x'"], "optimizer.b1": ["1", "1.5", "-0.5", ".nan"],
    "optimizer.b2": ["1.0", "2", ".inf"], "optimizer.eps": ["0", "-1e-8", ".nan"],
    "optimizer.weight_decay": ["-1", ".inf", ".nan"], "optimizer.min_lr": ["-0.1", ".nan"],
    "optimizer.momentum": ["-0.5", "1", ".nan"], "optimizer.max_grad_norm": ["0", "-1", ".inf"],
    "model.dropout": ["1", "-0.1", ".nan", "2"], "model.hidden": ["[-1]", "[1000000000000]", "[0]"],
    "precision.initial_scale": ["1e39", "-1", ".inf"], "precision.growth_factor": ["0.5", ".nan"],
    "precision.backoff_factor": ["0", "2", ".nan"], "precision.min_scale": ["-1", "1e39"],
    "precision.max_scale": ["0", "1e40"], "precision.growth_interval": ["0", "-3"], "precision.hysteresis": ["0"],
    "precision.policy": ["p=f32,,c=f16", "f17", "p=f32, c=f32 ,c=f16"], "workdir": ["''", "{d}/afile"],
    "compile_cache": ["{d}/afile"], "data.batch_size": ["0", "-8"], "data.input_shape": ["[-1]", "[0, 4]"],
    "steps": ["0"], "seed": ["-1"], "accum_steps": ["0"], "data.val_fraction": ["1", "0", ".nan"],
}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(sorted(BAD_VALUES)), min_size=1, max_size=3, unique=True), st.data())
def test_a_generated_bad_config_is_exit_2_and_one_line(keys, data):
    """Any mix of known-bad values, through the command line: exit 2, one line on stderr, no traceback."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "afile").write_text("x")
        args = [f"{k}={data.draw(st.sampled_from(BAD_VALUES[k]))}".format(d=d) for k in keys]
        if "data.input_shape" in keys:
            args.append("data.name=synthetic")
        from train.cli import main
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main([str(ROOT / "configs" / "default.yaml"), f"workdir={d}/run", *args, "--check"])
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in lines[0], (args, lines)
