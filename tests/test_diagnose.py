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
    assert rule.yaml.startswith("precision.rules: [[block, f32]")
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
    mse = lambda out: jnp.mean((out.astype(jnp.float32) - pixels) ** 2)
    d = diagnose(Autoencoder(), pixels, policy="pure_f16", loss_fn=mse)
    underflow = [p for p in d.problems if p.kind == "underflow" and p.pass_ == "backward"]
    assert underflow and max(p.share for p in underflow) > 0.1
    low, high = d.findings.scale_range
    assert 1 < low <= high
    scale = [r for r in d.recommendations if r.change.startswith("loss scale")]
    assert scale and scale[0].yaml.startswith("precision.loss_scale: dynamic, precision.initial_scale: ")
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


@pytest.mark.parametrize("policy", ["pure_f16", "pure_bf16"])
def test_updates_rounding_away_in_half_storage_get_verified_float32_masters(policy):
    d = diagnose(HotNet(), X / 1000, policy=policy, loss_fn=xent, loss_scale=128.0, learning_rate=1e-4)
    rounding = [p for p in d.problems if p.kind == "rounding"]
    assert rounding and rounding[0].pass_ == "update" and rounding[0].share > 0.5
    masters = [r for r in d.recommendations if r.change.startswith("float32 master weights")]
    assert masters and masters[0].after == "updates rounding away 0%"


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

