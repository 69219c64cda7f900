"""FP8 round two (issue 42): how FP8 products accumulate on a GPU, row-wise scaling,
attention kept out of FP8 by default, and the reader of compiled FP8 GEMMs.

The GPU program is checked as lowered for CUDA (no GPU needed); the H100-compiled
program in tests/test_compile_for.py.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import precision
from precision.autocast import fp8_matmul as f8
from precision.autocast.program import iter_ops
from train.config import load_config
from train.inspections.gpu_kernels import fp8_accumulation

DOT = (((1,), (0,)), ((), ()))


def _dots(platform):
    """The StableHLO ``dot_general`` lines of an FP8 matmul's forward and backward, lowered for ``platform``."""

    def step(x, w):
        return jax.grad(lambda x, w: (f8.scaled_dot(x, w, DOT, jnp.bfloat16).astype(jnp.float32) ** 2).sum(),
                        (0, 1))(x, w)

    text = jax.jit(step).trace(jax.ShapeDtypeStruct((32, 64), jnp.bfloat16),
                               jax.ShapeDtypeStruct((64, 16), jnp.float32)).lower(lowering_platforms=(platform,))
    return [line for line in text.as_text().splitlines() if "stablehlo.dot_general" in line]


def test_on_cuda_backward_fp8_products_accumulate_in_float32_and_the_forward_may_accumulate_fast():
    forward, *backward = _dots("cuda")
    assert len(backward) == 2 and "f8E4M3FN" in forward and all("f8E5M2" in line for line in backward)
    assert "allow_imprecise_accumulation = true" in forward  # ANY_F8_ANY_F8_F32_FAST_ACCUM
    assert all("allow_imprecise_accumulation = false" in line and "accumulation_type = f32" in line
               for line in backward)  # ANY_F8_ANY_F8_F32: never Triton's imprecise f8 GEMM, never fast
    forward, *backward = _dots("cpu")  # XLA:CPU refuses dot algorithms: precisions instead
    assert "algorithm" not in forward + "".join(backward)
    assert "precision = [DEFAULT, DEFAULT]" in forward and all("[HIGHEST, HIGHEST]" in b for b in backward)


def test_the_reader_tells_fast_accumulation_from_float32_the_way_xla_decides():
    f8_ops = ("f8e4m3fn", "f8e4m3fn")
    config = '"precision_config":{{"operand_precision":[{p}]{a}}}'
    fast = config.format(p='"DEFAULT","DEFAULT"', a=',"algorithm":"ALG_DOT_ANY_F8_ANY_F8_F32_FAST_ACCUM"')
    full = config.format(p='"DEFAULT","DEFAULT"', a=',"algorithm":"ALG_DOT_ANY_F8_ANY_F8_F32"')
    assert fp8_accumulation("cublaslt_fp8", f8_ops, fast) == "fast"
    assert fp8_accumulation("cublaslt_fp8", f8_ops, full) == "float32"
    assert fp8_accumulation("cublaslt_fp8", f8_ops, config.format(p='"HIGHEST","HIGHEST"', a="")) == "float32"
    assert fp8_accumulation("cublaslt_fp8", f8_ops, config.format(p='"DEFAULT","DEFAULT"', a="")) == "fast"
    assert fp8_accumulation("triton_gemm", ("f8e5m2", "f8e4m3fn"), "") == "fast"  # Triton never promotes f8
    assert fp8_accumulation("cublaslt", ("bf16", "bf16"), full) == ""


# ----------------------------------------------------------------------------- rowwise scaling


def _rows_of_very_different_sizes(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * 10.0 ** rng.uniform(-6, 0, size=shape[:-1] + (1,))
    return jnp.asarray(x, jnp.float32)


def test_rowwise_scaling_keeps_small_rows_that_one_scale_per_tensor_flushes_to_zero():
    x = _rows_of_very_different_sizes((64, 96))
    w = jnp.asarray(np.random.default_rng(1).normal(size=(96, 32)), jnp.float32)
    row_error = lambda y: np.asarray(jnp.linalg.norm(y - x @ w, axis=1) / jnp.linalg.norm(x @ w, axis=1))  # noqa: E731
    tensorwise = row_error(jax.jit(lambda x, w: f8.scaled_dot(x, w, DOT, jnp.float32))(x, w))
    rowwise = row_error(jax.jit(lambda x, w: f8.rowwise_dot(x, w, DOT, jnp.float32))(x, w))
    assert tensorwise.max() > 0.5  # rows a millionth of the largest fall below E4M3's smallest subnormal
    assert rowwise.max() < 0.1 and np.median(rowwise) < 0.06


@pytest.mark.parametrize("dims,lhs_shape,rhs_shape", [
    (DOT, (48, 40), (40, 24)),
    ((((2,), (1,)), ((0,), (0,))), (3, 16, 40), (3, 40, 8)),  # batched
    ((((0, 2), (3, 0)), ((1,), (1,))), (8, 3, 12), (12, 3, 16, 8)),  # several contracted axes, any layout
])
def test_rowwise_products_and_their_transposes_are_close_to_float32_for_any_dot_general(dims, lhs_shape, rhs_shape):
    x, w = _rows_of_very_different_sizes(lhs_shape, 2), _rows_of_very_different_sizes(rhs_shape, 3)
    ref = lax.dot_general(x, w, dims)
    g = jnp.asarray(np.random.default_rng(4).normal(size=ref.shape), jnp.float32)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    product = jax.jit(lambda x, w: f8.rowwise_dot(x, w, dims, jnp.float32))
    assert rel(product(x, w), ref) < 0.06
    got = jax.jit(jax.grad(lambda x, w: (product(x, w) * g).sum(), (0, 1)))(x, w)
    want = jax.jit(jax.grad(lambda x, w: (lax.dot_general(x, w, dims) * g).sum(), (0, 1)))(x, w)
    assert rel(got[0], want[0]) < 0.12 and rel(got[1], want[1]) < 0.12  # E5M2 gradients: 2 mantissa bits
    bad = x.at[(0,) * x.ndim].set(jnp.inf)
    assert not np.isfinite(np.asarray(product(bad, w))).all()  # a non-finite step stays non-finite


# ----------------------------------------------------------------------------- what autocast puts in FP8


class _AttentionAndExperts(nn.Module):
    """Attention written out (q.k^T, softmax, p.v) beside a mixture of experts whose weights are batched."""

    @nn.compact
    def __call__(self, x):  # (batch, tokens, features)
        q, k, v = (nn.Dense(32, name=n)(x) for n in ("q", "k", "v"))
        p = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(32.0), axis=-1)
        h = jnp.einsum("bts,bsd->btd", p, v)
        experts = self.param("experts", nn.initializers.lecun_normal(), (2, 32, 32))
        routed = jnp.einsum("ebtd,edf->ebtf", jnp.stack([h, h]), experts)  # batched over experts, a param
        return routed.sum(0)


def _fp8_paths(**options):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 32)), jnp.float32)
    explanation = precision.explain(_AttentionAndExperts(), x, policy="mixed_fp8", backward=True,
                                    fp8={"min_size": 0, **options})
    return {m.path: (m.fp8_flops > 0, m.fp8_recipe, m.not_fp8_reason) for m in explanation.modules
            if m.total_flops}, explanation


def test_attention_stays_out_of_fp8_by_default_and_a_batched_weight_does_not():
    paths, explanation = _fp8_paths()
    assert paths["q"][:2] == (True, "current scaling") and paths[""][0]  # the experts' product (a param): fp8
    top = [m for m in explanation.modules if m.path == ""][0]
    assert 0 < top.fp8_flops < top.total_flops and top.not_fp8_reason.startswith("attention stays out of fp8")
    every, _ = _fp8_paths(attention=True, scaling="rowwise")
    assert every[""][:2] == (True, "rowwise scaling") and not every[""][2]  # attention's products too


def test_fp8_options_come_from_the_config_file_and_the_command_line():
    config = load_config("configs/default.yaml", ["precision.policy=mixed_fp8", "precision.fp8.scaling=RowWise",
                                                  "precision.fp8.attention=true"])
    assert config.precision.fp8.options() == precision.fp8_options("rowwise", attention=True)
    from train.config import ConfigError

    with pytest.raises(ConfigError, match="scaling"):
        load_config("configs/default.yaml", ["precision.fp8.scaling=columnwise"])


def test_a_run_with_no_fp8_matmul_names_the_min_size_that_would_take_some():
    from train.models import GPT

    explanation = precision.explain(GPT(vocab_size=65, block_size=32, num_layers=1, num_heads=4, d_model=128),
                                    jnp.zeros((2, 32), jnp.int32), policy="mixed_fp8")
    assert explanation.fp8_share == 0
    hint = re.search(r"min_size=(\d+) would take the largest matmuls", explanation.fp8_coverage)
    assert hint and precision.explain(GPT(vocab_size=65, block_size=32, num_layers=1, num_heads=4, d_model=128),
                                      jnp.zeros((2, 32), jnp.int32), policy="mixed_fp8",
                                      fp8={"min_size": int(hint.group(1))}).fp8_share > 0.5


def test_a_params_fp8_gradient_is_made_in_the_reduce_dtype_a_data_parallel_step_sums_it_in():
    """mixed_fp8 with reduce_dtype bf16: the weight gradient's FP8 product leaves the GEMM in bfloat16
    (what devices sum: half fp32's bytes, benchmarks/results/communication.md), then reaches the
    float32 master."""
    dense = lambda x, w: jnp.tanh(x) @ w  # noqa: E731 - an activation (computed) times a param
    x, w = jnp.ones((32, 64), jnp.float32), jnp.ones((64, 16), jnp.float32)
    out_dtypes = {}
    for reduce in (None, "bf16"):
        fn = precision.autocast(dense, "mixed_fp8", fp8={"min_size": 0}, reduce_dtype=reduce)
        jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: fn(x, w).astype(jnp.float32).sum(), (0, 1)))(x, w)
        backward = [op.eqn for op in iter_ops(jaxpr) if op.primitive == "dot_general"
                    and jnp.float8_e5m2 in (op.eqn.invars[0].aval.dtype, op.eqn.invars[1].aval.dtype)]
        out_dtypes[reduce] = sorted(str(e.outvars[0].aval.dtype) for e in backward)
    assert out_dtypes[None] == ["bfloat16", "float32"]  # the bf16 activation's gradient; the float32 param's
    assert out_dtypes["bf16"] == ["bfloat16", "bfloat16"]  # the param's gradient made in bf16 too

