"""Precision policies: which dtype params are stored in, math runs in, outputs leave in.

The grammar is a strict superset of ``jmp.get_policy``: every string jmp accepts
(except duplicate keys, which jmp silently lets the last one win and we reject)
gives the same three dtypes here. Beyond jmp we accept whitespace around tokens,
``fp16``/``fp32`` spellings, case-insensitive names and named presets, and
the FP8 compute dtype ``f8`` (``compute=f8``, or ``compute=f8/f16`` for another
16-bit fallback): allow-listed matmuls in FP8 (see :mod:`precision.fp8`),
every other op in the fallback; the int8 compute dtype (``compute=int8``, or
``compute=int8/f16``): allow-listed matmuls and convolutions with int8 operands
and int32 accumulation (see :mod:`precision.int8`), the rest in the fallback; and ``matmul=highest``: true float32 matmuls, not the
TF32 that GPUs run them in by default (docs/matmul-precision.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from precision.dtype_names import (_DTYPE_NAMES, _FP8_FALLBACK, _FP8_NAMES, _KEYS, _NAME_TO_DTYPE,
                                    _ROUNDING_NAMES, _ROUNDING_SHORT, _VALID_DTYPE_NAMES, PolicyError, _is_int8,
                                    _is_int8_compute, _bare_with_matmul, _is_fp8_name, _short, check_storable,
                                    dtype_to_names, half_dtype, matmul_precision_name)
from precision.presets import _PRESET_LOOKUP, _STORED_PRESETS, PRESETS, _error

T = TypeVar("T")

__all__ = [
    "Policy",
    "PolicyError",
    "PRESETS",
    "get_policy",
    "parse_dtype",
    "half_dtype",
    "cast_to_full",
    "cast_to_half",
    "dtype_to_names",
]


def _canonical(dtype: Any) -> np.dtype:
    if isinstance(dtype, str):
        return parse_dtype(dtype)
    if dtype is None:  # np.dtype(None) is float64: never a silent default
        raise PolicyError(f"None is not a dtype; valid: {', '.join(_VALID_DTYPE_NAMES)}")
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, RecursionError):  # numpy 2.0 recurses into a mock's .dtype.dtype...
        raise PolicyError(f"{_short(repr(dtype))} is not a dtype; valid: {', '.join(_VALID_DTYPE_NAMES)}") from None
    if dt not in _DTYPE_NAMES:
        raise PolicyError(
            f"dtype {dt} is not a floating dtype a policy can use; valid: "
            f"{', '.join(str(d) for d in _DTYPE_NAMES)}")
    return dt


def _stored_dtype(dtype: Any, which: str) -> np.dtype | None:
    """A master, optimizer-state or accumulation dtype: None for float32 (the default), bfloat16,
    else an error."""
    if dtype is None:
        return None
    if which == "state" and _is_int8(dtype):
        return np.dtype(np.int8)
    dt = _canonical(dtype)
    if dt == np.dtype(jnp.float32):
        return None
    if dt != np.dtype(jnp.bfloat16):
        why = {"master": "float16 masters lose small updates to a 10-bit mantissa and a 5-bit exponent",
               "state": "float16 loses a second moment's squares of small gradients to its range",
               "accum": "a float16 sum of loss-scaled gradients overflows its range"}[which]
        example = ("params=f32,compute=bf16,output=f32,accum=bf16" if which == "accum"
                   else "params=bf16,compute=bf16,output=f32,master=bf16,opt=bf16")
        raise PolicyError(f"{which}={dtype_to_names[dt][0]}: {which} dtypes are f32 or bf16 ({why}); "
                          f"e.g. '{example}'")
    return dt


def _cast_floating(tree: T, dtype: np.dtype) -> T:
    def cast(x):
        if hasattr(x, "dtype") and hasattr(x, "astype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x if x.dtype == dtype else x.astype(dtype)
        return x
    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True, init=False)
class Policy:
    """Immutable, hashable triple of dtypes: params (storage), compute, output.

    Usable as a static ``jax.jit`` argument. ``str(policy)`` parses back to an
    equal policy through :func:`get_policy`.

    ``fp8``: allow-listed matmuls compute in FP8 (E4M3 operands forward, E5M2
    gradients backward, float32 accumulation; see :mod:`precision.fp8`), and
    ``compute_dtype`` is the dtype of everything else (the fallback). A compute
    spelled ``"f8"`` or ``"f8/f16"`` sets it: ``Policy("f32", "f8", "f32")``.

    ``int8``: allow-listed matmuls and convolutions compute with int8 operands into int32
    (scales per row and column; see :mod:`precision.int8`), ``compute_dtype`` the rest's:
    ``Policy("f32", "int8", "f32")`` or ``"int8/f16"``.

    ``matmul_precision`` (``matmul=highest`` in a spec): the ``jax.lax.Precision`` autocast gives
    float32 matmuls and convolutions: ``"default"`` (XLA's: TF32 on GPUs that have it), ``"high"``
    or ``"highest"`` (true float32); see :mod:`precision.autocast.matmul_precision`.
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    fp8: bool = False
    master_dtype: np.dtype | None = None  # bfloat16: bf16 params are their own masters; None: float32 masters
    master_rounding: str | None = None  # of bfloat16 masters: stochastic, kahan or nearest
    state_dtype: np.dtype | None = None  # the optimizer state's floating arrays; None: float32
    accum_dtype: np.dtype | None = None  # gradients summed over micro-batches; None: float32
    matmul_precision: str = "default"  # of float32 matmuls/convolutions: default (TF32 on GPUs), high, highest
    int8: bool = False  # allow-listed matmuls and convolutions with int8 operands, int32 accumulation

    def __init__(self, param_dtype: Any, compute_dtype: Any, output_dtype: Any, fp8: bool = False,
                 master_dtype: Any = None, master_rounding: str | None = None, state_dtype: Any = None,
                 accum_dtype: Any = None, matmul_precision: Any = "default", int8: bool = False):
        for name, value in (("params", param_dtype), ("output", output_dtype)):
            check_storable(name, value)
        if isinstance(compute_dtype, str) and _is_fp8_name(compute_dtype):
            compute, fp8 = parse_compute(compute_dtype), True
        elif isinstance(compute_dtype, str) and _is_int8_compute(compute_dtype):
            compute, int8 = parse_compute(compute_dtype), True
        else:
            compute = _canonical(compute_dtype)
        if fp8 and int8:
            raise PolicyError("a policy's matmuls are FP8 (compute=f8) or int8 (compute=int8), not both")
        object.__setattr__(self, "param_dtype", _canonical(param_dtype))
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "output_dtype", _canonical(output_dtype))
        object.__setattr__(self, "fp8", bool(fp8))
        object.__setattr__(self, "int8", bool(int8))
        master, state = _stored_dtype(master_dtype, "master"), _stored_dtype(state_dtype, "state")
        if master is None and master_rounding is not None:
            raise PolicyError(f"master rounding {master_rounding!r} is for bfloat16 masters (master=bf16/"
                              f"{master_rounding}); float32 masters round nothing")
        rounding = _ROUNDING_NAMES.get(str(master_rounding or "sr").strip().lower())
        if rounding is None:
            raise PolicyError(f"master rounding {master_rounding!r}: valid: sr (stochastic), kahan, nearest")
        if master is not None and self.param_dtype != master:
            raise PolicyError(f"master=bf16 makes bf16 params their own masters, but params are "
                              f"{_DTYPE_NAMES[self.param_dtype][0]}: write params=bf16 (or leave master out for "
                              f"float32 masters)")
        object.__setattr__(self, "master_dtype", master)
        object.__setattr__(self, "master_rounding", rounding if master is not None else None)
        object.__setattr__(self, "state_dtype", state)
        object.__setattr__(self, "accum_dtype", _stored_dtype(accum_dtype, "accum"))
        object.__setattr__(self, "matmul_precision", matmul_precision_name(matmul_precision))

    @property
    def _kept(self) -> dict:
        """What a ``with_*`` method keeps besides the three dtypes."""
        return {"master_dtype": self.master_dtype, "master_rounding": self.master_rounding,
                "state_dtype": self.state_dtype, "accum_dtype": self.accum_dtype,
                "matmul_precision": self.matmul_precision}

    def with_stored(self, **fields: Any) -> "Policy":
        """The same dtypes with other stored-state fields (``master_dtype``, ``master_rounding``,
        ``state_dtype``, ``accum_dtype``) or ``matmul_precision``; the rest kept."""
        return Policy(self.param_dtype, self.compute_name if self.scaled else self.compute_dtype, self.output_dtype,
                      **{**self._kept, **fields})

    def cast_to_param(self, tree: T) -> T:
        """Casts floating leaves to the param dtype; integer and bool leaves are untouched."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts floating leaves to the compute dtype; integer and bool leaves are untouched."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts floating leaves to the output dtype; integer and bool leaves are untouched."""
        return _cast_floating(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype: Any) -> "Policy":
        """The same policy with another output dtype."""
        return Policy(
            self.param_dtype, self.compute_name if self.scaled else self.compute_dtype, output_dtype, **self._kept)

    def with_compute_dtype(self, compute_dtype: Any) -> "Policy":
        """The same policy with another compute dtype (``"f8"`` or ``"f8/f16"`` for FP8 matmuls,
        ``"int8"`` or ``"int8/f16"`` for int8 ones)."""
        return Policy(self.param_dtype, compute_dtype, self.output_dtype, **self._kept)

    def with_matmul_precision(self, matmul_precision: Any) -> "Policy":
        """The same policy with another precision of float32 matmuls (``"default"``, ``"high"``, ``"highest"``)."""
        return self.with_stored(matmul_precision=matmul_precision)

    @property
    def scaled(self) -> str | None:
        """The 8-bit format its allow-listed matmuls compute in: ``"f8"``, ``"int8"`` or None."""
        return "f8" if self.fp8 else "int8" if self.int8 else None

    @property
    def is_mixed(self) -> bool:
        """True when any of the three dtypes is not float32, or matmuls compute in FP8 or int8."""
        f32 = np.dtype(jnp.float32)
        return bool(self.scaled) or any(d != f32 for d in (self.param_dtype, self.compute_dtype, self.output_dtype))

    @property
    def compute_name(self) -> str:
        """The compute dtype as a spec writes it: ``bf16``, ``f8/bf16`` for FP8 matmuls, ``int8/bf16`` for int8."""
        name = _DTYPE_NAMES[self.compute_dtype][0]
        return f"{self.scaled}/{name}" if self.scaled else name

    def __str__(self) -> str:
        n = lambda d: _DTYPE_NAMES[d][0]
        text = f"p={n(self.param_dtype)},c={self.compute_name},o={n(self.output_dtype)}"
        if self.master_dtype is not None:
            text += f",m={n(self.master_dtype)}/{_ROUNDING_SHORT[self.master_rounding]}"
        if self.state_dtype is not None:
            text += f",s={'int8' if self.state_dtype == np.dtype(np.int8) else n(self.state_dtype)}"
        if self.accum_dtype is not None:
            text += f",a={n(self.accum_dtype)}"
        if self.matmul_precision != "default":
            text += f",matmul={self.matmul_precision}"
        return text

    def __repr__(self) -> str:
        return f"Policy({str(self)!r})"


def parse_dtype(name: str) -> np.dtype:
    """Parses a dtype name (``f16``, ``bfloat16``, ``full``, ``half``...) into a numpy dtype."""
    if not isinstance(name, str):
        raise PolicyError(f"dtype name must be a string, got {type(name).__name__}")
    token = name.strip()
    return _parse_dtype_token(token, name, 0)


def _parse_dtype_token(token: str, spec: str, position: int) -> np.dtype:
    low = token.lower()
    if low == "half":
        return half_dtype()
    if low in _NAME_TO_DTYPE:
        return _NAME_TO_DTYPE[low]
    what = "empty dtype" if not token else "unknown dtype"
    raise _error(spec, token, position, what, _VALID_DTYPE_NAMES, bad_dtype=True)


def get_policy(spec: "str | Policy | Any") -> Policy:
    """Parses ``"params=f32,compute=f16"``, a bare dtype or a preset name into a Policy.

    A missing params is f32, a missing compute follows params, a missing output
    follows compute, a bare dtype sets all three. A preset or bare dtype may be
    followed by ``,matmul=highest`` (``"mixed_bf16,matmul=highest"``). A ``Policy``
    or ``jmp.Policy`` is returned as an equal :class:`Policy`. Raises :class:`PolicyError`.
    """
    if isinstance(spec, Policy):
        return spec
    if _looks_like_jmp_policy(spec):
        return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
    if not isinstance(spec, str):
        raise PolicyError(
            f"A precision policy must be a string like 'params=f32,compute=f16', a preset "
            f"({', '.join(PRESETS)}) or a Policy; got {type(spec).__name__} {spec!r}.")
    stripped = spec.strip()
    if not stripped:
        raise _error(spec, spec, 0, "empty policy")
    head, matmul = _bare_with_matmul(spec)
    if matmul is not None:
        return get_policy(head).with_matmul_precision(matmul)
    if stripped.lower() in _PRESET_LOOKUP:
        name = _PRESET_LOOKUP[stripped.lower()]
        p, c, o, _ = PRESETS[name]
        master, rounding, state = _STORED_PRESETS.get(name, (None, None, None))
        return Policy(_NAME_TO_DTYPE[p], c if _is_fp8_name(c) or _is_int8_compute(c) else _NAME_TO_DTYPE[c],
                      _NAME_TO_DTYPE[o],
                      master_dtype=master, master_rounding=rounding, state_dtype=state)
    if "=" not in spec and "," not in spec:
        start = spec.index(stripped)
        low = stripped.lower()
        if _is_fp8_name(low):
            raise _error(spec, stripped, start, "FP8 is a compute dtype for matmuls only, not a dtype for params "
                         "and outputs: write 'mixed_fp8' or 'compute=f8' instead of", (), bad_dtype=True)
        if _is_int8_compute(low):
            raise _error(spec, stripped, start, "int8 is a compute dtype for matmuls only, not a dtype for params "
                         "and outputs: write 'mixed_int8' or 'compute=int8' instead of", (), bad_dtype=True)
        if low != "half" and low not in _NAME_TO_DTYPE:
            raise _error(spec, stripped, start, "unknown dtype or preset",
                         _VALID_DTYPE_NAMES + tuple(_PRESET_LOOKUP), bad_dtype=True)
        dt = _parse_dtype_token(stripped, spec, start)
        return Policy(dt, dt, dt)
    return _parse_assignments(spec)


def _parse_assignments(spec: str) -> Policy:
    found: dict[str, Any] = {}
    offset = 0
    for part in spec.split(","):
        part_start = offset
        offset += len(part) + 1
        if not part.strip():
            raise _error(spec, part, part_start, "empty part (stray or trailing comma)")
        if part.count("=") != 1:
            raise _error(spec, part.strip(), part_start + part.index(part.strip()),
                         "expected exactly one 'key=dtype' in part")
        key_raw, value_raw = part.split("=")
        key, value = key_raw.strip(), value_raw.strip()
        key_pos = part_start + (key_raw.index(key) if key else 0)
        value_pos = part_start + len(key_raw) + 1 + (value_raw.index(value) if value else 0)
        field = _KEYS.get(key.lower())
        if field is None:
            raise _error(spec, key, key_pos, "empty key" if not key else "unknown key", _KEYS)
        if field in found:
            what = "precision" if field == "matmul" else "dtype"
            raise _error(spec, key, key_pos, f"duplicate key for {field} {what}")
        if field == "matmul":
            found[field] = matmul_precision_name(value, spec, value_pos)
            continue
        if field == "master" and "/" in value:
            value, _, rounding = value.partition("/")
            if rounding.strip().lower() not in _ROUNDING_NAMES:
                raise _error(spec, rounding.strip(), value_pos + len(value) + 1, "unknown master rounding "
                             "(valid: sr, kahan, nearest)", _ROUNDING_NAMES)
            found["master_rounding"], value = rounding.strip(), value.strip()
        if field == "state" and _is_int8(value):
            found[field] = value
            continue
        if _is_int8_compute(value) and field != "compute":
            raise _error(spec, value, value_pos, f"int8 is a compute dtype for matmuls only; {field} must be "
                         "f32, bf16 or f16 (e.g. 'params=f32,compute=int8,output=f32'), not", ())
        if _is_fp8_name(value) or _is_int8_compute(value):
            scaled = "int8" if _is_int8_compute(value) else "fp8"
            if field != "compute":
                raise _error(spec, value, value_pos, f"FP8 is a compute dtype for matmuls only; {field} must be "
                             "f32, bf16 or f16, not", ())
            found[scaled] = True
            head, slash, fallback = value.partition("/")
            if slash and not fallback.strip():
                raise _error(spec, value, value_pos, f"{scaled} compute needs a fallback dtype after '/' (bf16, f16 "
                             "or f32) in", ())
            if not fallback.strip():
                found[field] = _FP8_FALLBACK
                continue
            value_pos += len(head) + 1 + (len(fallback) - len(fallback.lstrip()))
            value = fallback.strip()
        found[field] = _parse_dtype_token(value, spec, value_pos)
    param = found.get("param", np.dtype(jnp.float32))
    compute = found.get("compute", param)
    output = found.get("output", compute)
    return Policy(param, compute, output, fp8=bool(found.get("fp8")), master_dtype=found.get("master"),
                  master_rounding=found.get("master_rounding"), state_dtype=found.get("state"),
                  accum_dtype=found.get("accum"), matmul_precision=found.get("matmul"), int8=bool(found.get("int8")))


def parse_compute(spec: str) -> np.dtype:
    """The fallback dtype of an FP8 or int8 compute spec: ``"f8"`` -> bfloat16, ``"int8/f16"`` -> float16."""
    head, _, fallback = spec.strip().partition("/")
    if head.strip().lower() not in _FP8_NAMES and not _is_int8_compute(head):
        raise PolicyError(f"{spec!r} is not an FP8 or int8 compute spec; write f8, fp8, float8 or int8, optionally "
                          "/bf16, /f16 or /f32 for the dtype of the other ops")
    return parse_dtype(fallback) if fallback.strip() else _FP8_FALLBACK


def _looks_like_jmp_policy(obj: Any) -> bool:
    return (not isinstance(obj, str)
            and all(hasattr(obj, a) for a in ("param_dtype", "compute_dtype", "output_dtype"))
            and hasattr(obj, "cast_to_compute"))


def cast_to_full(tree: T) -> T:
    """Casts floating leaves to float32 (as ``jmp.cast_to_full``)."""
    return _cast_floating(tree, np.dtype(jnp.float32))


def cast_to_half(tree: T) -> T:
    """Casts floating leaves to the backend's half dtype (as ``jmp.cast_to_half``)."""
    return _cast_floating(tree, half_dtype())
