"""Export (issue 56, parts 2 and 4): ``python -m train export RUN --dtype bf16 OUT`` writes a trained
run's weights for serving, LoRA adapters merged (on a bf16 or nf4 base, on Dense, DenseGeneral, Einsum
and transposed kernels, on a Hugging Face GPT-2), norms kept in float32, read back by
``model.init_from``; bad input refused in one line with nothing written."""

import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from safetensors.numpy import load_file

import train
from helpers import saved_state
from train.cli import main
from train.config import from_dict, load_config
from train.experiment.builders import build_train_state
from train.inspections.export import ExportError, export_run, format_report
from train.training.inference import cast_for_inference

QUICK = {"progress": False, "inference_dtypes": [], "log_every": 5, "checkpoint_every": 0}
DATA = {"name": "synthetic", "input_shape": [64], "num_classes": 4, "num_train": 256, "num_test": 64,
        "batch_size": 16, "eval_batch_size": 64}
# a larger learning rate than fine-tuning would use: adapters that change the outputs well past bf16's rounding
LORA_RUN = {"steps": 12, "optimizer": {"lr": 2e-2}, "precision": {"policy": "mixed_bf16"}}


def _train(workdir, finetune, model=None, data=DATA, **extra):
    config = from_dict({**QUICK, **LORA_RUN, "workdir": str(workdir), "data": data,
                        "model": model or {"name": "mlp", "hidden": [128]},  # a 64 x 128 kernel: nf4 codes
                        "finetune": finetune, **extra})
    train.run(config, out=io.StringIO())
    return workdir


@pytest.fixture(scope="module", params=["bf16", "nf4"])
def lora_run(request, tmp_path_factory):
    """A LoRA run (rank 2) on a frozen base stored in bf16 or in nf4 codes."""
    return _train(tmp_path_factory.mktemp(f"lora_{request.param}"), {"lora": {"rank": 2}, "base": request.param})


def _trained_state(workdir):
    """The run's train state as it was saved (its LoRA model, its frozen base as stored), read
    by the framework's own checkpointer: the reference the export is checked against."""
    config = load_config(workdir / "config.yaml")
    data, _, model = train.build_experiment(config)
    state, _ = build_train_state(config, model, data)
    checkpointer = train.Checkpointer(workdir / "checkpoints")
    state, _ = checkpointer.restore(state)
    checkpointer.close()
    return config, data, model, state


def _outputs(model, params, x):
    """The model's output (its logits) computed in float32, its params as given (a bound
    model's rules kept; 8/4-bit weights read as floats)."""
    bound = train.rebind(model, "fp32") if hasattr(model, "policy") else train.bind(model, "fp32")
    out = bound.apply({"params": params}, x, **train.mode_kwargs(bound, False))
    return np.asarray(getattr(out, "logits", out), np.float32)


def _without_adapters(params):
    flat = traverse_util.flatten_dict(jax.device_get(params))
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if "_lora_" not in k[-1]})


def _exported(out):
    return {k.removeprefix("params/"): v for k, v in load_file(os.path.join(out, "params.safetensors")).items()}


def test_a_lora_run_exports_in_bf16_with_its_adapters_merged_and_its_norms_in_float32(lora_run, tmp_path):
    report = export_run(lora_run, tmp_path / "bf16", "bf16")
    assert report.merged == ("Dense_0/kernel", "Dense_1/kernel") and report.lora_match < 1e-5
    assert report.kept_float32 == {p: "rule LayerNorm -> f32 (mixed_bf16's rules)"
                                   for p in ("LayerNorm_0/bias", "LayerNorm_0/scale")}
    flat = _exported(tmp_path / "bf16")
    assert {k: str(v.dtype) for k, v in flat.items()} == {
        "Dense_0/bias": "bfloat16", "Dense_0/kernel": "bfloat16", "Dense_1/bias": "bfloat16",
        "Dense_1/kernel": "bfloat16", "LayerNorm_0/bias": "float32", "LayerNorm_0/scale": "float32"}  # adapters gone
    manifest = json.loads((tmp_path / "bf16" / "export.json").read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["step"] == 12 and manifest["merged"] == list(report.merged)
    assert report.bytes == os.path.getsize(tmp_path / "bf16" / "params.safetensors")

    config, data, model, state = _trained_state(lora_run)
    x = data.x_test[:32]
    lora = _outputs(state.model, state.params, x)  # the LoRA model, its base dequantized, adapters beside
    merged = _outputs(model, traverse_util.unflatten_dict(flat, sep="/"), x)
    base_only = _outputs(model, _without_adapters(state.params), x)
    scale = np.abs(lora).max()
    np.testing.assert_allclose(merged, lora, rtol=0, atol=2 ** -7 * scale)  # to bf16 rounding
    assert np.abs(base_only - lora).max() > 10 * np.abs(merged - lora).max()  # the adapters matter here

    export_run(lora_run, tmp_path / "f32", "f32")  # in float32: the merge itself, to float32 rounding
    f32 = _exported(tmp_path / "f32")
    assert {str(v.dtype) for v in f32.values()} == {"float32"}
    np.testing.assert_allclose(_outputs(model, traverse_util.unflatten_dict(f32, sep="/"), x), lora,
                               rtol=0, atol=1e-5 * scale)


def test_an_int8_export_holds_each_matmul_weight_in_codes_with_a_scale_per_output_channel(lora_run, tmp_path):
    report = export_run(lora_run, tmp_path / "int8", "int8", check_accuracy=True)
    assert report.dtype == "int8" and report.int8 == ("Dense_0/kernel",)  # 64 x 128; the rest is under 4,096 values
    flat = _exported(tmp_path / "int8")
    codes, scales = flat["Dense_0/kernel/channel_codes"], flat["Dense_0/kernel/channel_scales"]
    assert codes.dtype == np.int8 and scales.shape == (1, 128) and flat["Dense_1/kernel"].dtype == jnp.bfloat16
    assert flat["LayerNorm_0/scale"].dtype == np.float32
    merged = _exported(export_run(lora_run, tmp_path / "f32", "f32").out)["Dense_0/kernel"]
    np.testing.assert_allclose(codes * scales, merged, rtol=0, atol=float(scales.max()) / 2 + 1e-7)  # per column
    read, _ = train.load_pretrained(tmp_path / "int8")  # model.init_from reads it back as float32
    np.testing.assert_array_equal(read["params"]["Dense_0"]["kernel"], codes.astype(np.float32) * scales)
    assert abs(report.accuracy["bfloat16"]["accuracy"] - report.accuracy["float32"]["accuracy"]) <= 0.05
    assert "int8: 1 weights as int8 codes with a float32 scale per output channel" in format_report(report)


def test_the_accuracy_check_serves_exactly_the_exported_weights(lora_run, tmp_path):
    report = export_run(lora_run, tmp_path / "f16", "f16", check_accuracy=True)
    assert set(report.accuracy) == {"float32", "float16"} and "accuracy_delta" in report.accuracy["float16"]
    assert "accuracy on the eval split: float32 " in format_report(report)
    assert export_run(lora_run, tmp_path / "f32", "f32").kept_float32 == {}
    # the f16 export is half-precision inference (norms in float32) of the merged float32 weights
    _, data, model, _ = _trained_state(lora_run)
    merged = traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in _exported(tmp_path / "f32").items()}, sep="/")
    state = train.create_train_state(model, "mixed_f16", optax.identity(), jax.random.key(0), data.sample_input(1),
                                     variables={"params": merged})
    served = traverse_util.flatten_dict(cast_for_inference(state, "float16").params, sep="/")
    for path, value in _exported(tmp_path / "f16").items():
        assert value.dtype == served[path].dtype, path
        np.testing.assert_array_equal(value, np.asarray(served[path]), err_msg=path)


def test_model_init_from_an_export_starts_a_new_run_from_its_weights(lora_run, tmp_path, capsys):
    out = tmp_path / "out"
    export_run(lora_run, out, "bf16")
    exported = _exported(out)
    model = {"name": "mlp", "hidden": [128], "init_from": str(out)}
    config = from_dict({**QUICK, "steps": 2, "workdir": str(tmp_path / "next"), "data": DATA, "model": model,
                        "precision": {"policy": "fp32"}})
    data, _, built = train.build_experiment(config)
    state, _ = build_train_state(config, built, data)
    for path, value in traverse_util.flatten_dict(state.params, sep="/").items():
        np.testing.assert_array_equal(np.asarray(value), exported[path].astype(np.float32), err_msg=path)
    text = io.StringIO()
    train.run(config, out=text)
    assert f"params from the exported weights in {out}" in text.getvalue()


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_adapters_on_transposed_square_dense_general_batched_and_einsum_kernels_merge(kind, tmp_path):
    """The layout of ``A @ B`` in a weight is found whatever the matmul that reads it (qwix
    cannot adapt a Linen ``nn.Einsum``: it sets an attribute on the frozen module; NNX's it can)."""
    (tmp_path / "layouts.py").write_text(LAYOUTS)
    run = _train(tmp_path / "run", {"lora": {"rank": 2, "alpha": 4}, "base": "bf16"},
                 model={"name": f"{tmp_path / 'layouts.py'}:{'Linen' if kind == 'linen' else 'NNX'}"},
                 data={**DATA, "input_shape": [16]})
    report = export_run(run, tmp_path / "out", "f32")
    adapted = {"square", "general", "head"} | ({"einsum", "batched"} if kind == "nnx" else set())
    assert set(report.merged) == {f"{name}/kernel" for name in adapted}
    _, data, model, state = _trained_state(run)
    x = data.x_test[:16]
    lora = _outputs(state.model, state.params, x)
    merged = _outputs(model, traverse_util.unflatten_dict(_exported(tmp_path / "out"), sep="/"), x)
    assert np.abs(_outputs(model, _without_adapters(state.params), x) - lora).max() > 1e-3 * np.abs(lora).max()
    np.testing.assert_allclose(merged, lora, rtol=0, atol=1e-5 * np.abs(lora).max())


LAYOUTS = '''
import flax.linen as nn
import jax
from flax import nnx


def transposed(x, kernel):
    """Hugging Face GPT-2's Conv1D: a kernel [out, in], read transposed (square here: its shape tells nothing)."""
    return jax.lax.dot_general(x, kernel.transpose(), (((x.ndim - 1,), (0,)), ((), ())))


class Linen(nn.Module):
    num_classes: int = 4

    @nn.compact
    def __call__(self, x):
        h = nn.relu(Square(name="square")(x)).reshape(x.shape[0], 4, 4)
        h = nn.DenseGeneral(16, axis=(-2, -1), name="general")(h)  # kernel (4, 4, 16): two axes contracted
        return nn.Dense(self.num_classes, name="head")(nn.LayerNorm()(h))


class Square(nn.Module):
    @nn.compact
    def __call__(self, x):
        return transposed(x, self.param("kernel", nn.initializers.normal(0.3), (16, 16)))


class NNXSquare(nnx.Module):
    def __init__(self, rngs):
        self.kernel = nnx.Param(nnx.initializers.normal(0.3)(rngs.params(), (16, 16)))

    def __call__(self, x):
        return transposed(x, self.kernel.value)


class NNX(nnx.Module):
    def __init__(self, num_classes=4, *, rngs):
        self.square = NNXSquare(rngs)
        self.einsum = nnx.Einsum("bhd,hde->bhe", (4, 4, 8), rngs=rngs)  # the kernel's first axis is a batch one
        self.batched = nnx.LinearGeneral(8, 16, batch_axis={0: 4}, rngs=rngs)  # dot_general with a batch axis
        self.general = nnx.LinearGeneral((4, 16), 16, axis=(-2, -1), rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, num_classes, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.square(x)).reshape(x.shape[0], 4, 4)
        h = self.batched(nnx.relu(self.einsum(h)).swapaxes(0, 1)).swapaxes(0, 1)
        return self.head(self.norm(self.general(nnx.relu(h))))
'''


def test_a_run_with_half_params_gives_the_adapters_masters_and_the_frozen_base_as_stored(tmp_path):
    """pure_bf16 keeps float32 masters of the trained params only (the adapters): the frozen base
    is read from the params (it has no master), the adapters from the masters."""
    run = _train(tmp_path / "run", {"lora": {"rank": 2}, "base": "nf4"}, precision={"policy": "pure_bf16"})
    loaded, _ = train.load_pretrained(run)
    flat = {"/".join(k): v for k, v in traverse_util.flatten_dict(loaded["params"]).items()}
    assert {k: (v.shape, str(v.dtype)) for k, v in flat.items() if "Dense_0" in k} == {
        "Dense_0/bias": ((128,), "float32"), "Dense_0/kernel/codes": ((128, 32), "uint8"),
        "Dense_0/kernel/scales": ((128,), "float32"), "Dense_0/kernel_lora_a": ((64, 2), "float32"),
        "Dense_0/kernel_lora_b": ((2, 128), "float32")}
    masters = saved_state(run)[1]["opt_state"]["master_params"]
    np.testing.assert_array_equal(flat["Dense_0/kernel_lora_b"], np.asarray(masters["Dense_0"]["kernel_lora_b"]))
    report = export_run(run, tmp_path / "out", "bf16")
    assert report.merged == ("Dense_0/kernel", "Dense_1/kernel") and report.lora_match < 1e-5


BATCH_NORM = '''
import flax.linen as nn


class Net(nn.Module):
    num_classes: int = 4

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x)))
        return nn.Dense(self.num_classes)(x)
'''


def test_batch_statistics_are_exported_in_float32_and_read_back_with_the_params(tmp_path):
    (tmp_path / "bn.py").write_text(BATCH_NORM)
    run = _train(tmp_path / "run", {}, model={"name": f"{tmp_path / 'bn.py'}:Net"})
    report = export_run(run, tmp_path / "out", "f16")
    assert report.merged == () and report.lora_match is None
    assert report.kept_float32 == {f"BatchNorm_0/{w}": "rule BatchNorm -> f32 (mixed_bf16's rules)"
                                   for w in ("bias", "scale")}
    flat = load_file(tmp_path / "out" / "params.safetensors")
    assert {k: str(v.dtype) for k, v in flat.items() if not k.startswith("params/Dense")} == {
        "params/BatchNorm_0/bias": "float32", "params/BatchNorm_0/scale": "float32",
        "batch_stats/BatchNorm_0/mean": "float32", "batch_stats/BatchNorm_0/var": "float32"}
    assert str(flat["params/Dense_0/kernel"].dtype) == "float16"
    saved = saved_state(run)[1]["model_state"]["batch_stats"]["BatchNorm_0"]
    np.testing.assert_array_equal(flat["batch_stats/BatchNorm_0/var"], np.asarray(saved["var"]))
    loaded, source = train.load_pretrained(tmp_path / "out")
    assert source == f"the exported weights {tmp_path / 'out' / 'params.safetensors'}"
    np.testing.assert_array_equal(loaded["batch_stats"]["BatchNorm_0"]["mean"], np.asarray(saved["mean"]))
    assert loaded["params"]["Dense_0"]["kernel"].dtype == np.float32  # widened exactly, as init_from reads


def test_an_export_that_fails_while_writing_leaves_nothing(lora_run, tmp_path, monkeypatch):
    import train.inspections.export as export

    def broken(directory, report):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_manifest", broken)
    (tmp_path / "out").mkdir()  # empty: allowed, and left as it was
    assert main(["export", str(lora_run), str(tmp_path / "out"), "--dtype", "bf16"]) == 3
    assert os.listdir(tmp_path) == ["out"] and os.listdir(tmp_path / "out") == []


def test_bad_input_is_one_line_exit_2_and_nothing_is_written(lora_run, tmp_path, capsys):
    (tmp_path / "untrained").mkdir()
    (tmp_path / "untrained" / "config.yaml").write_text("steps: 1\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        ([str(tmp_path / "nowhere"), str(tmp_path / "a")], "does not exist"),
        ([str(tmp_path / "full"), str(tmp_path / "a")], "is not a run of this framework: it has no config.yaml"),
        ([str(tmp_path / "untrained"), str(tmp_path / "a")], "is not a trained run: it has no checkpoints"),
        ([str(lora_run), str(tmp_path / "full")], "exists and is not empty; give a new directory"),
    ]
    for args, message in cases:
        assert main(["export", *args, "--dtype", "bf16"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert main(["export", str(lora_run), str(tmp_path / "a"), "--dtype", "int4"]) == 2
    assert capsys.readouterr().err == "error: --dtype 'int4': give bf16, f16, f32 or int8\n"
    assert sorted(os.listdir(tmp_path)) == ["full", "untrained"]  # no OUT, no partial directory
    with pytest.raises(ExportError, match="--dtype"):
        export_run(lora_run, tmp_path / "a", "half")


def test_the_command_prints_one_line_per_fact(lora_run, tmp_path, capsys):
    assert main(["export", str(lora_run), "--dtype", "bf16", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["exported", "merged", "kept in float32", "written"], lines
    assert lines[0] == f"exported: 6 params (9,092 values) in bfloat16, from step 12 of {lora_run}"
    assert lines[1].startswith("merged: 2 LoRA adapter pairs into their weights (Dense_0/kernel, Dense_1/kernel)")
    assert lines[2] == ("kept in float32: 2 params (LayerNorm_0/bias, LayerNorm_0/scale): rule LayerNorm -> f32 "
                        "(mixed_bf16's rules)")


def test_a_config_named_export_is_not_taken_for_the_subcommand(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["export.yaml", "--print-config"]) == 2  # a config path: looked for, not exported
    assert "config file export.yaml not found" in capsys.readouterr().err


def test_a_hugging_face_gpt2_fine_tuned_with_lora_exports_to_a_directory_transformers_loads(tmp_path):
    from helpers import flax_transformers

    transformers = flax_transformers()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=32, n_positions=32,
                                  architectures=["GPT2LMHeadModel"])
    cfg.save_pretrained(tmp_path / "gpt2")  # config.json alone: a fresh init, fine-tuned with adapters
    model = {"name": "train.weights.huggingface:model", "path": str(tmp_path / "gpt2"), "output": "logits"}
    text = {"name": "synthetic_text", "num_classes": 32, "seq_len": 32, "batch_size": 8, "num_train": 4000,
            "num_test": 400, "eval_batch_size": 32, "eval_batches": 2}
    run = _train(tmp_path / "run", {"lora": {"rank": 4}, "base": "bf16"}, model=model, data=text)
    report = export_run(run, tmp_path / "hf", "bf16")
    assert report.format == "huggingface" and report.files == ("model.safetensors", "config.json", "export.json")
    assert len(report.merged) == 8 and "transformer/h/0/attn/c_proj/kernel" in report.merged  # square, transposed
    assert set(report.kept_float32) == {f"transformer/{p}/{w}" for p in ("h/0/ln_1", "h/0/ln_2", "h/1/ln_1",
                                                                         "h/1/ln_2", "ln_f") for w in ("bias", "scale")}
    loaded = transformers.FlaxGPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    dtypes = {"/".join(k): str(v.dtype) for k, v in traverse_util.flatten_dict(loaded.params).items()}
    assert dtypes["transformer/h/0/attn/c_attn/kernel"] == "bfloat16" and dtypes["transformer/ln_f/scale"] == "float32"
    assert not any("lora" in k for k in dtypes)
    _, data, _, state = _trained_state(run)
    ids = next(iter(data.eval_batches(4, 1)))["inputs"]
    lora = _outputs(state.model, state.params, ids).reshape(-1)
    served = np.asarray(loaded(ids, params=jax.tree_util.tree_map(lambda v: v.astype(jnp.float32),
                                                                   loaded.params)).logits, np.float32).reshape(-1)
    np.testing.assert_allclose(served, lora, rtol=0, atol=2 ** -6 * np.abs(lora).max())


AMPLIFIED = '''
import flax.linen as nn


class Amplify(nn.Module):
    """A Dense whose output is scaled past float16's range (x 1e5): trains in bfloat16, overflows in float16."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="wide")(x) * 1e5


class Net(nn.Module):
    num_classes: int = 4

    @nn.compact
    def __call__(self, x):
        x = Amplify(name="amplify")(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(self.num_classes)(nn.LayerNorm()(x))
'''


def test_the_doctor_on_the_served_weights_names_what_overflows_only_there_and_its_fix_exports_clean(tmp_path, capsys):
    """A model trained in bfloat16 whose activations pass float16's range: exported in f16,
    ``--diagnose`` runs the doctor on serving it (eval forward in float16), names the module,
    and its verified rule, given back to export, keeps that module in float32 and serves clean."""
    (tmp_path / "amplified.py").write_text(AMPLIFIED)
    config = from_dict({**QUICK, "steps": 4, "workdir": str(tmp_path / "run"), "data": DATA,
                        "model": {"name": f"{tmp_path / 'amplified.py'}:Net"}, "precision": {"policy": "mixed_bf16"}})
    train.run(config, out=io.StringIO())
    run = tmp_path / "run"
    assert main(["export", str(run), "--dtype", "f16", str(tmp_path / "f16"), "--diagnose"]) == 0
    printed = capsys.readouterr().out
    assert "doctor, serving in float16 (one eval batch; diagnosis.json): mul in amplify (forward) first went " \
           "non-finite; verified fix: add the rule [amplify, f32]" in printed
    written = json.loads((tmp_path / "f16" / "diagnosis.json").read_text())
    assert written["reason"] == "export --dtype float16" and written["first_nonfinite"]["path"] == "amplify"
    manifest = json.loads((tmp_path / "f16" / "export.json").read_text())
    assert manifest["diagnosis"]["healthy"] is False and "diagnosis.json" in manifest["files"]
    again = manifest["diagnosis"]["export_again"]
    assert again.startswith(f"python -m train export {run} --dtype float16 OUT 'precision.rules=[[amplify, f32], ")
    fix = again.split(" OUT ", 1)[1].strip("'")
    report = export_run(run, tmp_path / "fixed", "f16", diagnose=True, overrides=[fix])
    assert report.kept_float32["amplify/wide/kernel"] == "rule amplify -> f32 (precision.rules)"
    assert report.diagnosis["healthy"] and report.diagnosis["export_again"] is None
    assert _exported(tmp_path / "fixed")["amplify/wide/kernel"].dtype == np.float32
    assert _exported(tmp_path / "fixed")["Dense_0/kernel"].dtype == np.float16
    # the export reads no other override: the run's model and training stay the run's
    assert main(["export", str(run), "--dtype", "f16", str(tmp_path / "bad"), "optimizer.lr=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: export takes only precision.rules=[...] overrides (the rules that keep modules in "
                   "float32), got 'optimizer.lr=1'"] and not (tmp_path / "bad").exists()


def test_sampling_a_run_that_is_not_a_language_model_is_one_line_exit_2(lora_run, capsys):
    assert main(["sample", str(lora_run), "--prompt", "ROMEO:"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {lora_run} is not a language model: its task is classification (data synthetic); sample "
                   f"generates text from a model trained to predict the next token (task language_model)\n")
