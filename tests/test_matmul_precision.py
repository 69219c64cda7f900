"""The precision of float32 matmuls as part of a policy (``matmul=highest``): parsed, printed
and compared with the policy; set by autocast on the float32 dots and convolutions of the
modules whose policy or rule asks for it, never on half ones; reported by explain and by
the H100 program's kernels (docs/matmul-precision.md)."""

import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import lax

import precision
from precision import PolicyError, get_policy
from precision.autocast.program import iter_ops
from precision.rules import get_rules
from train.inspections.gpu_kernels import f32_algorithm, read_kernels, region_of
from helpers import h100_device, needs_cuda_plugin

HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
X = jnp.ones((2, 8))


# ----------------------------------------------------------------------------- the policy


@pytest.mark.parametrize("spec,expected", [
    ("params=f32,compute=bf16,matmul=highest", "p=f32,c=bf16,o=bf16,matmul=highest"),
    ("p=f32, c=f32, MATMUL = High", "p=f32,c=f32,o=f32,matmul=high"),
    ("params=f32,matmul_precision=default", "p=f32,c=f32,o=f32"),
    ("mixed_bf16,matmul=highest", "p=f32,c=bf16,o=f32,matmul=highest"),
    ("f32,matmul=highest", "p=f32,c=f32,o=f32,matmul=highest"),
    ("lean_bf16,matmul=highest", "p=bf16,c=bf16,o=f32,m=bf16/sr,s=bf16,matmul=highest"),
])
def test_a_spec_sets_the_matmul_precision_and_its_string_parses_back(spec, expected):
    policy = get_policy(spec)
    assert str(policy) == expected and repr(policy) == f"Policy({expected!r})"
    assert get_policy(str(policy)) == policy and hash(get_policy(str(policy))) == hash(policy)


def test_default_is_no_setting_and_anything_else_is_another_policy():
    plain = get_policy("mixed_bf16")
    assert plain.matmul_precision == "default" and "matmul" not in str(plain)
    same = get_policy("mixed_bf16,matmul=default")
    assert same == plain and hash(same) == hash(plain)
    highest = get_policy("mixed_bf16,matmul=highest")
    assert highest != plain and len({plain, highest, get_policy("mixed_bf16,matmul=high")}) == 3
    assert precision.Policy("f32", "bf16", "f32", matmul_precision=lax.Precision.HIGHEST) == highest
    assert highest.with_matmul_precision("default") == plain and plain.with_matmul_precision("highest") == highest
    kept = [highest.with_output_dtype("bf16"), highest.with_compute_dtype("f8"),
            highest.with_stored(accum_dtype="bf16")]
    assert {p.matmul_precision for p in kept} == {"highest"}


@pytest.mark.parametrize("make,token,suggestion", [
    (lambda: get_policy("params=f32,matmul=hihgest"), "hihgest", "highest"),
    (lambda: get_policy("mixed_bf16,matmul=tf32"), "tf32", None),
    (lambda: get_policy("params=f32,matmul="), "", None),
    (lambda: precision.Policy("f32", "f32", "f32", matmul_precision="fast"), "fast", None),
    (lambda: precision.with_policy(nn.Dense(2), "mixed_bf16", [("Dense", "f32,matmul=hi")]), "hi", "high"),
])
def test_a_bad_matmul_precision_is_one_line_naming_the_valid_ones(make, token, suggestion):
    with pytest.raises(PolicyError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message and f"unknown matmul precision {token!r}" in message
    assert all(f"{name} (" in message for name in ("default", "high", "highest"))
    assert (f"Did you mean {suggestion!r}" in message) == (suggestion is not None)


def test_a_duplicate_matmul_key_and_a_preset_with_other_keys_are_errors():
    with pytest.raises(PolicyError, match="duplicate key for matmul precision 'matmul' at position 21"):
        get_policy("p=f32,matmul=highest,matmul=high")
    with pytest.raises(PolicyError, match="expected exactly one 'key=dtype'"):
        get_policy("mixed_bf16,compute=f16")


def test_a_preset_followed_by_matmul_keeps_its_rules():
    assert get_rules("O1,matmul=highest") == get_rules("O1") != get_rules("mixed_bf16")
    assert get_rules("O3, matmul=highest") == ()


# ----------------------------------------------------------------------------- autocast


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="ffn")(x)
        x = nn.LayerNorm(name="ln")(x)
        return nn.Dense(4, name="head")(x)


def _dots(jaxpr) -> list[tuple[str, bool, str, object]]:
    """(module, backward, operand dtype, precision) of every dot and convolution of a program."""
    return [("/".join(op.path), op.backward, op.in_dtypes[0].name, op.eqn.params["precision"])
            for op in iter_ops(jaxpr) if op.primitive in ("dot_general", "conv_general_dilated")]


def _linen_dots(module, policy, rules=None, x=X, backward=True) -> list:
    wrapped = precision.with_policy(module, policy, rules)
    variables = wrapped.init(jax.random.key(0), x)
    if not backward:
        return _dots(jax.make_jaxpr(wrapped.apply)(variables, x))
    loss = lambda v: wrapped.apply(v, x).astype(jnp.float32).sum()  # noqa: E731
    return _dots(jax.make_jaxpr(jax.grad(loss))(variables))


def test_a_float32_island_gets_the_policys_highest_and_half_dots_are_left_alone():
    dots = _linen_dots(Block(), "mixed_bf16,matmul=highest", [("LayerNorm", "f32"), ("head", "f32")])
    assert {(m, d, p) for m, _, d, p in dots} == {("ffn", "bfloat16", None), ("head", "float32", HIGHEST)}
    assert sum(b for m, b, _, _ in dots if m == "head") == 2  # its backward dots too
    forward = _linen_dots(Block(), "f32,matmul=highest", backward=False)
    assert [p for _, _, _, p in forward] == [HIGHEST, HIGHEST]


def test_a_rule_sets_it_for_its_module_only():
    dots = _linen_dots(Block(), "f32", [("head", "f32,matmul=highest")])
    assert {(m, p) for m, _, _, p in dots} == {("ffn", None), ("head", HIGHEST)}
    high = _linen_dots(Block(), "mixed_bf16", [("head", "params=f32,matmul=high")], backward=False)
    assert high == [("ffn", False, "bfloat16", None), ("head", False, "float32", (lax.Precision.HIGH,) * 2)]


def test_a_rule_that_does_not_set_it_keeps_the_enclosing_one():
    dots = _linen_dots(Block(), "f32,matmul=highest", [("ffn", "f32"), ("head", "params=f32,matmul=high")])
    assert {(m, p) for m, _, _, p in dots} == {("ffn", HIGHEST), ("head", (lax.Precision.HIGH,) * 2)}


def test_the_default_leaves_the_program_as_it_was():
    """No precision set, no region tag changed: the program of a policy without the field
    (checked against the commit before it on GPTs, ResNets, NNX models and functions)."""
    def lowered(policy):
        wrapped = precision.with_policy(Block(), policy, [("head", "f32"), ("ffn", "params=f32,matmul=default")])
        variables = wrapped.init(jax.random.key(0), X)
        grad = jax.grad(lambda v: wrapped.apply(v, X).astype(jnp.float32).sum())
        program = jax.jit(grad).lower(variables)
        return jax.make_jaxpr(grad)(variables), program.as_text(), program.as_text(debug_info=True)

    for policy in ("mixed_bf16", "fp32", "O1"):
        jaxpr, text, located = lowered(policy)
        assert all(p is None for _, _, _, p in _dots(jaxpr))
        tags = re.findall(r"precision:[\w+@]+", located)
        assert (len(tags) > 0) == (policy != "fp32") and not any("@" in t for t in tags)
        assert text == lowered(policy + ",matmul=default")[1]


def test_an_nnx_model_under_a_rule_gets_it_in_that_module_forward_and_backward():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.ffn, self.head = nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.ffn(x)))

    wrapped = precision.with_policy(Model(nnx.Rngs(0)), "mixed_bf16", [("head", "f32,matmul=highest")])
    graphdef, state = nnx.split(wrapped)
    grad = jax.grad(lambda s: nnx.merge(graphdef, s)(X).astype(jnp.float32).sum())
    dots = _dots(jax.make_jaxpr(grad)(state))
    assert {(m, d, p) for m, _, d, p in dots} == {("ffn", "bfloat16", None), ("head", "float32", HIGHEST)}
    assert sum(b for m, b, _, _ in dots if m == "head") == 2
    chex.assert_trees_all_close(wrapped(X), precision.with_policy(Model(nnx.Rngs(0)), "mixed_bf16",
                                                                  [("head", "f32")])(X), atol=1e-6)


def test_scanned_rematerialized_layers_and_convolutions_get_it_too():
    from train.models import GPT, ResNet

    gpt = GPT(vocab_size=32, block_size=8, num_layers=2, num_heads=2, d_model=16, scan_layers=True, remat="full")
    dots = _linen_dots(gpt, "f32,matmul=highest", x=jnp.zeros((2, 8), jnp.int32))
    assert dots and all(p == HIGHEST for _, _, _, p in dots)
    convs = [d for d in _linen_dots(ResNet(), "f32,matmul=highest", x=jnp.ones((2, 8, 8, 1)), backward=False)
             if d[3] is not None]
    assert len(convs) == len(_linen_dots(ResNet(), "f32", x=jnp.ones((2, 8, 8, 1)), backward=False))


def test_an_op_that_asks_for_more_keeps_it_and_a_named_algorithm_is_left_alone():
    def f(w, x):
        a = jnp.dot(x, w, precision=lax.Precision.HIGHEST)
        b = jnp.dot(x, w, precision=(lax.Precision.DEFAULT, lax.Precision.HIGHEST))
        c = jnp.dot(x, w, precision=lax.DotAlgorithmPreset.TF32_TF32_F32)
        return a + b + c + x @ w

    w = jnp.ones((8, 8))
    found = [p for *_, p in _dots(jax.make_jaxpr(precision.autocast(f, "f32,matmul=high"))(w, X))]
    high = lax.Precision.HIGH
    assert found == [HIGHEST, (high, lax.Precision.HIGHEST), lax.DotAlgorithmPreset.TF32_TF32_F32, (high, high)]
    with jax.default_matmul_precision("highest"):  # the user's own setting around the trace stays
        assert [p for *_, p in _dots(jax.make_jaxpr(precision.autocast(f, "f32,matmul=high"))(w, X))][-1] == HIGHEST


def test_compute_in_sets_it_for_a_region_of_a_function():
    def f(w, x):
        with precision.compute_in("f32", matmul="highest"):
            y = jnp.tanh(x @ w)
        return y @ w

    dots = _dots(jax.make_jaxpr(precision.autocast(f, "mixed_bf16"))(jnp.ones((8, 8)), X))
    assert [(d, p) for _, _, d, p in dots] == [("float32", HIGHEST), ("bfloat16", None)]


def test_module_casts_only_cannot_set_it_and_say_so():
    with pytest.raises(PolicyError, match="matmul=highest .* needs autocast=True"):
        precision.with_policy(Block(), "mixed_bf16", [("head", "f32,matmul=highest")], autocast=False)
    precision.with_policy(Block(), "mixed_bf16", [("head", "f32")], autocast=False)  # the default needs nothing


# ----------------------------------------------------------------------------- explain


def test_explain_reports_the_precision_of_float32_matmuls_only_when_one_is_asked_for():
    asked = precision.explain(Block(), X, policy="mixed_bf16", rules=[("head", "f32,matmul=highest")])
    assert {m.path: m.f32_precision for m in asked.modules} == {"ffn": "", "head": "highest", "ln": ""}
    assert dict(asked.f32_flops_by_precision) == {"highest": 3 * 2 * 2 * 8 * 4}  # head: forward and 2 backward
    table = str(asked)
    assert "float32 matmul/conv FLOPs by precision: highest 100.0% of 384 FLOP" in table
    assert "f32 matmul precision" in table.splitlines()[3] and table.splitlines()[5].endswith("highest")
    plain = precision.explain(Block(), X, policy="mixed_bf16", rules=[("head", "f32")])
    assert "by precision" not in str(plain) and "matmul precision" not in str(plain)
    assert {m.f32_precision for m in plain.modules} == {""} and dict(plain.f32_flops_by_precision) == {"default": 384}
    assert str(plain) == str(precision.explain(Block(), X, policy="mixed_bf16,matmul=default", rules=[("head", "f32")])
                             ).replace(",matmul=default", "")


# ----------------------------------------------------------------------------- the GPU program


def test_a_float32_gemm_says_what_arithmetic_it_runs():
    triton = lambda rest: f32_algorithm("triton_gemm", ("f32", "f32"), rest)  # noqa: E731
    assert [triton(r) for r in ("lhs_contracting_dims={1}", "operand_precision={high,high}",
                                "operand_precision={highest,highest}", "algorithm=dot_bf16_bf16_f32_x3")] == \
        ["tf32", "f32", "f32", "bf16_3x"]
    cublas = '"precision_config":{"operand_precision":["HIGH","HIGH"],"algorithm":"ALG_UNSET"}'
    assert f32_algorithm("cublaslt", ("f32", "f32"), cublas) == "tf32"
    assert f32_algorithm("cublaslt", ("f32", "f32"), cublas.replace("HIGH", "HIGHEST")) == "f32"
    assert f32_algorithm("xla_dot", ("f32", "f32"), "") == "f32"
    assert f32_algorithm("triton_gemm", ("bf16", "bf16"), "") == "" == f32_algorithm("cudnn_conv", ("f32", "f32"), "")
    assert region_of("jit(f)/precision:float32@highest/head/dot_general") == "float32"


@pytest.mark.gpu_compile
def test_the_h100_program_runs_a_highest_module_in_float32_and_the_rest_as_asked():
    needs_cuda_plugin()
    from train.inspections.hlo_kernels import read_hlo_kernels

    place = functools.partial(lambda s, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              jax.sharding.SingleDeviceSharding(h100_device()))
    x = jnp.ones((256, 512))
    for rule, head in (("f32,matmul=highest", "f32"), ("f32", "tf32")):
        wrapped = precision.with_policy(Block(), "mixed_bf16", [("head", rule)])
        params = jax.eval_shape(lambda: wrapped.init(jax.random.key(0), x))
        grad = jax.jit(jax.grad(lambda v, x: wrapped.apply(v, x).astype(jnp.float32).sum()))
        text = grad.lower(jax.tree_util.tree_map(place, params), place(x)).compile().as_text()
        gemms = {(k.module, k.operands, k.algorithm) for k in read_kernels(text) if k.gemm}
        assert gemms == {("ffn", ("bf16", "bf16"), ""), ("head", ("f32", "f32"), head)}, gemms
        modeled = {(k.module, k.precision) for k in read_hlo_kernels(text) if k.kind == "gemm"}
        assert modeled == {("ffn", ""), ("head", "highest" if head == "f32" else "")}, modeled


@pytest.mark.gpu_compile
def test_compile_for_counts_the_float32_gemms_of_a_config_by_arithmetic(tmp_path):
    needs_cuda_plugin()
    from helpers import ROOT, TINY_TEXT
    from train.config import load_config
    from train.inspections.compile_for import compile_for

    (tmp_path / "plays.txt").write_text(TINY_TEXT * 20)
    overrides = [f"workdir={tmp_path}", f"data.path={tmp_path / 'plays.txt'}", "model.num_layers=1"]
    counts = {}
    for policy in ("fp32", "f32,matmul=highest"):
        report = compile_for(load_config(ROOT / "configs" / "shakespeare_gpt_fp32.yaml",
                                         [*overrides, f"precision.policy={policy}"]), "h100")
        counts[policy] = report.to_json()["f32_gemm_algorithms"]
        (n,) = counts[policy].values()
        assert f"Float32 GEMMs by arithmetic: {n} " in str(report) and n == report.count()
    assert set(counts["fp32"]) == {"tf32"} and set(counts["f32,matmul=highest"]) == {"f32"}
