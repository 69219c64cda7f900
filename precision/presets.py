"""The named presets of precision policies (``mixed_bf16``, ``mixed_int8``...) and the one-line
errors a spec that cannot be parsed gets (what is wrong, where, what is valid; used by
:mod:`precision.policy`)."""

from __future__ import annotations

import difflib
from typing import Mapping

from precision.dtype_names import (_FP8_NAMES, _QUOTED, _VALID_DTYPE_NAMES, PolicyError, _nearest_dtype,
                                    _short)

__all__ = ["PRESETS"]

_F32, _BF16, _F16 = "f32", "bf16", "f16"

#: Named presets: name -> (params, compute, output, description).
PRESETS: Mapping[str, tuple[str, str, str, str]] = {
    "fp32": (_F32, _F32, _F32, "full precision everywhere (Apex/Paddle O0)"),
    "mixed_bf16": (_F32, _BF16, _F32, "f32 params, bf16 math, f32 outputs"),
    "mixed_bfloat16": (_F32, _BF16, _F32, "alias of mixed_bf16"),
    "mixed_f16": (_F32, _F16, _F32, "f32 params, f16 math, f32 outputs; use loss scaling"),
    "mixed_float16": (_F32, _F16, _F32, "alias of mixed_f16"),
    "mixed_fp8": (_F32, "f8/bf16", _F32, "f32 params, FP8 matmuls (E4M3/E5M2), the rest bf16, f32 outputs"),
    "mixed_int8": (_F32, "int8/bf16", _F32, "f32 params, int8 matmuls and convolutions (int32 accumulation, scales "
                   "per row and column), the rest bf16, f32 outputs"),
    "pure_bf16": (_BF16, _BF16, _BF16, "bf16 params, math and outputs"),
    "pure_f16": (_F16, _F16, _F16, "f16 params, math and outputs; use loss scaling"),
    "O1": (_F32, _F16, _F32, "Apex/Paddle O1: f16 math, f32 params; norms, softmax, losses in f32"),
    "O2": (_F16, _F16, _F32, "Apex/Paddle O2: f16 params with f32 master weights, f32 norms"),
    "O3": (_F16, _F16, _F16, "Apex O3: pure f16, no f32 rules"),
    "lean_bf16": (_BF16, _BF16, _F32, "bf16 params as their own masters (stochastic rounding), bf16 math, bf16 "
                  "optimizer state, f32 outputs: 6 bytes per param with Adam"),
    "lean_int8": (_BF16, _BF16, _F32, "lean_bf16 with 8-bit block-wise optimizer state: about 4 bytes per param "
                  "with Adam"),
}
#: Presets that also store masters and optimizer state below float32: name -> (master, rounding, state).
_STORED_PRESETS = {"lean_bf16": (_BF16, "sr", _BF16), "lean_int8": (_BF16, "sr", "int8")}
_PRESET_LOOKUP = {name.lower(): name for name in PRESETS}


def _suggest(token: str, choices, dtype: bool = False) -> str:
    close = ([_nearest_dtype(token)] if dtype and _nearest_dtype(token) else []) \
        or difflib.get_close_matches(token, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _error(spec: str, token: str, position: int, what: str, choices=(), *,
           bad_dtype: bool = False) -> PolicyError:
    where = f" at position {position}" if position >= 0 else ""
    dtypes, keys = ", ".join(_VALID_DTYPE_NAMES), "p|params, c|compute, o|output, m|master, s|state|opt, matmul"
    # jmp says "Unknown dtype" for a bad dtype: code matching that phrase keeps working.
    fp8 = (f"and for compute only {', '.join(_FP8_NAMES)} (FP8 matmuls, e.g. compute=fp8 or fp8/f16) or int8 (int8 "
           "matmuls, e.g. compute=int8 or int8/bf16)")
    valid = (f"Unknown dtype: the valid ones are {dtypes}, {fp8}; valid keys: {keys};" if bad_dtype
             else f"Valid keys: {keys}; valid dtypes: {dtypes}, {fp8};")
    shown = repr(_short(spec, position)) + (f" ({len(spec)} characters)" if len(spec) > _QUOTED else "")
    msg = (f"Invalid precision policy {shown}: {what} {_short(token)!r}{where}."
           + _suggest(token.lower()[:_QUOTED], choices, dtype=bad_dtype)
           + f" {valid} presets: {', '.join(PRESETS)}."
           " Example: 'params=f32,compute=f16,output=f32'.")
    return PolicyError(msg, spec=spec, token=token, position=position)
