"""The numerics doctor on planted faults, in models written the usual ways (pinned
dtypes, NNX, scan): it names the module and op, forward or backward, and
recommends only changes it applied and saw work."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision
import train
from helpers import ROOT
from precision import diagnose

X = jax.random.normal(jax.random.key(0), (16, 8)) * 3
Y = jnp.arange(16) % 4


def xent(out):
    return optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), Y).mean()


# ----------------------------------------------------------------------------- (a) one layer past 65504


class Hot(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, dtype=jnp.float32, name="hot")(x) * 30000.0  # pinned float32, as much Flax code is


class HotNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, dtype=jnp.float32, name="inp")(x))
        h = nn.LayerNorm(name="norm")(Hot(name="block")(h))
        return nn.Dense(4, dtype=jnp.float32, name="out")(h)


def test_an_activation_past_float16s_range_is_named_and_its_verified_rule_trains_like_fp32():
    d = diagnose(HotNet(), X, policy="mixed_f16", loss_fn=xent, loss_scale=1024.0)
    assert d.first_nonfinite == {"op": "mul", "path": "block", "pass": "forward"}
    overflow = d.problems[0]
    assert (overflow.kind, overflow.pass_, overflow.path, overflow.op) == ("overflow", "forward", "block", "mul")
    rule = d.recommendations[0]
    assert rule.change == "keep block in float32 (a rule)" and rule.after == "overflow 0%"
    assert rule.yaml.startswith("precision:\n  rules: [[block, f32]")
    assert rule.overrides[0].startswith("precision.rules=[[block, f32]")
    assert "first non-finite value: mul in block (forward)" in str(d)

    def trained(policy, rules=None):
        state = train.create_train_state(HotNet(), policy, optax.adam(1e-3), jax.random.PRNGKey(0), X[:1],
                                         rules=rules, loss_scale="none" if policy == "fp32" else "dynamic")
        step = train.make_train_step()
        for i in range(40):
            state, metrics = step(state, {"inputs": X, "labels": Y})
        return float(metrics["loss"])

    fixed = trained("mixed_f16", [("block", "f32"), *precision.default_rules()])
    assert np.isfinite(fixed) and abs(fixed - trained("fp32")) <= 0.02 * trained("fp32")


class ScannedHot(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="inp")(x)
        h, _ = nn.scan(lambda mdl, h, _: (mdl(h), None), variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3)(Hot(name="blocks"), h, None)
        return nn.Dense(4, name="out")(h)


def test_an_overflow_inside_a_scan_over_layers_is_named():
    d = diagnose(ScannedHot(), X, policy="mixed_f16", loss_fn=xent, verify=False)
    assert d.first_nonfinite == {"op": "mul", "path": "blocks", "pass": "forward"}


def test_a_scan_is_probed_as_a_scan_with_statistics_for_every_iteration_in_order():
    from precision.doctor import probe

    def grow(x):  # x * 100 three times in float16: 3e2, 3e4, then past 65504 in the last iteration
        y, _ = jax.lax.scan(lambda h, _: (h * jnp.float16(100.0), None), x, None, length=3)
        return y

    _, probes, cost = probe.run(grow, (jnp.full((4, 8), 3.0, jnp.float16),))
    muls = [p for p in probes if p.primitive == "mul"]
    assert [float(p.stats["amax"]) for p in muls[:2]] == [300.0, 30000.0] and int(muls[2].stats["inf"]) == 32
    assert [bool(p.stats["inputs_finite"]) for p in muls] == [True, True, True]
    assert cost["segments"] == 1 and cost["compiled"] == 1


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="inp")(x)
        for i in range(6):
            h = h + nn.Dense(16, name=f"block_{i}")(nn.LayerNorm(name=f"norm_{i}")(h))
        return nn.Dense(4, name="out")(h)


def test_the_layers_of_a_stack_share_one_compiled_probe_per_pass_and_each_is_measured():
    d = diagnose(Stack(), X, policy="mixed_f16", loss_fn=xent, loss_scale=1024.0, verify=False)
    cost = d.findings.seconds
    assert cost["segments"] >= 24 and 3 * cost["compiled"] <= cost["segments"], cost  # 6 layers, 2 modules, 2 passes
    assert {m.path for m in d.findings.modules if m.backward} >= {f"block_{i}" for i in range(6)}
    assert cost["peak_bytes"] > 0


# ----------------------------------------------------------------------------- (b) attention logits


class Attention(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.query = nnx.Linear(width, width, rngs=rngs)
        self.key = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        q, k = self.query(x), self.key(x)
        logits = q @ k.swapaxes(-1, -2)  # unscaled: grows with the width
        return jax.nn.softmax(logits) @ x


class AttentionNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, width: int = 256):
        self.attn = Attention(width, rngs)
        self.out = nnx.Linear(width, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.attn(x)).mean(axis=1)


def test_attention_logits_past_float16s_range_name_the_matmul_not_the_softmax():
    x = jax.random.normal(jax.random.key(1), (16, 8, 256)) * 40
    d = diagnose(AttentionNet(nnx.Rngs(0)), x, policy="mixed_f16", loss_fn=xent)
    assert d.first_nonfinite == {"op": "dot_general", "path": "attn", "pass": "forward"}
    assert d.recommendations and d.recommendations[0].after.endswith(" 0%")


# ----------------------------------------------------------------------------- (c) gradients that flush to zero


class Autoencoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.sigmoid(nn.Dense(512, name="decoder")(nn.relu(nn.Dense(32, name="encoder")(x))))


def test_gradients_flushing_without_loss_scaling_get_a_verified_loss_scale():
    pixels = jax.random.uniform(jax.random.key(2), (8192, 512))
    # Half the MSE (a loss term weighted down): at scale 1, the values that flush carry a tenth of the
    # decoder's gradient norm (of the full MSE's, 4% of its values flush but they carry 0.05%: no problem).
    mse = lambda out: 0.5 * jnp.mean((out.astype(jnp.float32) - pixels) ** 2)
    d = diagnose(Autoencoder(), pixels, policy="pure_f16", loss_fn=mse)
    underflow = [p for p in d.problems if p.kind == "underflow" and p.pass_ == "backward"]
    # Measured on the parameter gradients the step applies, against a float32 run: by their norm.
    assert underflow and max(p.share for p in underflow) > 0.05 and "parameter-gradient norm" in underflow[0].detail
    low, high = d.findings.scale_range
    assert 1 < low <= high
    scale = [r for r in d.recommendations if r.change.startswith("loss scale")]
    assert scale and scale[0].yaml.startswith("precision:\n  loss_scale: dynamic\n  initial_scale: ")
    assert scale[0].overrides[0] == "precision.loss_scale=dynamic"
    before, after = (float(s.split()[-1].rstrip("%")) for s in (scale[0].before, scale[0].after))
    assert after < before / 10
    decoder = next(m for m in d.to_dict()["modules"] if (m["path"], m["pass"]) == ("decoder", "backward"))
    at = decoder["underflow_at_loss_scale"]  # per layer, at every loss scale
    assert at["1"] == pytest.approx(decoder["flushed"], rel=0.25) and at["1"] > 10 * at[f"{low:g}"]


# ----------------------------------------------------------------------------- (d) non-finite only in the backward pass


class Length(nn.Module):
    @nn.compact
    def __call__(self, h):
        return jnp.sqrt(jnp.sum(h * h, axis=-1, keepdims=True))  # finite forward; sqrt'(0) = inf backward


class Norms(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="proj")(x)  # an all-zero input row gives a zero row (the bias starts at zero)
        return nn.Dense(2, name="head")(Length(name="length")(h))


def test_a_non_finite_value_made_in_the_backward_pass_is_named_as_backward():
    x = X.at[0].set(0.0)
    d = diagnose(Norms(), x, policy="mixed_bf16", loss_fn=lambda out: jnp.mean(out.astype(jnp.float32) ** 2))
    assert d.first_nonfinite["pass"] == "backward" and d.first_nonfinite["path"] == "length"
    assert d.first_nonfinite["op"] in ("div", "mul")  # sqrt's derivative, 0.5 / sqrt(x), times the cotangent
    assert all(p.pass_ == "backward" for p in d.problems if p.kind in ("overflow", "nonfinite"))
    assert any("non-finite in float32 too" in note for note in d.notes) and not d.recommendations


@jax.custom_vjp
def rectify(x):
    return jnp.maximum(x, 0.0)


def _rectify_fwd(x):
    return rectify(x), x


def _rectify_bwd(x, g):  # a custom op's hand-written backward with a log of 0 in it
    return (g * (x > 0) + 0.0 * jnp.log(jnp.abs(x)),)


rectify.defvjp(_rectify_fwd, _rectify_bwd)


class Rectified(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(Rectifier(name="act")(nn.Dense(8, name="proj")(x)))


class Rectifier(nn.Module):
    def __call__(self, h):
        return rectify(h)


def test_a_log_of_zero_in_a_custom_ops_backward_is_named_as_backward():
    x = X.at[0].set(0.0)
    d = diagnose(Rectified(), x, policy="mixed_f16", loss_fn=lambda out: jnp.mean(out.astype(jnp.float32) ** 2))
    assert d.first_nonfinite == {"op": "log", "path": "act", "pass": "backward"}
    assert "first non-finite value: log in act (backward)" in str(d)


# ----------------------------------------------------------------------------- (e) updates that round away


@pytest.mark.parametrize("policy,fix", [
    ("pure_f16", "float32 master weights"),  # float16 params: stochastic rounding stores bfloat16 only
    ("pure_bf16", "bfloat16 masters with stochastic rounding"),  # no float32 copy needed
    ("p=bf16,c=bf16,o=f32,m=bf16/nearest,s=bf16", "bfloat16 masters with stochastic rounding"),
])
def test_updates_rounding_away_in_half_storage_get_a_verified_remedy(policy, fix):
    d = diagnose(HotNet(), X / 1000, policy=policy, loss_fn=xent, loss_scale=128.0, learning_rate=1e-4)
    rounding = [p for p in d.problems if p.kind == "rounding"]
    assert rounding and rounding[0].pass_ == "update" and rounding[0].share > 0.5, d.problems
    assert "lost to rounding them into a" in rounding[0].detail and "rounded to nearest" in rounding[0].detail
    remedy = [r for r in d.recommendations if r.problem.kind == "rounding"]
    assert remedy and remedy[0].change.startswith(fix) and remedy[0].after == "updates rounding away 0%", remedy
    if fix != "float32 master weights":  # the same policy with bfloat16 masters stochastically rounded
        spec = str(precision.get_policy(policy)).split(",m=")[0] + ",m=bf16/sr" + (",s=bf16" if "s=" in policy else "")
        assert remedy[0].overrides == (f'precision.policy="{spec}"',), remedy[0].overrides


def test_bfloat16_masters_that_keep_their_updates_are_no_rounding_problem():
    """Stochastic rounding and Kahan compensation keep the movement small updates make: the
    update pass measures it (applying them), it does not flag what nearest rounding would lose."""
    for policy in ("lean_bf16", "p=bf16,c=bf16,o=f32,m=bf16/kahan,s=bf16"):
        d = diagnose(HotNet(), X / 1000, policy=policy, loss_fn=xent, loss_scale=128.0, learning_rate=1e-4,
                     verify=False)
        assert not [p for p in d.problems if p.kind == "rounding"], (policy, d.problems)


# ----------------------------------------------------------------------------- healthy


def test_a_healthy_model_says_so_in_one_line():
    from train.models import MLP

    d = diagnose(MLP(hidden=(32,)), X, policy="mixed_bf16", loss_fn=xent)
    assert d.healthy and "\n" not in str(d) and str(d).endswith("below the thresholds")
    assert d.to_dict()["healthy"] and d.to_dict()["problems"] == []


def test_bad_input_gets_a_specific_error():
    from train.models import MLP

    with pytest.raises(precision.PolicyError, match="f17"):
        diagnose(MLP(hidden=(8,)), X, policy="params=f32,compute=f17")
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar .* shape \(16, 10\)"):
        diagnose(MLP(hidden=(8,)), X, policy="mixed_f16", loss_fn=lambda out: out)
    with pytest.raises(TypeError, match="pass policy=..."):
        diagnose(MLP(hidden=(8,)), X)
    with pytest.raises(TypeError, match="expects a Flax Linen or NNX module"):
        diagnose(42, X, policy="mixed_f16")



def test_every_change_the_doctor_can_recommend_loads_as_yaml_and_as_command_line_overrides(tmp_path):
    """The ``yaml`` of a recommendation is a mapping to paste into a config file; its
    ``overrides`` are the command line's key=value: both go through the config loader."""
    import yaml

    from precision.doctor import examine
    from precision.doctor.analysis import Findings, Problem
    from train.config import load_config
    from train.config.files import from_dict

    setting = examine._Setting(precision.get_policy("mixed_f16"), precision.default_rules(), precision.OpLists(),
                               1.0, False)
    overflow = Problem("overflow", "backward", "encoder/block_1/ffn", "tanh", 0.1, "")
    findings = Findings((), (overflow,), None, (2.0 ** 4, 2.0 ** 14), None, 1.0)
    changes = [examine._rule_change(overflow, setting), examine._op_list_change(overflow, setting),
               examine._bf16_change(overflow, setting), examine._scale_change(overflow, setting, findings)]
    assert all(changes) and len(changes) == 4
    base = ROOT / "configs" / "default.yaml"
    raw = yaml.safe_load(base.read_text())
    for change in changes:
        pasted = yaml.safe_load(change.yaml)
        assert list(pasted) == ["precision"], change.yaml
        merged = {**raw, "workdir": str(tmp_path), "precision": {**raw.get("precision", {}), **pasted["precision"]}}
        from_file = from_dict(merged)
        from_command_line = load_config(base, [f"workdir={tmp_path}", *change.overrides])
        assert from_file.precision == from_command_line.precision, change.change
        for key, value in pasted["precision"].items():
            assert getattr(from_file.precision, key) == value


# ----------------------------------------------------------------------------- non-finite values that never reach the loss


class Buckets(nn.Module):
    """T5-style relative-position buckets: ``log`` of distances that include 0 (-inf), discarded by ``where``."""

    @nn.compact
    def __call__(self, x):
        distance = jnp.abs(jnp.arange(x.shape[-1])[:, None] - jnp.arange(x.shape[-1])[None, :]).astype(jnp.float32)
        large = 2.0 + jnp.log(distance / 2.0) / np.log(4.0)  # -inf on the diagonal
        bucket = jnp.where(distance < 2.0, distance, jnp.minimum(large, 3.0))
        bias = self.param("bias", nn.initializers.normal(0.1), (4,))[bucket.astype(jnp.int32)]
        return x + bias.sum(0)


class FeedForward(nn.Module):
    boost: float

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="wo")(x) * self.boost


class BucketsNet(nn.Module):
    boost: float = 1.0

    @nn.compact
    def __call__(self, x):
        h = Buckets(name="relative")(nn.Dense(16, name="inp")(x))
        h = FeedForward(self.boost, name="ffn")(h)
        return nn.Dense(4, name="out")(nn.LayerNorm(name="norm")(h))


def test_an_inf_the_model_discards_with_where_is_a_note_not_a_problem():
    d = diagnose(BucketsNet(), X, policy="mixed_f16", loss_fn=xent, loss_scale=1024.0)
    assert d.healthy and d.first_nonfinite is None and not d.problems, str(d)
    assert any("log in relative (forward)" in n and "discards" in n for n in d.notes), d.notes


def test_a_real_overflow_beside_a_discarded_inf_is_named_and_its_fix_verified():
    d = diagnose(BucketsNet(boost=30000.0), X, policy="mixed_f16", loss_fn=xent, loss_scale=1024.0)
    assert d.first_nonfinite == {"op": "mul", "path": "ffn", "pass": "forward"}, str(d)
    assert (d.problems[0].kind, d.problems[0].path) == ("overflow", "ffn")
    assert d.recommendations, str(d)  # verification is no longer blocked by the discarded log(0)
    assert d.recommendations[0].after.endswith(" 0%")


def test_a_nan_loss_from_finite_outputs_is_a_finding():
    def nan_loss(out):
        return xent(out) * jnp.float32(np.nan)  # a user's loss gone wrong, the model's outputs finite

    d = diagnose(BucketsNet(), X, policy="mixed_bf16", loss_fn=nan_loss)
    assert not d.healthy
    assert any(p.kind == "nonfinite" and p.pass_ == "forward" for p in d.problems), str(d)
    assert "healthy" not in str(d).splitlines()[0]


def test_a_matmuls_float32_result_overflowing_in_its_cast_to_half_names_the_matmul():
    from precision.doctor import probe
    from precision.doctor.analysis import analyze

    w = jnp.full((64, 16), 40.0, jnp.float16)

    def layer(x):  # an accumulator in float32, the narrowing cast to float16 makes the inf
        y = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return y.astype(jnp.float16)

    _, probes, _ = probe.run(layer, (jnp.full((8, 64), 30.0, jnp.float16),))
    findings = analyze(probes, float("nan"), 1.0, None, {}, outputs_finite=False)
    assert findings.first_nonfinite["op"] == "dot_general"
    (overflow,) = [p for p in findings.problems if p.kind == "overflow"]
    assert overflow.op == "dot_general" and "float32 result, cast to float16" in overflow.detail


class HotFeedForward(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="wi")(x) * 3000.0  # fine in float32, and in float16 (< 65504)


class ResidualBlock(nn.Module):
    """T5-style: the residual adds the feed-forward's output to a stream in half precision;
    kept float32 by a rule, the feed-forward's result is cast back to half by this sum."""

    @nn.compact
    def __call__(self, x):
        h = x + HotFeedForward(name="ffn")(x)  # the sum of two large values passes 65504
        return h + HotFeedForward(name="ffn2")(h) * 0.0 + h


class ResidualNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = ResidualBlock(name="block")(nn.Dense(16, name="inp")(x) * 30.0)
        return nn.Dense(4, name="out")(nn.LayerNorm(name="norm")(h))


def test_when_the_smallest_rule_moves_the_overflow_out_the_enclosing_module_is_tried_and_verified():
    d = diagnose(ResidualNet(), X, policy="mixed_f16", loss_fn=xent, loss_scale=1.0)
    assert d.problems and d.problems[0].kind == "overflow", str(d)
    assert d.recommendations, str(d)
    fix = d.recommendations[0]
    assert d.problems[0].path == "block/ffn" and fix.change == "keep block in float32 (a rule)", str(d)


class TinyLossMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, name="layer_0")(x))
        h = nn.relu(nn.Dense(64, name="layer_1")(h))
        return nn.Dense(4, name="layer_2")(h)


def test_gradients_flushed_entirely_are_measured_against_float32_and_the_scale_verified_on_every_layer():
    """Pure float16, a tiny loss: whole layers' gradients flush. A float32 shadow computed from half
    inputs already zero saw 0% there; the float32 run does not. The scale recommended leaves no
    layer above the threshold."""
    def tiny(out):
        return 1e-7 * xent(out)

    d = diagnose(TinyLossMLP(), X, policy="pure_f16", loss_fn=tiny)
    flushed = {p.path: p.share for p in d.problems if p.kind == "underflow" and p.pass_ == "backward"}
    assert len([s for s in flushed.values() if s > 0.5]) >= 2, str(d)
    scale = [r for r in d.recommendations if r.change.startswith("loss scale")]
    assert scale, str(d)
    rescaled = diagnose(TinyLossMLP(), X, policy="pure_f16", loss_fn=tiny,
                        loss_scale=float(scale[0].overrides[1].split("=")[1]))
    assert not [p for p in rescaled.problems if p.kind == "underflow" and p.pass_ == "backward"], str(rescaled)


class SmallBranch(nn.Module):
    """A branch added to the stream at 1e-4 of its size: its input cotangent is tiny (and flushes
    in float16), while its params' gradients, summed over the batch, are well in range."""

    @nn.compact
    def __call__(self, x):
        return x + 1e-4 * nn.Dense(x.shape[-1], name="query")(x)


class StreamNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = SmallBranch(name="attn")(nn.Dense(16, name="inp")(x))
        return nn.Dense(4, name="out")(h)


def test_a_tiny_cotangent_whose_parameter_gradients_are_in_range_is_no_underflow_problem():
    d = diagnose(StreamNet(), X, policy="mixed_f16", loss_fn=xent)
    assert not [p for p in d.problems if p.kind == "underflow"], str(d)


# ----------------------------------------------------------------------------- gradients that are rounding residue


class TimeResBlock(nn.Module):
    """A UNet resnet block's shape (diffusers' FlaxResnetBlock2D): the time embedding's projection is
    added to the features per channel, and a GroupNorm with one channel per group subtracts it straight
    back out. Its true gradient is zero; a float32 run's is rounding residue."""

    @nn.compact
    def __call__(self, x, temb):
        h = nn.Conv(8, (3, 3), name="conv1")(nn.silu(x))
        h = h + nn.Dense(8, name="time_emb_proj")(temb)[:, None, None, :]
        h = nn.GroupNorm(num_groups=8, name="norm2")(h)
        return x + nn.Conv(8, (3, 3), name="conv2")(nn.silu(h))


class TinyUNet(nn.Module):
    @nn.compact
    def __call__(self, inputs):
        x, t = inputs
        h = TimeResBlock(name="resnet")(nn.Conv(8, (3, 3), name="conv_in")(x), t)
        return nn.Conv(3, (3, 3), name="conv_out")(h)


UNET_IN = (jax.random.normal(jax.random.key(1), (2, 8, 8, 3)), jax.random.normal(jax.random.key(2), (2, 16)))
UNET_TARGET = jax.random.normal(jax.random.key(3), (2, 8, 8, 3))


def unet_mse(out):
    return jnp.mean((out.astype(jnp.float32) - UNET_TARGET) ** 2)


def _diagnose_unet(monkeypatch, loss_scale):
    """The diagnosis (unverified) and the per-module parameter-gradient measurement it judged."""
    from precision.doctor import analysis, examine

    measured = {}

    def spy(*args, **kwargs):
        measured.update(analysis.gradient_underflow(*args, **kwargs))
        return measured

    monkeypatch.setattr(examine, "gradient_underflow", spy)
    d = diagnose(TinyUNet(), UNET_IN, policy="mixed_f16", loss_fn=unet_mse, loss_scale=loss_scale, verify=False)
    return d, measured


def test_a_projection_a_per_channel_groupnorm_cancels_is_rounding_residue_not_underflow(monkeypatch):
    """diffusers' UNet under mixed_f16 at scale 32768 had its time_emb_proj reported as underflow (1.48%
    of its values) and bf16 recommended; this smaller model's residue is larger, and flushes at 16."""
    d, measured = _diagnose_unet(monkeypatch, 16.0)
    residue = measured["resnet/time_emb_proj"]
    # Counted, or by their share of its own norm, its values flush past the threshold (what the doctor
    # used to report, with bf16 as the fix) ...
    assert residue.flushed / residue.nonzero > 0.05 and residue.lost / residue.norm > 0.05, residue
    # ... but they are rounding residue, millions of times smaller than the other layers' gradients.
    conv = measured["resnet/conv1"]
    assert residue.norm / residue.size ** 0.5 < 1e-5 * conv.norm / conv.size ** 0.5
    assert not [p for p in d.problems if p.kind == "underflow"], str(d)
    assert d.healthy, str(d)


def test_gradients_that_carry_the_update_flushing_are_still_underflow_and_unverified_says_so(monkeypatch):
    d, measured = _diagnose_unet(monkeypatch, 2.0 ** -20)  # a loss scale far too small: real gradients flush
    underflow = {p.path: p for p in d.problems if p.kind == "underflow" and p.pass_ == "backward"}
    assert {"resnet/conv1", "resnet/conv2"} <= set(underflow), str(d)
    assert "resnet/time_emb_proj" not in underflow, str(d)
    conv = measured["resnet/conv1"]
    assert underflow["resnet/conv1"].share == pytest.approx(conv.lost / conv.norm) and conv.lost / conv.norm > 0.5
    assert "of its parameter-gradient norm in a float32 run" in underflow["resnet/conv1"].detail
    # Nothing was tried (verify=False): the table says so, not that the changes tried failed.
    assert str(d).splitlines()[-1] == "no change tried: verification was off (verify=False)", str(d)
    assert "none of the changes tried" not in str(d)


def test_an_operand_cast_to_half_past_its_range_names_the_convolution_it_feeds():
    """A float32 kernel past 65504, cast to float16 for its convolution: the cast overflows, the
    convolution (what the user wrote) is named, in the first non-finite op and the problem."""
    from precision.doctor import probe
    from precision.doctor.analysis import analyze

    kernel = jnp.full((3, 3, 4, 4), 1e5, jnp.float32)

    def layer(x):  # as autocast computes a float32-param convolution in float16
        return jax.lax.conv_general_dilated(x, kernel.astype(jnp.float16).reshape(3, 3, 4, 4), (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    _, probes, _ = probe.run(layer, (jnp.ones((1, 4, 4, 4), jnp.float16),))
    findings = analyze(probes, float("nan"), 1.0, None, {}, outputs_finite=False)
    assert findings.first_nonfinite["op"] == "conv_general_dilated", findings.first_nonfinite
    assert [p.op for p in findings.problems if p.kind == "overflow"] == ["conv_general_dilated"]
    assert "conv_general_dilated's operand, cast to float16 for it" in findings.problems[0].detail
