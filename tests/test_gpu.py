"""Checks that only mean something on a GPU: half-precision matmuls really run
in half (and are accurate to half precision), and cuDNN attention in bfloat16
agrees with XLA's. Marked ``gpu``: skipped, with the reason, unless JAX's
default backend is a GPU (``JAX_PLATFORMS=cuda python -m pytest -m gpu``).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision
from benchmarks import hlo

pytestmark = pytest.mark.gpu

HALF = [pytest.param(jnp.float16, "f16", id="f16"), pytest.param(jnp.bfloat16, "bf16", id="bf16")]


def _normal(seed, shape):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _compute_capability() -> float:
    return float(getattr(jax.devices()[0], "compute_capability", "0") or 0)


def _skip_bf16_before_ampere(name):
    if name == "bf16" and _compute_capability() < 8.0:
        pytest.skip(f"bfloat16 tensor-core matmuls need compute capability >= 8.0, this GPU has "
                    f"{_compute_capability()}")


@pytest.mark.parametrize("dtype,name", HALF)
def test_half_matmul_under_a_policy_is_accurate_to_half_precision(dtype, name):
    _skip_bf16_before_ampere(name)
    policy = precision.get_policy(f"p=f32,c={name},o=f32")
    x, w = _normal(0, (256, 1024)), _normal(1, (1024, 128))
    half = jax.jit(lambda x, w: policy.cast_to_output(jnp.dot(*policy.cast_to_compute((x, w)))))
    lowered = half.lower(x, w)
    assert f"{name}[256,1024]" in lowered.as_text(dialect="hlo")
    out = np.asarray(half(x, w), np.float64)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # Rounding x and w to half (u = eps/2 each), the f32 accumulation and the
    # rounding of the result: |error| <= ~3u * sum |x||w|; 2 eps leaves room.
    bound = 2 * float(jnp.finfo(dtype).eps) * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)))
    err = np.abs(out - ref)
    assert np.all(err <= bound), f"max error / bound = {np.max(err / bound):.2f}"
    assert np.max(err) > 0, "identical to the float64 reference: the matmul did not run in half precision"


@pytest.mark.parametrize("dtype,name", HALF)
def test_with_policy_dense_compiles_to_half_precision_gpu_matmuls(dtype, name):
    _skip_bf16_before_ampere(name)
    model = precision.with_policy(nn.Dense(256), f"p=f32,c={name},o=f32")
    x = _normal(2, (128, 512))
    variables = model.init(jax.random.PRNGKey(0), x)
    assert jax.tree_util.tree_leaves(variables)[0].dtype == jnp.float32  # f32 master params
    compiled = jax.jit(model.apply).lower(variables, x).compile()
    flops = hlo.matmul_flops(compiled.as_text())
    assert flops.total >= 2 * 128 * 512 * 256, compiled.as_text()[:4000]
    assert flops.by_dtype.get(name, 0) == flops.total, flops  # every matmul FLOP in half: the GPU keeps it
    out = jax.jit(model.apply)(variables, x)
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_attention_in_bf16_matches_xla(causal):
    if _compute_capability() < 8.0:
        pytest.skip(f"cuDNN fused attention needs compute capability >= 8.0, this GPU has {_compute_capability()}")
    batch, length, heads, head_dim = 2, 256, 4, 64
    q, k, v = (_normal(i, (batch, length, heads, head_dim)).astype(jnp.bfloat16) for i in (3, 4, 5))

    def attention(implementation):
        return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                    implementation=implementation))

    cudnn = attention("cudnn")
    assert "__cudnn" in cudnn.lower(q, k, v).compile().as_text()  # a cuDNN call or fusion, not XLA's softmax
    got, want = cudnn(q, k, v), attention("xla")(q, k, v)
    assert got.dtype == want.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # Both in bf16 (eps 2**-7); outputs are averages of v (|v| ~ 1), so a few bf16 ulps.
    np.testing.assert_allclose(got, want, atol=4 * 2.0 ** -7, rtol=2 * 2.0 ** -7)
    np.testing.assert_allclose(got.mean(), want.mean(), atol=1e-3)


def test_the_gpt_under_mixed_bf16_trains_with_cudnn_attention():
    """Autocast traces the GPT in float32; its attention must still reach cuDNN,
    forward and backward (``precision.fused_attention``)."""
    if _compute_capability() < 8.0:
        pytest.skip(f"cuDNN fused attention needs compute capability >= 8.0, this GPU has {_compute_capability()}")
    from train.models import GPT

    gpt = GPT(vocab_size=64, block_size=128, num_layers=2, num_heads=4, d_model=256)
    tokens = jnp.arange(4 * 128).reshape(4, 128) % 64
    model = precision.with_policy(gpt, "mixed_bf16")
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]

    def loss(p):
        return model.apply({"params": p}, tokens).astype(jnp.float32).mean()

    text = jax.jit(jax.value_and_grad(loss)).lower(params).compile().as_text()
    assert "__cudnn" in text, "no cuDNN attention in the compiled step"  # a cuDNN call or fusion
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert np.isfinite(float(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
