"""The attention of a fused decode step: each query head of one new token over the KV cache.

One program per (row, query head) reads the cache positions before the step's index in
blocks of :data:`BLOCK_POSITIONS`, with an online softmax in float32, and adds the new key
and value (which it also writes into the cache, in place: the caches are donated). The
queries, keys and values come as :func:`train.serving.decode_kernels.norm_qkv` or
``norm_gemv`` lay them out: ``(B, (heads + 2 Hkv) * hd)``, the queries, then the keys, then
the values, a head's ``hd`` columns apiece.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from train.serving.decode_kernels import F32, block, call_kernel, whole

__all__ = ["attend", "BLOCK_POSITIONS"]

#: Cache positions one iteration of the attention reads.
BLOCK_POSITIONS = 64


def attend(qkv, cached_key, cached_value, index, heads: int):
    """Each of ``heads`` query heads of ``qkv`` (:func:`norm_qkv`'s) attending over the cache's
    positions before ``index`` and the new key and value (grouped: query head ``h`` reads key
    head ``h // (heads / Hkv)``), softmax in float32; the new key and value written into the
    cache at ``index`` (in place: the caches are donated). Returns ``(B, heads * hd)`` float32
    and the two caches. The cache is ``(B, length, Hkv, hd)``, as Hugging Face's Flax models keep it."""
    b, length, hkv, hd = cached_key.shape
    group, bl = heads // hkv, block(length, BLOCK_POSITIONS)
    scale = 1.0 / float(hd) ** 0.5

    def kernel(index_ref, q_ref, k_ref, v_ref, ck_ref, cv_ref, o_ref, ck_out, cv_out):
        row, head = pl.program_id(0), pl.program_id(1)
        kv, at = head // group, index_ref[0]
        q = q_ref[...].astype(F32) * scale  # (1, hd)
        k_new, v_new = k_ref[...].astype(F32), v_ref[...].astype(F32)

        def body(j, carry):
            m, s, acc = carry
            where = pl.ds(j * bl, bl)
            keys = ck_ref[row, where, kv, :].astype(F32)  # (bl, hd)
            scores = jnp.sum(keys * q, axis=1)
            scores = jnp.where(j * bl + jnp.arange(bl) < at, scores, -jnp.inf)
            top = jnp.maximum(m, jnp.max(scores))
            p = jnp.exp(scores - top)
            values = cv_ref[row, where, kv, :].astype(F32)
            acc = acc * jnp.exp(m - top) + jnp.sum(p[:, None] * values, axis=0, keepdims=True)
            return top, s * jnp.exp(m - top) + jnp.sum(p), acc

        new = jnp.sum(k_new * q)
        m, s, acc = jax.lax.fori_loop(0, (at + bl - 1) // bl, body, (new, jnp.float32(1.0), v_new))
        o_ref[...] = acc / s

        @pl.when(head % group == 0)
        def _():
            ck_out[row, pl.ds(at, 1), kv, :] = k_new.astype(ck_out.dtype)  # ck_ref's buffer, aliased
            cv_out[row, pl.ds(at, 1), kv, :] = v_new.astype(cv_out.dtype)

    index = jnp.reshape(index, (1,)).astype(jnp.int32)
    specs = [whole((1,)), pl.BlockSpec((1, hd), lambda r, h: (r, h)),
             pl.BlockSpec((1, hd), lambda r, h: (r, heads + h // group)),
             pl.BlockSpec((1, hd), lambda r, h: (r, heads + hkv + h // group)),
             whole(cached_key.shape), whole(cached_value.shape)]
    outs = (jax.ShapeDtypeStruct((b, heads * hd), F32), jax.ShapeDtypeStruct(cached_key.shape, cached_key.dtype),
            jax.ShapeDtypeStruct(cached_value.shape, cached_value.dtype))
    out_specs = (pl.BlockSpec((1, hd), lambda r, h: (r, h)), whole(cached_key.shape), whole(cached_value.shape))
    return call_kernel(kernel, outs, (b, heads), specs, out_specs, (index, qkv, qkv, qkv, cached_key, cached_value),
                       aliases={4: 1, 5: 2})

