"""The KV cache in ``--kv-dtype``: bf16, f16, f32 as arrays; int8 or fp8 with a scale per head and position.

Past the weights, a decode step reads the whole cache: at long contexts it is most of the
bytes of a token. ``int8`` and ``fp8`` (E4M3) store each key (or value) vector, one per
batch row, position and head, as codes and one float32 scale, its largest magnitude over
the head's dimension divided by the code's largest value (127, 448): written when the
position is, so a vector's codes never change after; read back as ``codes * scale`` in the
attention's dtype, elementwise on the operand of the attention's matmul (fused by XLA).
MaxText's ``quantize_kvcache`` with ``kv_quant_axis=heads_and_dkv`` scales the same way.

The stores are :class:`train.models.kv_cache.KVStore`\\ s: the GPT writes and reads through
them knowing nothing of what they hold. A Hugging Face or Linen ``decode=True`` model keeps
its own cache, of arrays, which serving makes in bf16, f16 or f32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.models.kv_cache import DenseKV
from train.serving.tokenizer import SampleError

__all__ = ["KV_DTYPES", "QuantizedKV", "kv_dtype", "kv_store", "is_quantized_kv"]

#: ``--kv-dtype`` names and the dtype of what the cache holds.
KV_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "int8": "int8", "fp8": "float8_e4m3fn"}
_ALIASES = {"bfloat16": "bf16", "float16": "f16", "fp16": "f16", "float32": "f32", "fp32": "f32", "e4m3": "fp8"}
#: The largest code of each quantized form.
_LIMITS = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}


@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """Keys or values as ``code`` (``"int8"`` or ``"fp8"``) codes ``(batch, length, heads, head_dim)``
    with float32 scales ``(batch, length, heads, 1)``."""

    code: str

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(KV_DTYPES[self.code])

    def init(self, shape: tuple[int, ...], dtype: Any) -> dict:
        del dtype  # the codes' own
        return {"codes": jnp.zeros(shape, self.dtype), "scales": jnp.zeros((*shape[:-1], 1), jnp.float32)}

    def write(self, stored: dict, new: jax.Array, index: jax.Array) -> dict:
        x = new.astype(jnp.float32)
        peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        scales = jnp.where(peak > 0, peak, 1.0) / _LIMITS[self.code]
        unit = x / scales
        codes = jnp.round(unit).astype(jnp.int8) if self.code == "int8" else unit.astype(self.dtype)
        return {"codes": jax.lax.dynamic_update_slice_in_dim(stored["codes"], codes, index, axis=1),
                "scales": jax.lax.dynamic_update_slice_in_dim(stored["scales"], scales, index, axis=1)}

    def read(self, stored: dict, dtype: Any) -> jax.Array:
        return stored["codes"].astype(dtype) * stored["scales"].astype(dtype)


def kv_dtype(name: str | None, compute: str) -> str:
    """The ``--kv-dtype`` key ``name`` stands for; None: the dtype the model computes in."""
    if name is None:
        return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[compute]
    key = _ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if key not in KV_DTYPES:
        raise SampleError(f"--kv-dtype {name!r}: give bf16, f16, int8 or fp8 (or f32)")
    return key


def kv_store(key: str) -> Any:
    """The store for ``--kv-dtype key``: arrays in that dtype, or codes and scales."""
    return QuantizedKV(key) if key in _LIMITS else DenseKV(KV_DTYPES[key])


def is_quantized_kv(key: str) -> bool:
    return key in _LIMITS
