"""Bad input fails early and clearly: property tests of the policy grammar and of
configs, and model/data mismatches caught before any compute."""

import subprocess
import sys
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
    (["model.name=gpt", "data.name=synthetic_text", "model.block_size=16", "data.seq_len=32"],
     "model 'gpt' cannot take synthetic_text inputs of shape (32,)"),
    (["model.name=gpt", "data.name=synthetic_text", "model.vocab_size=8"], "needs (128, 64) (64 classes per token)"),
    (["data.name=fashion_mnist", "data.path=/nonexistent/dir"], "/nonexistent/dir"),
    (["data.name=shakespeare", "data.path=/nonexistent/plays.txt"], "/nonexistent/plays.txt"),
])
def test_bad_sizes_data_and_model_data_mismatches_fail_before_any_compute(tmp_path, overrides, message):
    workdir = tmp_path / "run"
    base = tmp_path / "base.yaml"
    base.write_text("progress: false\n")
    args = [sys.executable, "-m", "train", str(base), f"workdir={workdir}", "data.num_classes=64", *overrides]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr[-2000:]
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
