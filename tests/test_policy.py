"""Policy grammar, presets, casting and errors."""

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import precision
from precision import Policy, PolicyError, get_policy

JMP_KEYS = ["p", "params", "c", "compute", "o", "output"]
JMP_DTYPES = ["bf16", "bfloat16", "f16", "float16", "full", "f32", "float32", "f64", "float64", "half"]


def _dtypes(p):
    return tuple(np.dtype(d) for d in (p.param_dtype, p.compute_dtype, p.output_dtype))


@st.composite
def jmp_specs(draw):
    """Strings in jmp's grammar (without duplicate keys, which we reject on purpose)."""
    if draw(st.booleans()):
        return draw(st.sampled_from(JMP_DTYPES))
    fields = draw(st.lists(st.sampled_from(["p", "c", "o"]), min_size=1, max_size=3, unique=True))
    spellings = {"p": ["p", "params"], "c": ["c", "compute"], "o": ["o", "output"]}
    parts = [f"{draw(st.sampled_from(spellings[f]))}={draw(st.sampled_from(JMP_DTYPES))}" for f in fields]
    return ",".join(parts)


@given(jmp_specs())
def test_every_jmp_spec_gives_jmps_dtypes(spec):
    assert _dtypes(get_policy(spec)) == _dtypes(jmp.get_policy(spec))


@given(jmp_specs(), st.sampled_from(["", " ", "  "]))
def test_whitespace_and_case_are_tolerated(spec, pad):
    padded = pad + spec.replace(",", pad + "," + pad).replace("=", pad + "=" + pad) + pad
    assert get_policy(padded) == get_policy(spec)
    assert get_policy(spec.upper()) == get_policy(spec)


@given(st.text(max_size=30))
def test_any_string_parses_or_raises_policy_error(text):
    try:
        policy = get_policy(text)
    except PolicyError:
        return
    assert isinstance(policy, Policy)


@given(st.sampled_from(["f32", "bf16", "f16", "f64"]), st.sampled_from(["f32", "bf16", "f16", "f64"]),
       st.sampled_from(["f32", "bf16", "f16", "f64"]))
def test_str_round_trips(p, c, o):
    policy = Policy(p, c, o)
    assert get_policy(str(policy)) == policy
    assert hash(get_policy(str(policy))) == hash(policy)


def test_str_prints_the_first_of_dtype_to_names_and_jmp_parses_it():
    from precision.policy import dtype_to_names

    assert str(get_policy("full")) == "p=f32,c=f32,o=f32"  # jmp prints p=full,...: both parse in both
    assert str(get_policy("mixed_bf16")) == "p=f32,c=bf16,o=f32"
    for dtype in (np.float16, jnp.float16, jnp.bfloat16, np.float32, jnp.float32, np.dtype("float64")):
        policy = Policy(dtype, dtype, dtype)
        assert str(policy) == "p={0},c={0},o={0}".format(dtype_to_names[dtype][0])
        assert _dtypes(jmp.get_policy(str(policy))) == _dtypes(policy)
    from jmp._src.policy import dtype_to_names as jmp_names

    assert set(dtype_to_names["float32"]) >= set(jmp_names[jnp.float32])
    with pytest.raises(KeyError):
        dtype_to_names[jnp.int8]


def test_defaults_follow_params_then_compute():
    assert get_policy("c=f16") == Policy("f32", "f16", "f16")
    assert get_policy("p=bf16") == Policy("bf16", "bf16", "bf16")
    assert get_policy("params=f32,compute=f16") == Policy("f32", "f16", "f16")
    assert get_policy("f16") == Policy("f16", "f16", "f16")
    assert get_policy("fp16") == get_policy("float16") == get_policy("f16")
    assert get_policy("fp32") == get_policy("full") == Policy("f32", "f32", "f32")


@pytest.mark.parametrize("name,expected", [
    ("fp32", ("f32", "f32", "f32")),
    ("mixed_bf16", ("f32", "bf16", "f32")), ("mixed_bfloat16", ("f32", "bf16", "f32")),
    ("mixed_f16", ("f32", "f16", "f32")), ("mixed_float16", ("f32", "f16", "f32")),
    ("pure_bf16", ("bf16", "bf16", "bf16")), ("pure_f16", ("f16", "f16", "f16")),
    ("O1", ("f32", "f16", "f32")), ("O2", ("f16", "f16", "f32")), ("O3", ("f16", "f16", "f16")),
    ("o2", ("f16", "f16", "f32")), (" Mixed_BF16 ", ("f32", "bf16", "f32")),
    ("mixed_fp8", ("f32", "f8", "f32")), ("MIXED_FP8", ("f32", "f8/bf16", "f32")),
])
def test_presets(name, expected):
    assert get_policy(name) == Policy(*expected)


def test_the_lean_preset_also_stores_masters_and_optimizer_state_in_bf16():
    assert get_policy("lean_bf16") == Policy("bf16", "bf16", "f32", master_dtype="bf16", master_rounding="sr",
                                             state_dtype="bf16")  # tests/test_stored.py trains both
    assert get_policy("lean_int8") == Policy("bf16", "bf16", "f32", master_dtype="bf16", state_dtype="int8")


def test_every_documented_preset_is_tested():
    assert set(precision.PRESETS) == {"fp32", "mixed_bf16", "mixed_bfloat16", "mixed_f16", "mixed_float16",
                                      "pure_bf16", "pure_f16", "O1", "O2", "O3", "mixed_fp8", "lean_bf16", "lean_int8",
                                      "mixed_int8"}


def test_policy_is_immutable_hashable_and_a_static_jit_argument():
    policy = get_policy("mixed_f16")
    with pytest.raises(Exception):
        policy.param_dtype = np.float16
    assert {policy: 1}[get_policy("p=f32,c=f16,o=f32")] == 1

    f = jax.jit(lambda x, policy: policy.cast_to_compute(x), static_argnums=1)
    assert f(jnp.ones(2), policy).dtype == jnp.float16
    assert f(jnp.ones(2), get_policy("mixed_bf16")).dtype == jnp.bfloat16


class CastTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_only_floating_leaves_are_cast(self):
        policy = get_policy("p=f32,c=bf16,o=f16")
        tree = {"w": jnp.ones(3), "i": jnp.arange(3), "b": jnp.array([True]), "h": jnp.ones(2, jnp.float16)}
        for method, dtype in ((policy.cast_to_param, jnp.float32), (policy.cast_to_compute, jnp.bfloat16),
                              (policy.cast_to_output, jnp.float16)):
            out = self.variant(method)(tree)
            assert out["w"].dtype == dtype and out["h"].dtype == dtype
            assert out["i"].dtype == jnp.int32 and out["b"].dtype == jnp.bool_
            chex.assert_trees_all_equal(out["i"], tree["i"])

    def test_with_output_dtype(self):
        policy = get_policy("c=f16").with_output_dtype(jnp.float32)
        assert policy == Policy("f32", "f16", "f32")


def test_jmp_policy_is_accepted_everywhere_a_policy_is():
    jp = jmp.get_policy("p=f32,c=f16,o=f32")
    assert get_policy(jp) == Policy("f32", "f16", "f32")
    assert precision.get_rules(get_policy(jp)) == precision.default_rules()


def test_jmp_helpers_match():
    assert precision.half_dtype() == jmp.half_dtype()
    assert precision.cast_to_half(jnp.ones(2)).dtype == jmp.cast_to_half(jnp.ones(2)).dtype
    assert precision.cast_to_full(jnp.ones(2, jnp.float16)).dtype == jnp.float32


@pytest.mark.parametrize("spec,token,position", [
    ("p=f32,p=f16", "p", 6),
    ("params=f32,params=f16", "params", 11),
    ("p=f32,", "", 6),
    (",p=f32", "", 0),
    ("p=f32,,c=f16", "", 6),
    ("f17", "f17", 0),
    ("int8", "int8", 0),
    ("p=int8", "int8", 2),
    ("x=f16", "x", 0),
    ("p=f32, c = f17", "f17", 11),
    ("p=f16=f32", "p=f16=f32", 0),
    ("p=", "", 2),
    ("=f16", "", 0),
    ("", "", 0),
    ("   ", "   ", 0),
    ("mixed_bf61", "mixed_bf61", 0),
])
def test_bad_specs_name_the_token_and_position(spec, token, position):
    with pytest.raises(PolicyError) as info:
        get_policy(spec)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.token == token and err.position == position
    message = str(err)
    assert "p|params" in message and "bf16" in message and "mixed_bf16" in message


@pytest.mark.parametrize("spec", ["compute_float16", "p=f32,c=f17", "float8", "p="])
def test_dtype_errors_say_unknown_dtype_as_jmp_does(spec):
    with pytest.raises(PolicyError, match="Unknown dtype"):
        get_policy(spec)
    with pytest.raises(ValueError, match="Unknown dtype"):
        jmp.get_policy(spec)


@pytest.mark.parametrize("spec,suggestion", [
    ("f17", "f16"), ("mixd_bf16", "mixed_bf16"), ("p=bfloat61", "bfloat16"), ("parms=f16", "params"),
])
def test_errors_suggest_the_nearest_valid_token(spec, suggestion):
    with pytest.raises(PolicyError, match=f"Did you mean '{suggestion}'"):
        get_policy(spec)


@pytest.mark.parametrize("bad", [None, 16, jnp.float16, ["f16"]])
def test_non_string_specs_raise_policy_error(bad):
    with pytest.raises(PolicyError, match="must be a string"):
        get_policy(bad)


def test_policy_rejects_non_float_dtypes():
    with pytest.raises(PolicyError):
        Policy(jnp.int8, jnp.float32, jnp.float32)


def test_a_policy_error_quotes_the_spec_as_given_and_its_position_points_into_it():
    spec = "p=f32,  c=f17"
    with pytest.raises(PolicyError) as error:
        get_policy(spec)
    assert f"Invalid precision policy {spec!r}: unknown dtype 'f17' at position 10" in str(error.value)
    assert spec[error.value.position:].startswith("f17")


def test_a_huge_spec_gives_a_short_message_around_the_error():
    spec = "p=f32,c=f16," + "x" * 1_000_000
    with pytest.raises(PolicyError) as error:
        get_policy(spec)
    message = str(error.value)
    assert len(message) < 1000 and f"({len(spec)} characters)" in message and error.value.position == 12


def test_objects_that_are_not_dtypes_are_policy_errors_never_float64():
    from unittest import mock

    with pytest.raises(PolicyError, match="is not a dtype"):
        get_policy(mock.Mock())  # looks like a jmp policy, its dtypes are not dtypes
    with pytest.raises(PolicyError, match="None is not a dtype"):
        Policy(None, "f32", "f32")


@pytest.mark.parametrize("typo, meant", [("compute=fp61", "fp16"), ("c=f61", "f16"), ("c=float61", "float16"),
                                         ("c=fp23", "fp32"), ("p=fp3", "fp32"), ("c=fp8x", "fp8"), ("c=bf61", "bf16")])
def test_a_dtype_typo_suggests_the_dtype_a_user_would_mean(typo, meant):
    """Issue 39 (11): ``fp61`` suggested ``fp64``; the same digits in another order mean fp16."""
    with pytest.raises(precision.PolicyError) as info:
        precision.get_policy(typo)
    assert f"Did you mean {meant!r}?" in str(info.value)
    assert "for compute only f8, fp8, float8 (FP8 matmuls" in str(info.value)
