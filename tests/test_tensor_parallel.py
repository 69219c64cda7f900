"""Tensor (and sequence) parallelism: the layout found in a model's traced program, its
collectives in the policy's dtypes, and training on a ``tensor`` mesh like one device.

The ``test_multidevice_*`` tests need 8 devices: the 1-device session runs them in the
8-device subprocess of ``tests/test_distributed.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision
from train import create_train_state, make_train_step
from train.cli import _mesh_overrides
from train.config import ConfigError, from_dict
from train.models import GPT, MLP
from train.parallel.distributed import Layout, MeshError, _check_tensor_in_hosts, crossing_axes, make_mesh, to_host
from train.parallel.tensor.plan import Split, TensorPlan
from train.parallel.tensor.planning import TensorLayoutError, find_layout, parse_rules, plan_of

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: runs in the 8-device subprocess")
VOCAB, SEQ = 64, 16
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (8, SEQ), dtype=np.int32)


def _gpt(**kw):
    return GPT(**{"vocab_size": VOCAB, "block_size": SEQ, "num_layers": 1, "num_heads": 4, "d_model": 32, **kw})


def _plan(model, tensor=4, sample=TOKENS[:1], rules=(), fsdp=1):
    """The plan found in ``model``'s program under mixed_bf16 (traced, nothing computed)."""
    wrapped = precision.with_policy(model, "mixed_bf16") if not isinstance(model, nnx.Module) else None
    if wrapped is None:
        from train.training.binding import bind
        wrapped = bind(model, "mixed_bf16", None)
    variables = jax.eval_shape(lambda: wrapped.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                                                    sample))
    found = find_layout(lambda v: wrapped.apply(v, sample), (variables,), variables["params"], tensor)
    return plan_of(found, variables["params"], tensor, fsdp, rules)


def _splits(plan):
    return {"/".join(s.path): (s.dim, s.role, s.parts) for s in plan.splits}


def _kept(plan):
    return {"/".join(k.path): k.why for k in plan.kept}


# ----------------------------------------------------------------------------- the mesh


class _Device:
    def __init__(self, i, process):
        self.id, self.process_index, self.platform = i, process, "gpu"


def test_tensor_is_the_innermost_axis_and_stays_inside_a_host():
    mesh = make_mesh(-1, 1, tensor=1)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    with pytest.raises(MeshError, match=r"mesh.tensor=3 does not divide the 4 devices of a process"):
        _check_tensor_in_hosts([_Device(i, i // 4) for i in range(8)], 3)
    _check_tensor_in_hosts([_Device(i, i // 4) for i in range(8)], 4)

    class Mesh:  # two hosts of 4 devices, tensor=4 inside each: only data crosses hosts
        axis_names = ("data", "fsdp", "tensor")
        devices = np.array([_Device(i, i // 4) for i in range(8)], dtype=object).reshape(2, 1, 4)

    assert crossing_axes(Mesh) == ["data"]
    Mesh.devices = Mesh.devices.reshape(1, 2, 4)
    assert crossing_axes(Mesh) == ["fsdp"]


def test_mesh_settings_from_the_command_line_and_the_config():
    assert _mesh_overrides("fsdp=2,tensor=4") == ["mesh.fsdp=2", "mesh.tensor=4"]
    with pytest.raises(ValueError, match="give data=D,fsdp=F,tensor=T"):
        _mesh_overrides("model=2")
    for raw, message in [({"mesh": {"tensor": 0}}, "mesh.tensor must be >= 1"),
                         ({"precision": {"tensor_reduce_dtype": "f8"}}, "precision.tensor_reduce_dtype: 'f8'"),
                         ({"sharding": {"rules": [["head", ["model"]]]}}, "each dimension takes tensor, fsdp or null"),
                         ({"sharding": {"rules": [["(", [None]]]}}, "is not a regular expression")]:
        with pytest.raises(ConfigError, match=message):
            from_dict(raw)


# ----------------------------------------------------------------------------- the plan


def test_the_gpt_splits_by_heads_its_fused_qkv_and_its_mlp_and_its_vocabulary():
    plan = _plan(_gpt())
    splits, kept = _splits(plan), _kept(plan)
    assert splits["block_0/attn/qkv/kernel"] == (1, "column", 3)  # q, k and v in one kernel: 3 parts
    assert splits["block_0/attn/qkv/bias"] == (0, "feature", 3)
    assert splits["block_0/attn/proj/kernel"] == (0, "row", 1)
    assert splits["block_0/Dense_0/kernel"] == (1, "column", 1) and splits["block_0/Dense_1/kernel"] == (0, "row", 1)
    assert splits["tokens/embedding"] == (0, "vocabulary", 1) and splits["head/kernel"] == (1, "vocabulary", 1)
    assert kept["positions/embedding"] == "looked up at fixed positions in positions"
    assert "block_0/LayerNorm_0" in kept["block_0/LayerNorm_0/scale"]
    assert "block_0/attn/proj/bias" in kept  # added after the row-parallel sum


def test_a_scanned_gpt_splits_its_stacked_layers_behind_the_layer_axis():
    splits = _splits(_plan(_gpt(num_layers=2, scan_layers=True, remat="full")))
    assert splits["blocks/block/attn/qkv/kernel"] == (2, "column", 3)
    assert splits["blocks/block/Dense_1/kernel"] == (1, "row", 1)


def test_an_nnx_model_splits_its_heads():
    from flax import nnx

    class Attention(nnx.Module):
        def __init__(self, *, rngs):
            self.embed = nnx.Embed(VOCAB, 32, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=rngs)
            self.head = nnx.Linear(32, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            return self.head(x + self.attn(x, mask=nnx.make_causal_mask(tokens)))

    splits = _splits(_plan(Attention(rngs=nnx.Rngs(0))))
    assert splits["attn/query/kernel"] == (1, "column", 1)  # (features, heads, head_dim): heads
    assert splits["attn/out/kernel"] == (0, "row", 1)  # (heads, head_dim, features)


def test_a_norm_over_the_split_features_keeps_the_pair_whole_and_says_why():
    class NormedMLP(MLP):
        pass

    kept = _kept(_plan(MLP(hidden=(64, 64), num_classes=4), sample=np.zeros((1, 16), np.float32)))
    assert "reduce_sum over the split features in LayerNorm_0" in kept["Dense_0/kernel"]


def test_sizes_tensor_does_not_divide_are_one_line_naming_the_module():
    with pytest.raises(TensorLayoutError, match=r"^mesh.tensor=3 does not divide the 4 heads per part of "
                                                r"block_0/attn/qkv \(96 features as 12 x 8, in block_0/attn\)"):
        _plan(_gpt(), tensor=3)
    with pytest.raises(TensorLayoutError, match=r"does not divide the vocabulary of 66 tokens of tokens"):
        _plan(_gpt(vocab_size=66), tensor=4, sample=np.zeros((1, SEQ), np.int32))


def test_rules_override_the_plan_and_a_plan_finds_each_param_in_any_tree():
    plan = _plan(_gpt(), rules=parse_rules([["head/kernel", [None, None]], ["Dense_1/kernel", ["tensor", "fsdp"]]]),
                 fsdp=2)
    head = plan.split_of(("head", "kernel"), (32, VOCAB))
    assert head.dim is None and head.spec == (None, None)
    opt_path = ("opt_state", "1", "0", "mu", "block_0", "Dense_1", "kernel")  # a moment of the param
    assert plan.spec(opt_path, (128, 32)) == ("tensor", "fsdp") and plan.dim(opt_path, (128, 32)) == 0
    assert plan.split_of(opt_path, (4, 4)) is None  # another shape: not that param
    with pytest.raises(TensorLayoutError, match=r"gives \['tensor'\] to head/kernel of shape \[32, 64\]"):
        _plan(_gpt(), rules=parse_rules([["head/kernel", ["tensor"]]]))

    class FakeMesh:
        shape = {"data": 1, "fsdp": 2, "tensor": 4}

    layout = Layout(FakeMesh(), fsdp_min_size=1, tensor_plan=TensorPlan(4, (Split(("w",), 1, "column", "", (8, 16)),)))
    assert layout.param_spec((8, 16), ("w",)) == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert layout.used_spec((8, 16), ("w",)) == jax.sharding.PartitionSpec(None, "tensor")
    assert layout.param_spec((8, 16), ("other",)) == jax.sharding.PartitionSpec(None, "fsdp")


# ----------------------------------------------------------------------------- 8 devices


def _step(layout, model, steps=3, policy="mixed_bf16", **kw):
    state = create_train_state(model, policy, optax.sgd(0.3), jax.random.key(0), TOKENS[:1], layout=layout, **kw)
    step = make_train_step(task="lm", layout=layout, donate=False)
    batch = {"inputs": TOKENS, "labels": np.roll(TOKENS, -1, axis=1)}
    batch = layout.global_batch(batch, len(TOKENS)) if layout is not None else jax.device_put(batch)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(to_host(metrics["loss"])))
    return state, losses, step, batch


@needs8
def test_multidevice_tensor_parallel_trains_like_one_device_with_its_sums_in_float32():
    """tensor=4 with fsdp=2 (sequence parallel) and tensor=2 with data=4: the losses and params of
    one device within bfloat16 rounding; the row-parallel sums in float32, activations gathered in
    bfloat16, the only float32 activation gathers the loss's statistics across the vocabulary."""
    from train.parallel.communication import explain_communication

    one, one_losses, _, _ = _step(None, _gpt())
    for data, fsdp, tensor in [(1, 2, 4), (4, 1, 2)]:
        layout = Layout(make_mesh(data, fsdp, jax.devices()[:8], tensor=tensor), fsdp_min_size=256)
        state, losses, step, batch = _step(layout, _gpt())
        np.testing.assert_allclose(losses, one_losses, rtol=2e-3)
        for a, b in zip(jax.tree_util.tree_leaves(to_host(state.params)), jax.tree_util.tree_leaves(to_host(one.params))):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=3e-3)
        kernel = state.params["block_0"]["Dense_0"]["kernel"]
        assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp" if fsdp > 1 else None, "tensor")
    report = explain_communication(step, state, batch)
    rows = [c for c in report.collectives if c.carries == "activations" and c.group == tensor]
    row_parallel = [c for c in rows if c.kind == "all-reduce" and "split_sums:forward" in c.op_name]
    assert len(row_parallel) == 2 and {c.dtype for c in row_parallel} == {"f32"}  # attention's and the MLP's
    gathers = [c for c in rows if c.kind == "all-gather"]
    assert {c.dtype for c in gathers if "cross_entropy" not in c.op_name} == {"bf16"}
    half = Layout(layout.mesh, fsdp_min_size=256, tensor_reduce_dtype="bf16")  # half the bytes, the user's choice
    state = create_train_state(_gpt(), "mixed_bf16", optax.sgd(0.3), jax.random.key(0), TOKENS[:1], layout=half)
    report = explain_communication(make_train_step(task="lm", layout=half, donate=False), state, batch)
    sums = [c for c in report.collectives if c.kind == "all-reduce" and "split_sums:forward" in c.op_name
            and c.group == 2]  # across tensor (a weight gradient is summed across data, in float32)
    assert len(sums) >= 2 and {c.dtype for c in sums} == {"bf16"}  # attention's and the MLP's (and their gradients)


@needs8
def test_multidevice_checkpoints_move_between_tensor_and_fsdp_layouts_bit_for_bit(tmp_path):
    """Saved under fsdp=2 tensor=4 (the fused q/k/v kernel stored in the model's own order), resumed
    under fsdp=8, saved again and resumed under fsdp=2 tensor=4: the same arrays, bit for bit, each
    time in the layout resuming asks for."""
    from helpers import assert_bitwise_equal
    from train import Checkpointer

    tensor = Layout(make_mesh(1, 2, jax.devices()[:8], tensor=4), fsdp_min_size=256)
    fsdp = Layout(make_mesh(1, 8, jax.devices()[:8]), fsdp_min_size=256)
    saved, _, _, _ = _step(tensor, _gpt(), steps=2)
    kernel = ("block_0", "attn", "qkv", "kernel")
    for i, (source, target) in enumerate([(saved, fsdp), (None, tensor)]):
        ckpt = Checkpointer(tmp_path / f"ckpt{i}")
        ckpt.save(source if source is not None else restored, {"data_position": 2})
        ckpt.wait()
        template = create_train_state(_gpt(), "mixed_bf16", optax.sgd(0.3), jax.random.key(1), TOKENS[:1],
                                      layout=target)
        restored, _ = ckpt.restore(template)
        ckpt.close()
        assert_bitwise_equal(jax.tree_util.tree_leaves(to_host(restored.params)),
                             jax.tree_util.tree_leaves(to_host(saved.params)))
        assert_bitwise_equal(jax.tree_util.tree_leaves(to_host(restored.opt_state)),
                             jax.tree_util.tree_leaves(to_host(saved.opt_state)))
        spec = restored.params[kernel[0]][kernel[1]][kernel[2]][kernel[3]].sharding.spec
        assert spec == (jax.sharding.PartitionSpec(None, "fsdp") if target is fsdp else
                        jax.sharding.PartitionSpec("fsdp", "tensor"))
    step = make_train_step(task="lm", layout=tensor, donate=False)  # and it trains on from there
    batch = tensor.global_batch({"inputs": TOKENS, "labels": np.roll(TOKENS, -1, axis=1)}, len(TOKENS))
    assert np.isfinite(float(to_host(step(restored, batch)[1]["loss"])))


@needs8
def test_multidevice_explain_prints_the_mesh_each_params_layout_and_the_collectives_per_layer(capsys):
    from docs_pages import ROOT
    from train.cli import main

    config = str(ROOT / "examples" / "user_models" / "hf_style.yaml")
    assert main([config, "mesh.tensor=4", "mesh.fsdp=2", "workdir=/tmp/unused", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "Mesh data=1 fsdp=2 tensor=4 over 8 devices: no axis crosses hosts" in out
    assert "  h_0_attn/c_attn/kernel [64, 192]: column (3 fused parts), dim 1 split in h_0_attn/c_attn" in out
    assert "  wpe/embedding [32, 64]: whole (looked up at fixed positions in wpe)" in out
    layers = out.split("Collectives per layer")[1]
    assert any(line.split()[:1] == ["h_*_c_proj"] and "activations all-reduce      f32" in line
               for line in layers.splitlines())  # the row-parallel sums, in float32
