"""What crosses the wire between devices: FSDP gathers each param in the dtype
the model reads it in, and :func:`train.explain_communication` reports a step's
collectives. The ``test_multidevice_*`` tests run in test_distributed's 8-device
subprocess."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn, nnx

import precision
from train import create_train_state, explain_communication, make_train_step
from train.parallel.communication import Collective, hlo_collectives
from train.data import load_synthetic
from precision.autocast.scaled.fp8_matmul import rowwise_dot, scaled_dot
from train.parallel.distributed import Layout, make_mesh, to_host
from helpers import assert_bitwise_equal
from train.models import MLP

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: runs in the 8-device subprocess")
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)


# ----------------------------------------------------------------------------- read_dtypes


def test_read_dtypes_half_only_where_every_read_is_a_half_cast():
    def fn(t):
        a = jnp.reshape(t["matmul"], (4, 2)).T.astype(jnp.bfloat16)  # moved, then cast
        b = t["norm"] * 2.0  # read in float32
        c = jnp.concatenate([t["both"].astype(jnp.bfloat16).astype(jnp.float32), t["both"]])  # read both ways
        d = jax.jit(lambda x: x.astype(jnp.float16))(t["in_jit"])
        e = jax.lax.cond(True, lambda x: x.astype(jnp.bfloat16), lambda x: -x.astype(jnp.bfloat16), t["in_cond"])
        lookup = jax.jit(lambda x: jnp.take(x, jnp.arange(4), axis=0))  # rows moved out of a jit, cast after
        f = lookup(t["looked_up"]).astype(jnp.bfloat16) + lookup(t["looked_up_f32"]) * 2.0
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + f.sum(), t["returned"]

    names = ("matmul", "norm", "both", "in_jit", "in_cond", "looked_up", "looked_up_f32", "returned")
    got = precision.read_dtypes(fn, {k: jnp.ones((8,)) for k in names})
    assert got == {"matmul": BF16, "norm": F32, "both": F32, "in_jit": np.dtype(np.float16), "in_cond": BF16,
                   "looked_up": BF16, "looked_up_f32": F32, "returned": F32}


def test_read_dtypes_follow_scanned_layers_and_leave_while_loops_alone():
    stacked = jnp.ones((3, 4, 4))

    def scanned(w):
        return jax.lax.scan(lambda x, wi: (x @ wi.astype(jnp.bfloat16), None), jnp.ones((2, 4), jnp.bfloat16), w)[0]

    def looped(w):
        return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w[0].astype(jnp.bfloat16)),
                                  (0, jnp.ones((2, 4), jnp.bfloat16)))[1]

    assert precision.read_dtypes(scanned, stacked) == BF16
    assert precision.read_dtypes(looped, stacked) == F32  # not followed: read as stored (safe)


def test_read_dtypes_e4m3_only_where_an_fp8_matmul_quantizes_the_whole_param():
    """Issue 42 (6): what FSDP may gather in FP8 (a part, a scanned layer's slice, has a scale of its own)."""
    dims = (((1,), (0,)), ((), ()))
    x, stacked = jnp.ones((2, 4), jnp.bfloat16), jnp.ones((3, 4, 4))

    def fn(t):
        whole = scaled_dot(x, t["w"].T.reshape(4, 4), dims, jnp.bfloat16)  # moved whole, then quantized
        part = scaled_dot(x, t["sliced"][:4], dims, jnp.bfloat16)
        scanned = jax.lax.scan(lambda h, wi: (scaled_dot(h, wi, dims, jnp.bfloat16), None), x, t["stacked"])[0]
        rowwise = rowwise_dot(x, t["rowwise"], dims, jnp.bfloat16)  # scaled along each product's axes
        return whole.sum() + part.sum() + scanned.sum() + rowwise.sum()

    got = precision.read_dtypes(fn, {"w": jnp.ones((4, 4)), "sliced": jnp.ones((8, 4)), "stacked": stacked,
                                     "rowwise": jnp.ones((4, 4))})
    assert got == {"w": np.dtype(jnp.float8_e4m3fn), "sliced": F32, "stacked": F32, "rowwise": F32}


def test_read_dtypes_of_a_model_under_a_policy_and_a_rule():
    """Dense params are read in bfloat16; LayerNorm's and a rule-kept module's in float32."""
    model = precision.with_policy(MLP(hidden=(32, 32), num_classes=4), "mixed_bf16",
                                  rules=[*precision.default_rules(), ("Dense_1", "f32")])
    x = jnp.ones((2, 16))
    variables = model.init(jax.random.PRNGKey(0), x)
    got = precision.read_dtypes(lambda p: model.apply({"params": p}, x), variables["params"])
    assert got["Dense_0"] == {"kernel": BF16, "bias": BF16} and got["Dense_2"]["kernel"] == BF16
    assert got["Dense_1"] == {"kernel": F32, "bias": F32}
    assert set(jax.tree_util.tree_leaves(got["LayerNorm_0"])) == {F32}


# ----------------------------------------------------------------------------- reading HLO

HLO = """
  %all-gather.1 = bf16[64,256]{1,0} all-gather(%b.1), channel_id=2, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={1}, use_global_device_ids=true, metadata={op_name="jit(train_step)/jvp()/gather_params/sharding_constraint"}
  %all-reduce.2 = (f32[], bf16[16,4]{1,0}) all-reduce(%a, %b), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="jit(train_step)/transpose(jvp(MLP))/dot_general"}
  %reduce-scatter.3 = f32[8,16]{1,0} reduce-scatter(%g), channel_id=4, replica_groups=[2,4]<=[8], dimensions={1}, to_apply=%add, metadata={op_name="jit(train_step)/transpose(jvp(MLP))/dot_general"}
  %all-reduce.4 = f32[32]{0} all-reduce(%s), channel_id=5, replica_groups=[1,8]<=[8], to_apply=%add, metadata={op_name="jit(train_step)/BatchNorm/reduce_sum"}
"""


def test_hlo_collectives_reads_kind_dtype_group_and_what_they_carry():
    got = hlo_collectives(HLO, device_count=8)
    assert [(c.kind, c.dtype, c.shape, c.group, c.carries) for c in got] == [
        ("all-gather", "bf16", (64, 256), 4, "params"),
        ("all-reduce", "f32", (), 8, "scalars"),
        ("all-reduce", "bf16", (16, 4), 8, "gradients"),
        ("reduce-scatter", "f32", (8, 64), 4, "gradients"),  # the whole array it scatters from
        ("all-reduce", "f32", (32,), 8, "activations"),
    ]
    gather = got[0]
    assert gather.bytes == 64 * 256 * 2 and gather.sent_bytes == pytest.approx(gather.bytes * 3 / 4)
    assert got[2].sent_bytes == pytest.approx(2 * 7 / 8 * 16 * 4 * 2)  # ring all-reduce: twice (n-1)/n
    assert Collective("all-gather", "f32", (4,), 1, "params", "").sent_bytes == 0


SLICED = """
  %all-reduce.5 = f32[64,16]{1,0} all-reduce(%dot.1), channel_id=6, replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="jit(train_step)/transpose(jvp(MLP))/dot_general"}
  %transpose.6 = f32[16,64]{0,1} transpose(%all-reduce.5), dimensions={1,0}
  %dynamic-slice.7 = f32[16,16]{0,1} dynamic-slice(%transpose.6, %c0, %offset), dynamic_slice_sizes={16,16}
  %all-reduce.8 = f32[64]{0} all-reduce(%r), channel_id=7, replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="jit(train_step)/transpose(jvp(MLP))/reduce_sum"}
  %dynamic-slice.9 = f32[16]{0} dynamic-slice(%all-reduce.8, %offset), dynamic_slice_sizes={16}
  %multiply.10 = f32[64]{0} multiply(%all-reduce.8, %all-reduce.8)
"""


def test_an_all_reduce_sliced_to_each_devices_part_is_counted_as_a_reduce_scatter_would_send():
    """An all-reduce whose every use keeps 1/k of it (through moves) is a reduce-scatter done
    the long way: ``parts`` says so, and ``scattered_sent_bytes`` is what a reduce-scatter
    sends (half the all-reduce's ring bytes); one with any other use is left as it is."""
    sliced, kept = hlo_collectives(SLICED, device_count=8)
    assert (sliced.parts, kept.parts) == (4, 1) and sliced.group == 4
    assert sliced.scattered_sent_bytes == pytest.approx(sliced.sent_bytes / 2) == pytest.approx(64 * 16 * 4 * 3 / 4)
    assert kept.scattered_sent_bytes == kept.sent_bytes
    # over data x fsdp (8 devices, each keeping a quarter): scatter over 8, then gather each quarter over 2
    both = Collective("all-reduce", "f32", (64, 16), 8, "gradients", "", parts=4)
    assert both.scattered_sent_bytes == pytest.approx(both.bytes * (7 / 8 + 1 / 4 * 1 / 2))


def test_a_step_on_one_device_sends_nothing():
    data = load_synthetic(num_train=64, num_test=8, input_shape=(16,), num_classes=4, seed=0)
    state = create_train_state(MLP(hidden=(32,), num_classes=4), "mixed_bf16", optax.sgd(0.1), jax.random.PRNGKey(0),
                               data.sample_input(1))
    report = explain_communication(make_train_step(donate=False), state, jax.device_put(data.train_batch(0, 8, 0)))
    assert report.collectives == () and "none" in str(report)
    with pytest.raises(ValueError, match="stage must be"):
        explain_communication(make_train_step(donate=False), state, data.train_batch(0, 8, 0), stage="final")


# ----------------------------------------------------------------------------- 8 devices

DATA = load_synthetic(num_train=256, num_test=32, input_shape=(16,), num_classes=4, seed=0)


def _report(model, policy, data=2, fsdp=4, rules=None, stage="partitioned", reduce_dtype="auto", fp8=None):
    layout = Layout(make_mesh(data, fsdp, jax.devices()[:data * fsdp]), fsdp_min_size=256)
    state = create_train_state(model, policy, optax.adam(1e-2), jax.random.PRNGKey(0), DATA.sample_input(1),
                               layout=layout, rules=rules, reduce_dtype=reduce_dtype, fp8=fp8)
    batch = layout.global_batch(DATA.train_batch(0, 32, seed=0), 32)
    return explain_communication(make_train_step(layout=layout, donate=False), state, batch, stage=stage)


@needs8
def test_multidevice_fsdp_gathers_params_in_the_compute_dtype(policy="mixed_bf16", half="bf16"):
    """(float16: the CLI test below, on the default experiment's mixed_f16.)"""
    mlp = MLP(hidden=(64, 64), num_classes=4)
    full, mixed = _report(mlp, "fp32"), _report(mlp, policy)
    gathers = mixed.select("params", "all-gather")
    assert len(gathers) == len(full.select("params", "all-gather")) == 3  # the three kernels
    assert {c.dtype for c in gathers} == {half}
    assert mixed.bytes("params") <= 0.5 * full.bytes("params")
    assert mixed.select("gradients") and mixed.select("scalars")  # gradients reduced; loss, norm, finiteness
    assert "params" in str(mixed) and half in str(mixed)
    # each split kernel's gradient: reduced whole, then each device keeps its quarter
    sliced = [c for c in mixed.select("gradients") if c.parts > 1]
    assert len(sliced) == 3 and {c.parts for c in sliced} == {4} and "as reduce-scatters" in str(mixed)
    assert mixed.scattered_sent_bytes("gradients") < mixed.sent_bytes("gradients")


@needs8
def test_multidevice_fsdp_gathers_fp8_read_params_in_one_byte_and_computes_the_same(monkeypatch):
    """Issue 42 (6): a param only an FP8 matmul reads (per tensor, current scaling) is quantized
    on its shard with the whole array's scale and gathered in E4M3: a quarter of fp32's
    bytes, and the step computes bit for bit what it computes gathering float32."""
    import train.training.step

    mlp = MLP(hidden=(64, 64), num_classes=4)
    fp8 = _report(mlp, "mixed_fp8", fp8={"min_size": 0})
    gathers = fp8.select("params", "all-gather")
    assert len(gathers) == 3 and {c.dtype for c in gathers} == {"f8e4m3fn"}  # the three kernels
    assert fp8.bytes("params") <= 0.3 * sum(4 * np.prod(c.shape) for c in gathers)  # as fp32 gathers them

    def step_once():
        layout = Layout(make_mesh(2, 4, jax.devices()[:8]), fsdp_min_size=256)
        state = create_train_state(mlp, "mixed_fp8", optax.adam(1e-2), jax.random.PRNGKey(0), DATA.sample_input(1),
                                   layout=layout, fp8={"min_size": 0})
        batch = layout.global_batch(DATA.train_batch(0, 32, seed=0), 32)
        return to_host(make_train_step(layout=layout, donate=False)(state, batch))

    gathered_fp8 = step_once()
    monkeypatch.setattr(train.training.step, "_gather_dtypes", lambda forward, params, layout: None)  # as stored
    assert_bitwise_equal(jax.tree_util.tree_leaves(gathered_fp8), jax.tree_util.tree_leaves(step_once()))


@needs8
def test_multidevice_a_rule_kept_float32_module_gathers_float32():
    report = _report(MLP(hidden=(64, 64), num_classes=4), "mixed_bf16",
                     rules=[*precision.default_rules(), ("Dense_1", "f32")])
    by_shape = {c.shape: c.dtype for c in report.select("params", "all-gather")}
    assert by_shape == {(16, 64): "bf16", (64, 64): "f32", (64, 4): "bf16"}


class _NNXNet(nnx.Module):
    """A user's NNX model, its float32 dtypes pinned."""

    def __init__(self, *, rngs):
        self.l1 = nnx.Linear(16, 64, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.l2 = nnx.Linear(64, 4, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.norm(self.l1(x))))


@needs8
def test_multidevice_an_nnx_model_gathers_in_bfloat16_and_the_cpu_backend_widens():
    report = _report(_NNXNet(rngs=nnx.Rngs(0)), "mixed_bf16")
    assert {c.dtype for c in report.select("params", "all-gather")} == {"bf16"}
    if jax.default_backend() == "cpu":  # XLA's CPU backend has no 16-bit collectives
        compiled = _report(_NNXNet(rngs=nnx.Rngs(0)), "mixed_bf16", stage="compiled")
        assert compiled.stage == "compiled" and {c.dtype for c in compiled.select("params")} == {"f32"}
        assert "widens" in str(compiled)


@needs8
def test_multidevice_explain_lists_the_collectives_of_the_experiments_step(capsys):
    from train.cli import main

    assert main(["configs/default.yaml", "mesh.fsdp=4", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "Collectives per step (partitioned program" in out
    assert any(line.split()[:3] == ["params", "all-gather", "f16"] for line in out.splitlines())  # mixed_f16


class _TokenNet(nn.Module):
    """Embedding, a biased Dense and a LayerNorm: every way a param's gradient is a sum over the batch."""

    @nn.compact
    def __call__(self, x):
        h = nn.Embed(32, 16)((jnp.abs(x[:, :8]) * 10).astype(jnp.int32))  # (batch, 8 tokens, 16)
        h = h + nn.Embed(8, 16, name="positions")(jnp.arange(8))[None]  # the same rows for every example
        h = nn.LayerNorm()(nn.Dense(32)(h))
        return nn.Dense(4)(h.mean(axis=1))


@needs8
def test_multidevice_gradients_are_reduced_in_the_reduce_dtype():
    """auto: float32 on a mesh (as fp32 sends); bf16: every gradient reduction in bfloat16, at
    half fp32's bytes, the LayerNorm's float32 params included; FSDP too."""
    net = _TokenNet()
    full = _report(net, "fp32", 8, 1)
    auto = _report(net, "mixed_bf16", 8, 1)
    half = _report(net, "mixed_bf16", 8, 1, reduce_dtype="bf16")
    assert len(auto.select("gradients")) == len(full.select("gradients")) >= 7
    assert {c.dtype for c in auto.select("gradients")} == {"f32"}  # the position table's too
    assert all(c.parts == 1 for c in full.select("gradients"))  # data parallel: every device keeps all
    assert auto.bytes("gradients") == full.bytes("gradients")
    assert {c.dtype for c in half.select("gradients")} == {"bf16"}
    assert half.bytes("gradients") <= 0.5 * full.bytes("gradients")
    wrapped = precision.with_policy(_TokenNet(), "mixed_bf16", reduce_dtype="bf16")  # "auto" keeps its own
    layout = Layout(make_mesh(8, 1, jax.devices()[:8]))
    assert create_train_state(wrapped, None, optax.sgd(0.1), jax.random.PRNGKey(0), DATA.sample_input(1),
                              layout=layout).model.reduce_dtype == BF16
    sharded = _report(net, "mixed_bf16", 2, 4, reduce_dtype="bf16")
    assert {c.dtype for c in sharded.select("gradients")} == {"bf16"}
    assert {c.dtype for c in sharded.select("params", "all-gather")} == {"bf16"}


@needs8
def test_multidevice_a_step_made_without_the_layout_runs_the_state_in_its_own():
    """Issue 39 (1): ``make_train_step()`` without ``layout=`` on a state created in one took no
    layout, and XLA gathered activations across devices (132 MiB per device at batch 64
    instead of 13). It now runs the state's; a state split over devices with no layout known
    is refused with one line naming ``layout=``."""
    from train.models import GPT

    layout = Layout(make_mesh(2, 4, jax.devices()[:8]))
    tokens = np.random.default_rng(0).integers(0, 64, (64, 32), dtype=np.int32)
    model = GPT(vocab_size=64, block_size=32, num_layers=2, num_heads=4, d_model=256)
    state = create_train_state(model, "mixed_bf16", optax.adam(1e-3), jax.random.PRNGKey(0), tokens[:1],
                               layout=layout)
    batch = layout.global_batch({"inputs": tokens, "labels": tokens}, 64)
    with_layout = explain_communication(make_train_step(layout=layout, donate=False, task="language_model"),
                                        state, batch)
    without = explain_communication(make_train_step(donate=False, task="language_model"), state, batch)
    assert without.sent_bytes() == with_layout.sent_bytes() < 20 * 2 ** 20
    assert not without.select("activations", "all-gather") or without.bytes("activations") < 2 ** 20
    placed = layout.put_state(create_train_state(model, "mixed_bf16", optax.adam(1e-3), jax.random.PRNGKey(0),
                                                 tokens[:1]))
    with pytest.raises(ValueError, match=r"split over a mesh \{'data': 2, 'fsdp': 4, 'tensor': 1\}.*make_train_step\(layout="):
        make_train_step(donate=False, task="language_model")(placed, batch)
    other = Layout(make_mesh(8, 1, jax.devices()[:8]))
    with pytest.raises(ValueError, match="not the layout the state was created in"):
        make_train_step(layout=other, donate=False, task="language_model")(state, batch)


def test_an_all_gather_of_a_step_argument_carries_params_whatever_its_metadata_names():
    """XLA may label FSDP's gather with the op that uses the param rather than the gather
    scope (jax 0.11's float32 and uint8 gathers): a gather of an entry parameter is still a
    param's; one of a computed value, or of a loop body's parameter, is not."""
    from train.parallel.communication import hlo_collectives

    text = """HloModule m

%body (p: f32[4]) -> f32[16] {
  %p = f32[4]{0} parameter(0)
  ROOT %g = f32[16]{0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (param.5: f32[16,16], param.6: f32[8,16]) -> f32[64,16] {
  %param.5 = f32[16,16]{1,0} parameter(0), sharding={devices=[4,1]<=[4]}
  %param.6 = f32[8,16]{1,0} parameter(1)
  %all-gather = f32[64,16]{1,0} all-gather(%param.5), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="jit(train_step)/jvp(MLP)/Dense_0/dot_general"}
  %add = f32[8,16]{1,0} add(%param.6, %param.6)
  %all-gather.1 = f32[32,16]{1,0} all-gather(%add), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="jit(train_step)/jvp(MLP)/Dense_0/dot_general"}
  ROOT %all-gather.2 = u8[64,16]{1,0} all-gather(u8[16,16]{1,0} %param.5), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
}
"""
    found = [(c.shape, c.dtype, c.carries) for c in hlo_collectives(text, 4)]
    assert found == [((16,), "f32", "activations"), ((64, 16), "f32", "params"),
                     ((32, 16), "f32", "activations"), ((64, 16), "u8", "params")]


def test_a_scans_whole_operands_are_read_from_its_params_before_and_since_jax_0_11():
    """jax 0.11 replaced a scan's ``num_consts``/``num_carry`` by ``ft_in`` (constants, carry,
    scanned); :func:`precision.read_dtypes` reads either (the CPU suite on jax 0.11 failed here)."""
    from types import SimpleNamespace

    from precision.reads import _scan_unsliced

    eqn = jax.make_jaxpr(lambda w, x: jax.lax.scan(lambda c, y: (c + y * w, c), 0.0, x))(2.0, jnp.ones(3)).eqns[-1]
    assert eqn.primitive.name == "scan"
    expected = 2  # the constant w and the carry
    if "ft_in" in eqn.params:
        assert _scan_unsliced(eqn.params) == expected
    else:
        assert _scan_unsliced(eqn.params) == eqn.params["num_consts"] + eqn.params["num_carry"] == expected
    packed = SimpleNamespace(unpack=lambda: (["w"], ["c"], ["x", "y"]))
    assert _scan_unsliced({"ft_in": packed}) == expected
