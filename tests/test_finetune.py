"""Fine-tuning (issue 56): LoRA adapters (qwix) on unmodified Linen and NNX models, frozen
params with no gradient, master or optimizer state, stored in the base dtype asked for; the
config's ``finetune`` section from the default experiment to a resumed run; bad settings
refused in one line."""

import io

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

import precision
import train
from helpers import all_eqns, assert_bitwise_equal, saved_leaves
from train.config import ConfigError, from_dict, load_config
from train.config.finetune import random_base_warning
from train.finetune import FineTune, FreezeError, LoRA, merge, param_leaves, param_paths
from train.models import GPT, MODELS

TOKENS = jnp.zeros((2, 16), jnp.int32)
QUICK = {"progress": False, "inference_dtypes": [], "log_every": 5, "checkpoint_every": 0}
RANDOM_BASE = ("warning: finetune.lora without model.init_from: the frozen base is this run's fresh init (random "
               "weights), not a trained model; give model.init_from (a run's workdir or a Hugging Face Flax "
               "directory)")


def _gpt(d_model=32):
    return GPT(vocab_size=64, block_size=16, num_layers=2, num_heads=2, d_model=d_model)


def _text_batch(seed=0):
    keys = jax.random.split(jax.random.key(seed))
    return {"inputs": jax.random.randint(keys[0], (8, 16), 0, 64), "labels": jax.random.randint(keys[1], (8, 16), 0, 64)}


def _state(policy="mixed_bf16", finetune=FineTune(lora=LoRA(rank=4), base="bf16"), model=None, x=TOKENS, **kw):
    return train.create_train_state(model or _gpt(), policy, optax.adam(1e-2), jax.random.key(0), x,
                                    finetune=finetune, **kw)


def _leaves(tree):
    return param_leaves(tree)


def _float_bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)
               if jnp.issubdtype(x.dtype, jnp.floating))


def test_lora_on_the_gpt_trains_only_its_adapters_and_the_frozen_base_costs_only_its_bf16_storage():
    state = _state()
    params = _leaves(state.params)
    adapters = {p for p in params if p.endswith(("_lora_a", "_lora_b"))}
    assert adapters and state.frozen == set(params) - adapters
    assert {str(params[p].dtype) for p in state.frozen} == {"bfloat16"}
    assert {str(params[p].dtype) for p in adapters} == {"float32"}
    # Adam's two moments over the adapters alone: no optimizer state for the base
    adapter_bytes = sum(params[p].size * 4 for p in adapters)
    assert 2 * adapter_bytes <= _float_bytes(state.opt_state) <= 2 * adapter_bytes + 64  # + the wrapper's scalars
    before = jax.tree_util.tree_map(np.asarray, state.params)
    step = train.make_train_step()
    losses = []
    for i in range(6):
        state, metrics = step(state, _text_batch())
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.3, losses
    after = _leaves(state.params)
    for path, old in _leaves(before).items():
        changed = not np.array_equal(old, np.asarray(after[path]))
        assert changed == (path.endswith("_lora_b") or path.endswith("_lora_a")), path
        assert after[path].dtype == old.dtype, path


def test_frozen_params_get_no_gradient_computed_not_a_gradient_zeroed():
    """Each frozen kernel's weight-gradient product is gone from the step's program."""
    def dots(finetune):
        state = _state(finetune=finetune)
        return str(train.make_train_step().trace(state, _text_batch()).jaxpr).count("dot_general"), state

    trained_everything, _ = dots(FineTune(lora=LoRA(rank=4), freeze=()))
    frozen_base, state = dots(FineTune(lora=LoRA(rank=4)))
    frozen_kernels = [p for p in state.frozen if p.endswith("kernel")]
    assert frozen_kernels and trained_everything - frozen_base >= len(frozen_kernels)


def test_under_o2_only_the_adapters_have_float32_masters():
    state = _state("O2", FineTune(lora=LoRA(rank=4)))
    mp = precision.find_mixed_precision_state(state.opt_state)
    masters = param_paths(mp.master_params)
    assert masters and all(p.endswith(("_lora_a", "_lora_b")) for p in masters)
    params = _leaves(state.params)
    assert {str(params[p].dtype) for p in state.frozen if p.endswith("kernel")} == {"float16"}  # O2's param dtype
    assert {str(params[p].dtype) for p in state.frozen if "LayerNorm" in p} == {"float32"}  # O2's rules: norms f32


def test_lora_under_float16_with_dynamic_loss_scaling_trains():
    state = _state("mixed_f16", FineTune(lora=LoRA(rank=4, alpha=8.0), base="f16"))
    step = train.make_train_step()
    first = None
    for _ in range(6):
        state, metrics = step(state, _text_batch())
        first = float(metrics["loss"]) if first is None else first
        assert bool(metrics["grads_finite"])
    assert float(metrics["loss"]) < first - 0.3
    assert float(metrics["loss_scale"]) > 1


def test_freezing_without_adapters_trains_the_rest():
    state = _state("mixed_bf16", FineTune(freeze=(r"^block_0/", "tokens"), base="bf16"))
    assert state.frozen and all(p.startswith("block_0/") or p.startswith("tokens/") for p in state.frozen)
    before = _leaves(jax.tree_util.tree_map(np.asarray, state.params))
    state, _ = train.make_train_step()(state, _text_batch())
    after = _leaves(state.params)
    for path in before:
        assert np.array_equal(before[path], np.asarray(after[path])) == (path in state.frozen), path


class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.up(x))))


def test_lora_on_an_nnx_model():
    x = jnp.ones((2, 8))
    state = _state("mixed_bf16", FineTune(lora=LoRA(rank=2, targets=("up",)), base="bf16"), model=_NNXNet(nnx.Rngs(0)),
                   x=x)
    trained = set(param_paths(state.params)) - state.frozen
    assert trained == {"up/kernel_lora_a", "up/kernel_lora_b"}
    step = train.make_train_step(task="classification")
    batch = {"inputs": jax.random.normal(jax.random.key(1), (16, 8)), "labels": jnp.arange(16) % 4}
    losses = []
    for _ in range(6):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]


class _EinsumHeads(nn.Module):
    """Attention-style projections written with Linen's ``nn.Einsum`` (as Gemma-style models do)."""

    @nn.compact
    def __call__(self, x):
        heads = nn.Einsum((8, 2, 4), "btd,dhk->bthk", name="qkv")(x)
        heads = nn.relu(heads).reshape(*x.shape[:2], 8)
        return nn.Einsum((8, 4), "...d,dv->...v", use_bias=False, name="out")(heads)


def test_lora_on_linen_einsum_modules_trains_their_adapters():
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    state = _state("mixed_bf16", FineTune(lora=LoRA(rank=2), base="bf16"), model=_EinsumHeads(), x=x)
    shapes = {p: v.shape for p, v in _leaves(state.params).items() if p not in state.frozen}
    assert shapes == {"qkv/kernel_lora_a": (8, 2), "qkv/kernel_lora_b": (2, 2, 4), "out/kernel_lora_a": (8, 2),
                      "out/kernel_lora_b": (2, 4)}, shapes
    # the adapted model starts as its base (B is zeros), up to bfloat16's rounding
    base = {m: {k: v.astype(jnp.float32) for k, v in p.items() if "_lora_" not in k} for m, p in state.params.items()}
    np.testing.assert_allclose(state.model.apply({"params": state.params}, x), _EinsumHeads().apply({"params": base}, x),
                               rtol=3e-2, atol=3e-2)
    step = train.make_train_step(task="classification")
    batch = {"inputs": x, "labels": jnp.array([[0, 1, 2, 3, 0], [1, 2, 3, 0, 1]])}
    losses = []
    for _ in range(6):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses


def test_gradients_given_for_a_frozen_param_are_refused_and_trained_ones_apply():
    state = _state()
    grads = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    with pytest.raises(ValueError, match=r"gradients of \d+ frozen params .*state.trained_params"):
        state.apply_gradients(grads=grads)
    grads = jax.tree_util.tree_map(lambda p: jnp.ones(p.shape, jnp.float32), state.trained_params)
    new = state.apply_gradients(grads=grads)
    old, now = _leaves(state.params), _leaves(new.params)
    for path in old:
        assert np.array_equal(old[path], now[path]) == (path in state.frozen), path
    chex.assert_trees_all_equal(merge(new.trained_params, state.params), new.params)
    assert int(new.step) == 1


@pytest.mark.parametrize("finetune, message", [
    (FineTune(lora=LoRA(rank=0)), r"finetune.lora.rank must be a positive integer"),
    (FineTune(lora=LoRA(rank=4, targets=("nothing/here",))),
     r"finetune.lora.targets: 'nothing/here' matches no module .*; the model's modules: .*block_0/attn/qkv"),
    (FineTune(freeze=("no_such_param",)), r"finetune.freeze: 'no_such_param' matches no param of the model "
                                           r"\(paths such as .*\); its modules: .*block_0/attn/qkv"),
    (FineTune(freeze=(".*",)), r"every param of the model is frozen"),
    (FineTune(base="bf16"), r"finetune.base=bf16 stores frozen params, and nothing is frozen"),
    (FineTune(lora=LoRA(rank=2), base="int3"), r"finetune.base: 'int3'; valid: f32, bf16, f16, int8, nf4"),
])
def test_bad_fine_tuning_settings_are_one_line_errors(finetune, message):
    with pytest.raises(FreezeError, match=message) as e:
        _state(finetune=finetune)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def default_base(tmp_path_factory):
    """The shipped default experiment trained 300 steps: (its workdir, its eval)."""
    workdir = tmp_path_factory.mktemp("default_base")
    base = train.run(load_config("configs/default.yaml", [f"workdir={workdir}", "steps=300", "progress=false",
                                                          "inference_dtypes=[]"]), out=io.StringIO())
    return workdir, base["eval"]


def _fine_tuned(default_base, workdir, base_dtype):
    """300 more steps from the default base with LoRA rank 4 on a ``base_dtype`` base: (eval, header, bytes/param)."""
    out = io.StringIO()
    tuned = train.run(load_config("configs/default.yaml", [
        f"workdir={workdir}", "steps=300", "progress=false", "inference_dtypes=[]",
        f"model.init_from={default_base[0]}", "finetune.lora.rank=4", f"finetune.base={base_dtype}"]), out=out)
    header = out.getvalue()
    return tuned["eval"], header, float(header.split("train state: ")[1].split(" bytes/param")[0])


def test_the_default_experiment_fine_tuned_with_lora_keeps_its_accuracy_in_under_three_bytes_per_param(
        default_base, tmp_path):
    """The issue's check, from the shipped config: 300 steps, then LoRA rank 4 on a bf16 base."""
    tuned, header, per_param = _fine_tuned(default_base, tmp_path, "bf16")
    assert per_param <= 3.0, header
    assert "fine-tuning: LoRA adapters on 3 modules (Dense_0, Dense_1, Dense_2)" in header
    assert "frozen arrays in bfloat16 with no gradient, master or optimizer state" in header
    assert "warning: finetune.lora without model.init_from" not in header  # its base is a trained run
    assert tuned["accuracy"] >= default_base[1]["accuracy"] - 0.01, (tuned, default_base[1])


@pytest.mark.parametrize("base, most", [("int8", 1.6), ("nf4", 1.2)])
def test_qlora_a_base_in_codes_trains_its_adapters_and_reads_the_weights_it_stores(base, most):
    state = _state("mixed_bf16", FineTune(lora=LoRA(rank=4), base=base), model=_gpt(d_model=64))  # 64 x 192 qkv
    kernel = _leaves(state.params)["block_0/attn/qkv/kernel"]
    assert isinstance(kernel, precision.QuantizedWeight) and kernel.code == base
    codes = np.asarray(kernel.codes)  # the step donates the state's buffers
    assert str(_leaves(state.params)["block_0/LayerNorm_0/scale"].dtype) == "bfloat16"  # small: 16 bits
    assert precision.state_bytes(state.params, state.opt_state)["params"] < most
    step = train.make_train_step()
    losses = []
    for _ in range(6):
        state, metrics = step(state, _text_batch())
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.3, losses
    after = _leaves(state.params)["block_0/attn/qkv/kernel"]
    np.testing.assert_array_equal(after.codes, codes)
    # the model reads what is stored: the base's output is that of its dequantized weights
    plain = state.replace(params=precision.dequantized(state.params), frozen=frozenset())
    evaluate = train.make_eval_step(task="language_model")
    ours, dequantized = evaluate(state, _text_batch(1)), evaluate(plain, _text_batch(1))
    assert set(ours) == set(dequantized) and len(ours) > 1
    for key in ours:
        np.testing.assert_allclose(ours[key], dequantized[key], rtol=1e-4, err_msg=key)  # fusion order only


def test_the_default_experiment_with_qlora_on_an_nf4_base_in_under_one_and_a_half_bytes_per_param(
        default_base, tmp_path):
    tuned, header, per_param = _fine_tuned(default_base, tmp_path, "nf4")
    assert per_param <= 1.5, header
    assert "nf4 codes with no gradient, master or optimizer state" in header
    assert tuned["accuracy"] >= default_base[1]["accuracy"] - 0.01, (tuned, default_base[1])


@pytest.mark.parametrize("base", ["bf16", "nf4"])
def test_a_lora_run_resumes_exactly(tmp_path, base):
    def config(workdir, steps):
        return from_dict({**QUICK, "steps": steps, "workdir": str(workdir), "checkpoint_every": 10,
                          "model": {"name": "mlp", "hidden": [128]},  # a 64 x 128 kernel: nf4 codes
                          "data": {"name": "synthetic", "input_shape": [64], "num_classes": 4, "num_train": 256,
                                   "num_test": 64, "batch_size": 16},
                          "precision": {"policy": "mixed_f16"},
                          "finetune": {"lora": {"rank": 2}, "base": base}})

    out = io.StringIO()
    train.run(config(tmp_path / "straight", 20), out=out)
    assert RANDOM_BASE in out.getvalue().splitlines()[:5], out.getvalue()  # adapters on a fresh init: said first
    train.run(config(tmp_path / "resumed", 10), out=io.StringIO())
    train.run(config(tmp_path / "resumed", 20), out=io.StringIO())
    assert_bitwise_equal(saved_leaves(tmp_path / "straight", 20)[1], saved_leaves(tmp_path / "resumed", 20)[1])


def test_lora_on_a_fresh_init_is_said_in_one_warning_line_by_check(tmp_path, capsys):
    """``finetune.lora.rank=4`` without ``model.init_from`` trained adapters on a random base, saying nothing
    (the run's first lines: :func:`test_a_lora_run_resumes_exactly`)."""
    config = {"model": {"name": "mlp", "hidden": [16]}, "finetune": {"lora": {"rank": 2}},
              "data": {"name": "synthetic", "input_shape": [8], "num_classes": 2}, "workdir": str(tmp_path)}
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(config))
    from train.cli import main

    assert main([str(tmp_path / "lora.yaml"), "--check"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [RANDOM_BASE]
    for other in ("finetune.lora.rank=null", f"model.init_from={tmp_path}/base"):  # no adapters; a trained base
        assert random_base_warning(load_config(tmp_path / "lora.yaml", [other])) is None


def test_bad_finetune_keys_fail_in_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^finetune.lora.rank must be >= 1, got 0$"):
        from_dict({"finetune": {"lora": {"rank": 0}}})
    with pytest.raises(ConfigError, match=r"^finetune.base: unknown value 'nf5'; valid: f32, bf16, f16, int8, nf4"):
        from_dict({"finetune": {"base": "nf5"}})
    with pytest.raises(ConfigError, match=r"finetune.freeze: '\[' is not a regular expression"):
        from_dict({"finetune": {"freeze": ["["]}})
    config = from_dict({**QUICK, "steps": 1, "workdir": str(tmp_path),
                        "finetune": {"lora": {"rank": 2, "targets": ["Dense_9"]}}})
    with pytest.raises(ConfigError, match=r"finetune.lora.targets: 'Dense_9' matches no module .*Dense_0, Dense_1"):
        train.run(config, out=io.StringIO())


class _Classifier(nn.Module):
    """Written as a user would: a pinned float32 Dense, no ``train`` keyword."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, dtype=jnp.float32, name="hidden")(x))
        return nn.Dense(4, dtype=jnp.float32, name="head")(x)


def test_adapters_on_a_pinned_float32_model_run_in_the_compute_dtype():
    state = _state("mixed_bf16", FineTune(lora=LoRA(rank=2), base="bf16"), model=_Classifier(), x=jnp.ones((2, 8)))
    batch = {"inputs": jnp.ones((4, 8)), "labels": jnp.zeros((4,), jnp.int32)}
    jaxpr = train.make_train_step(task="classification").trace(state, batch).jaxpr
    dots = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), \
        {str(v.aval.dtype) for e in dots for v in e.invars}



def test_a_fine_tuning_continues_from_a_run_whose_base_is_in_nf4_codes(tmp_path):
    """init_from reads a frozen base saved as codes back into floats (and the codes come out the same)."""
    config = {**QUICK, "steps": 3, "model": {"name": "mlp", "hidden": [128]},
              "data": {"name": "synthetic", "input_shape": [64], "num_classes": 4, "num_train": 256, "num_test": 64,
                       "batch_size": 16},
              "precision": {"policy": "mixed_bf16"}, "finetune": {"lora": {"rank": 2}, "base": "nf4"}}
    train.run(from_dict({**config, "workdir": str(tmp_path / "first")}), out=io.StringIO())
    saved = dict(_flat(saved_state_params(tmp_path / "first")))
    state = _state("mixed_bf16", FineTune(lora=LoRA(rank=2), base="nf4"),
                   model=MODELS["mlp"](hidden=(128,), num_classes=4), x=jnp.ones((1, 64)),
                   init_from=str(tmp_path / "first"))
    kernel = _leaves(state.params)["Dense_0/kernel"]
    np.testing.assert_array_equal(np.asarray(kernel.codes), saved["Dense_0/kernel/codes"])
    np.testing.assert_array_equal(np.asarray(_leaves(state.params)["Dense_0/kernel_lora_b"]),
                                  saved["Dense_0/kernel_lora_b"])


def saved_state_params(workdir):
    from helpers import saved_state

    return saved_state(workdir)[1]["params"]


def _flat(tree):
    return [("/".join(str(getattr(k, "key", k)) for k in path), np.asarray(x))
            for path, x in jax.tree_util.tree_leaves_with_path(tree)]


def test_under_fsdp_the_frozen_base_is_split_and_gathered_in_its_stored_codes(tmp_path):
    """Two CPU devices, mesh fsdp=2: the nf4 base crosses the wire as its uint8 codes."""
    import subprocess
    import sys

    from helpers import ROOT, subprocess_env

    result = subprocess.run(
        [sys.executable, "-m", "train", "configs/default.yaml", f"workdir={tmp_path}", "finetune.lora.rank=4",
         "finetune.base=nf4", "mesh.fsdp=2", "mesh.data=1", "mesh.fsdp_min_size=64", "--explain"],
        cwd=ROOT, env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    gathers = [line.split() for line in result.stdout.splitlines() if "all-gather" in line]
    assert any(g[0] == "params" and g[2] == "u8" for g in gathers), result.stdout
    # the frozen matrices' codes are gathered, not float32 copies of them: float32 gathers are small
    f32 = [float(g[4]) for g in gathers if g[2] == "f32"]
    codes = [float(g[4]) for g in gathers if g[2] == "u8"]
    assert sum(f32) < sum(codes), gathers


def test_lora_on_a_scanned_rematerialized_gpt_trains_its_stacked_adapters_and_exports_merged(tmp_path):
    """``scan_layers`` stacks each block's kernels along a layer axis and ``remat`` recomputes the
    block: qwix's adapters go on the stacked kernels, the nf4 base stays frozen through the scan,
    and the export merges each layer's adapters into its slice of the stacked kernel."""
    from train.inspections.export import export_run

    workdir = tmp_path / "run"
    config = from_dict({**QUICK, "steps": 6, "workdir": str(workdir), "checkpoint_every": 6,
                        "optimizer": {"lr": 2e-2}, "precision": {"policy": "mixed_bf16"},
                        "model": {"name": "gpt", "num_layers": 2, "num_heads": 2, "d_model": 32,
                                  "scan_layers": True, "remat": "full"},
                        "data": {"name": "synthetic_text", "num_classes": 64, "seq_len": 16, "num_test": 64,
                                 "batch_size": 8, "eval_batch_size": 8, "eval_batches": 1},
                        "finetune": {"lora": {"rank": 2}, "base": "nf4"}})
    out = io.StringIO()
    train.run(config, out=out)
    assert "fine-tuning: LoRA adapters on 5 modules (blocks/block/Dense_0" in out.getvalue()
    from flax import traverse_util

    params = traverse_util.flatten_dict(saved_state_params(workdir), sep="/")  # as saved
    stacked = {p: np.asarray(x) for p, x in params.items() if p.startswith("blocks/") and "lora" in p}
    assert stacked and all(x.shape[0] == 2 for x in stacked.values())  # one adapter per layer, stacked
    assert any(np.abs(x).max() > 0 for p, x in stacked.items() if p.endswith("_lora_b"))  # B starts at 0
    report = export_run(workdir, tmp_path / "f32", "f32")
    assert "blocks/block/attn/qkv/kernel" in report.merged and report.lora_match < 1e-5
