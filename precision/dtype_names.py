"""The names of the dtypes a precision policy is written with, and the pieces of its
grammar that need no policy: :class:`PolicyError`, dtype spellings (``f16``, ``bfloat16``,
``full``...), the FP8 compute and 8-bit state spellings, master roundings, the precisions
of float32 matmuls (``matmul=highest``), and the typo-correction and quoting of error
messages (used by :mod:`precision.policy`)."""

from __future__ import annotations

import difflib
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PolicyError", "half_dtype", "dtype_to_names", "MATMUL_PRECISIONS", "matmul_precision_name",
           "check_storable"]

class PolicyError(ValueError):
    """A precision policy spec that cannot be parsed.

    Carries the offending ``token`` and its character ``position`` in ``spec``.
    """

    def __init__(self, message: str, *, spec: str = "", token: str = "", position: int = -1):
        super().__init__(message)
        self.spec = spec
        self.token = token
        self.position = position


def half_dtype() -> np.dtype:
    """The half dtype for the default backend: bfloat16 on TPU, float16 elsewhere (as jmp)."""
    return np.dtype(jnp.bfloat16) if jax.default_backend() == "tpu" else np.dtype(jnp.float16)


# Canonical (first) name of each dtype is what str(Policy) prints.
_DTYPE_NAMES: dict[np.dtype, tuple[str, ...]] = {
    np.dtype(jnp.float32): ("f32", "float32", "full", "fp32"),
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(jnp.float16): ("f16", "float16", "fp16"),
    np.dtype(jnp.float64): ("f64", "float64", "fp64"),
}
_NAME_TO_DTYPE = {name: dt for dt, names in _DTYPE_NAMES.items() for name in names}


class _DtypeNames(Mapping):
    """Read-only ``dtype -> names`` whose keys may be any dtype-like
    (``np.float16``, ``jnp.bfloat16``, ``np.dtype("float32")``)."""

    def __getitem__(self, dtype: Any) -> tuple[str, ...]:
        try:
            return _DTYPE_NAMES[np.dtype(dtype)]
        except TypeError:
            raise KeyError(dtype) from None

    def __iter__(self):
        return iter(_DTYPE_NAMES)

    def __len__(self) -> int:
        return len(_DTYPE_NAMES)

    def __repr__(self) -> str:
        return f"dtype_to_names({dict(_DTYPE_NAMES)!r})"


#: The names each policy dtype is spelled with (jmp's ``dtype_to_names``); the
#: first is the one ``str(policy)`` prints. Unlike jmp, float32 prints as
#: ``f32`` (jmp: ``full``); both parse to float32 in either library.
dtype_to_names: Mapping[np.dtype, tuple[str, ...]] = _DtypeNames()
_VALID_DTYPE_NAMES = tuple(_NAME_TO_DTYPE) + ("half",)
#: Spellings of the FP8 compute dtype (matmuls in FP8, the rest in a fallback dtype).
_FP8_NAMES = ("f8", "fp8", "float8")
#: The fallback of ``compute=f8`` when none is written: bf16 has the range FP8's scales assume.
_FP8_FALLBACK = np.dtype(jnp.bfloat16)
_KEYS = {"p": "param", "params": "param", "c": "compute", "compute": "compute",
         "o": "output", "output": "output", "m": "master", "master": "master",
         "s": "state", "state": "state", "opt": "state", "a": "accum", "accum": "accum", "grad_accum": "accum",
         "matmul": "matmul", "matmul_precision": "matmul"}
#: How bfloat16 masters round a float32 update into them (see precision.stored); ``sr`` is stochastic.
_ROUNDING_NAMES = {"sr": "stochastic", "stochastic": "stochastic", "kahan": "kahan", "nearest": "nearest",
                   "rn": "nearest"}
_ROUNDING_SHORT = {"stochastic": "sr", "kahan": "kahan", "nearest": "nearest"}


#: The precisions of float32 matmuls and convolutions a policy can ask for (``jax.lax.Precision``'s
#: DEFAULT, HIGH, HIGHEST), each with what it means on a GPU.
MATMUL_PRECISIONS: Mapping[str, str] = {
    "default": "XLA's default: TF32 on GPUs that have it",
    "high": "bf16_3x on TPU; on a GPU float32 or TF32, by GEMM kernel",
    "highest": "true float32",
}


def matmul_precision_name(value: Any, spec: str = "", position: int = -1) -> str:
    """``"default"``, ``"high"`` or ``"highest"`` for a name (any case), a
    ``jax.lax.Precision`` or None (default); a :class:`PolicyError` naming the valid ones otherwise."""
    if value is None:
        return "default"
    name = getattr(value, "name", value)  # jax.lax.Precision.HIGHEST -> "HIGHEST"
    token = name.strip().lower() if isinstance(name, str) else ""
    if token in MATMUL_PRECISIONS:
        return token
    close = difflib.get_close_matches(token, list(MATMUL_PRECISIONS), n=1, cutoff=0.5) if token else []
    head = f"Invalid precision policy {_short(spec, position)!r}: " if spec else ""
    where = f" at position {position}" if position >= 0 else ""
    raise PolicyError(f"{head}unknown matmul precision {_short(str(value))!r}{where}."
                      + (f" Did you mean {close[0]!r}?" if close else "")
                      + f" Valid: {', '.join(f'{k} ({v})' for k, v in MATMUL_PRECISIONS.items())}",
                      spec=spec, token=str(value), position=position)


def _bare_with_matmul(spec: str) -> tuple[str, str | None]:
    """``"mixed_bf16,matmul=highest"``: (the preset or bare dtype, the matmul precision);
    ``(spec, None)`` for any other spec."""
    head, comma, tail = spec.partition(",")
    key, equals, value = tail.partition("=")
    if not comma or "=" in head or not equals or "," in tail or _KEYS.get(key.strip().lower()) != "matmul":
        return spec, None
    position = len(head) + 1 + len(key) + 1 + (len(value) - len(value.lstrip()))
    return head, matmul_precision_name(value.strip(), spec, position)


def _is_fp8_name(token: str) -> bool:
    """``f8``, ``fp8``, ``float8``, alone or with a ``/fallback``."""
    return token.strip().partition("/")[0].strip().lower() in _FP8_NAMES


#: Spellings of 8-bit optimizer state (block-wise quantized moments, precision.quantized).
_INT8_NAMES = ("int8", "i8", "8bit")
#: Spellings of the int8 compute dtype (matmuls with int8 operands, the rest in a fallback dtype).
_INT8_COMPUTE_NAMES = ("int8", "i8")


def _is_int8_compute(token: str) -> bool:
    """``int8``, ``i8``, alone or with a ``/fallback``: the int8 compute spelling."""
    return token.strip().partition("/")[0].strip().lower() in _INT8_COMPUTE_NAMES


def _is_int8(dtype: Any) -> bool:
    if isinstance(dtype, str):
        return dtype.strip().lower() in _INT8_NAMES
    try:
        return np.dtype(dtype) == np.dtype(np.int8)
    except (TypeError, ValueError, RecursionError):  # not a dtype (a mock's .dtype...): the caller says why
        return False


#: Bit widths each dtype spelling takes, the likelier meant first (half precision is what a policy is for).
_WIDTHS = {"bfloat": ("16",), "bf": ("16",), "float": ("16", "32", "8", "64"), "fp": ("16", "32", "8", "64"),
           "f": ("16", "32", "8", "64")}


def _nearest_dtype(token: str) -> str | None:
    """The dtype a typo of a spelling and a width means: ``fp61`` -> ``fp16`` (the same digits),
    ``fp3`` -> ``fp32``, ``fp8x`` -> ``fp8``; None when it is no such typo."""
    match = re.fullmatch(r"(bfloat|float|bf|fp|f)(\d+)\D*", token)
    if match is None:
        return None
    prefix, digits = match.groups()
    widths = _WIDTHS[prefix]
    for same in (lambda w: w == digits, lambda w: sorted(w) == sorted(digits),
                 lambda w: w.startswith(digits) or digits.startswith(w)):
        found = [w for w in widths if same(w)]
        if found:
            return prefix + found[0]
    return None


#: The longest spec or token an error message quotes whole; longer ones are cut around the error.
_QUOTED = 80


def _short(text: str, at: int = 0) -> str:
    """``text`` whole when short, else a window of it around position ``at`` with ``...`` for the rest."""
    if len(text) <= _QUOTED:
        return text
    start = max(0, min(at - _QUOTED // 2, len(text) - _QUOTED))
    return ("..." if start else "") + text[start:start + _QUOTED] + ("..." if start + _QUOTED < len(text) else "")


def check_storable(name: str, value: Any) -> None:
    """Params and outputs are stored floats: FP8 and int8 are compute dtypes of matmuls only."""
    if isinstance(value, str) and _is_fp8_name(value):
        raise PolicyError(f"{name}={value.strip()}: FP8 is a compute dtype for matmuls only; params and "
                          "outputs are f32, bf16 or f16 (e.g. 'params=f32,compute=f8,output=f32')")
    if (isinstance(value, str) and _is_int8_compute(value)) or (not isinstance(value, str) and _is_int8(value)):
        raise PolicyError(f"{name}=int8: int8 is a compute dtype for matmuls only; params and outputs are f32, "
                          "bf16 or f16 (e.g. 'params=f32,compute=int8,output=f32', or the preset mixed_int8)")
