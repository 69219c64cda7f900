"""A decoder-only, GPT-style Transformer for character-level language modelling.

Attention goes through :func:`jax.nn.dot_product_attention` with
``is_causal=True``: cuDNN's fused (flash) attention when the model computes in
float16/bfloat16 and the program is lowered for a CUDA GPU, XLA's implementation
elsewhere (its softmax runs
in float32, the two matmuls in the operands' dtype). No causal mask is kept for
the backward pass: the backward pass rebuilds it (a remat policy that saves no
boolean value), so the only ``(B, H, T, T)`` values saved are the softmax's.

With attention dropout active (``dropout > 0`` and ``train=True``) the
probabilities must exist to be dropped, so that case computes them explicitly in
a :class:`Softmax` module (which a rule such as ``("Softmax", "f32")`` can target).

``decode=True`` keeps a cache of keys and values in the ``cache`` collection for
generation (:mod:`train.models.kv_cache`): a prompt in one call, each new token in a
call of the same shape; ``kv_store`` says how the cache holds them.
"""

import typing
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from train.models.kv_cache import cache_position, cached_attention

#: ``attention_impl`` values: ``None`` picks cuDNN for half-precision operands lowered for a GPU, XLA otherwise.
ATTENTION_IMPLS = (None, "xla", "cudnn")

_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# Primitives making booleans or indices (a mask, an iota): recomputed in the backward pass, never saved.
_MASK_PRIMITIVES = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "iota"})


class Softmax(nn.Module):
    """``jax.nn.softmax`` as a module, so rules can target it."""

    axis: int = -1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.softmax(x, axis=self.axis)


def _saves_no_masks(prim: Any, *avals: Any, **params: Any) -> bool:
    """Remat policy: save floating values only, never a mask or the index arithmetic building it.

    JAX calls it with a primitive and its *input* avals: comparisons make
    booleans, and a primitive whose inputs are all boolean or integer
    (broadcasting or combining a mask, shifting an ``iota``) makes no float.
    """
    del params
    if prim.name in _MASK_PRIMITIVES:
        return False
    dtypes = [getattr(a, "dtype", None) for a in avals]
    return not (dtypes and all(d is not None and not jnp.issubdtype(d, jnp.inexact) for d in dtypes))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str | None = None) -> jax.Array:
    """Causal softmax(q k^T) v over ``(batch, length, heads, head_dim)`` operands, ``q`` already scaled.

    ``implementation``: ``None`` (cuDNN for half operands where the program is
    lowered for a CUDA GPU, else XLA), ``"xla"`` or ``"cudnn"``. The automatic
    choice is made by the platform the program is lowered for
    (``jax.lax.platform_dependent``), not the host that traces it, so a step
    compiled for a GPU from a CPU machine gets cuDNN's kernel too; where cuDNN
    cannot take the shapes (head_dim over its limit, no CUDA plugin to build its
    call), it is XLA's everywhere.
    """
    def cudnn(q, k, v):  # its backward keeps q, k, v, the output and softmax statistics: no mask
        return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, implementation="cudnn")

    # A new function each call: JAX caches the trace of a function it checkpoints, and a trace made
    # outside autocast (by init) would hide the attention call autocast recognises.
    xla = jax.checkpoint(lambda q, k, v: _xla_causal_attention(q, k, v), policy=_saves_no_masks, prevent_cse=False)
    if implementation == "cudnn":
        return cudnn(q, k, v)
    if implementation is None and np.dtype(q.dtype) in _HALF:
        try:
            return jax.lax.platform_dependent(q, k, v, cuda=cudnn, default=xla)
        except (NotImplementedError, RuntimeError, ValueError):  # checked while tracing: shapes, cuDNN version
            pass
    return xla(q, k, v)


def _xla_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    def fused(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True)

    if np.dtype(q.dtype) == np.float16:
        # jax.nn's XLA attention asks float16 logits for the F16_F16_F32 dot algorithm, which
        # XLA:CPU cannot compile (its fallback only catches errors raised while tracing).
        return jax.lax.platform_dependent(q, k, v, cpu=explicit_causal_attention, default=fused)
    return fused(q, k, v)


def explicit_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, softmax: Any = jax.nn.softmax,
                              dropout: Any = None, logits_dtype: Any = jnp.float32) -> jax.Array:
    """Causal attention written out: logits (in ``logits_dtype``; ``None``: the
    operands'), the causal mask, ``softmax`` (a :class:`Softmax` module, so rules can
    target it), optional ``dropout`` of the probabilities, which go back to the
    values' dtype for the second product."""
    length = q.shape[1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=logits_dtype)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    probs = softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min))
    if dropout is not None:
        probs = dropout(probs)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only earlier ones."""

    num_heads: int
    dropout: float = 0.0
    dtype: Any = None  # every layer's computation dtype, the way Flax examples pass it; None: inputs'/params'
    attention_impl: str | None = None  # None (automatic), "xla" or "cudnn": see causal_attention
    decode: bool = False  # keep keys and values in the "cache" collection (train.models.kv_cache)
    kv_store: Any = None  # how the cache stores them (a kv_cache.KVStore; None: as computed)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False, start: jax.Array | None = None) -> jax.Array:
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        batch, length, features = x.shape
        head_dim = features // self.num_heads
        qkv = nn.Dense(3 * features, dtype=self.dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.num_heads, head_dim), 3, axis=2)
        q = q * (head_dim ** -0.5)  # scale before the product: keeps half-precision logits in range
        if self.decode:
            out = cached_attention(self, q, k, v, self.kv_store,
                                   lambda q, k, v: causal_attention(q, k, v, self.attention_impl), start)
        elif train and self.dropout > 0:
            out = self._attention_with_dropout(q, k, v)
        else:
            out = causal_attention(q, k, v, self.attention_impl)
        return nn.Dense(features, dtype=self.dtype, name="proj")(out.reshape(batch, length, features))

    def _attention_with_dropout(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return explicit_causal_attention(q, k, v, Softmax(name="softmax"),
                                         nn.Dropout(self.dropout, deterministic=False), logits_dtype=None)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    num_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    dtype: Any = None  # every layer's computation dtype, the way Flax examples pass it; None: inputs'/params'
    attention_impl: str | None = None  # None (automatic), "xla" or "cudnn": see causal_attention
    decode: bool = False  # keep a cache of keys and values (see CausalSelfAttention)
    kv_store: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False, start: jax.Array | None = None) -> jax.Array:
        features = x.shape[-1]
        x = x + CausalSelfAttention(self.num_heads, self.dropout, self.dtype, self.attention_impl, self.decode,
                                    self.kv_store, name="attn")(
            nn.LayerNorm(dtype=self.dtype)(x), train, start)
        y = nn.Dense(self.mlp_ratio * features, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        y = nn.Dense(features, dtype=self.dtype)(nn.gelu(y))
        return x + nn.Dropout(self.dropout, deterministic=not train)(y)


#: ``remat`` values: what a block's backward pass may keep of its forward pass.
Remat = Literal["none", "full", "dots"]
_REMAT_POLICIES = {"full": None,  # keep nothing: recompute the whole block
                   "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}  # keep the Dense outputs


def _block_class(remat: str) -> type:
    """``TransformerBlock``, or it under ``nn.remat`` with the policy ``remat`` names."""
    if remat == "none":
        return TransformerBlock
    return nn.remat(TransformerBlock, policy=_REMAT_POLICIES[remat], static_argnums=(2,))  # (self, x, train)


class _ScannedBlock(nn.Module):
    """One step of ``nn.scan`` over identical blocks: ``(x, start) -> (block(x), None)`` (``start``:
    the decode position, the same for every block)."""

    block: dict  # TransformerBlock's fields
    remat: str
    train: bool

    @nn.compact
    def __call__(self, x: jax.Array, start: Any) -> tuple[jax.Array, None]:
        return _block_class(self.remat)(**self.block, name="block")(x, self.train, start), None


class GPT(nn.Module):
    """Token and position embeddings, ``num_layers`` Transformer blocks, a final
    LayerNorm and a linear head over the vocabulary.

    ``scan_layers`` runs the blocks as one ``nn.scan`` over stacked params
    (``blocks/block/...`` with a leading layer axis): one block to compile
    whatever the depth. ``remat`` recomputes each block's forward pass in its
    backward pass: ``full`` keeps nothing, ``dots`` keeps the Dense outputs.
    """

    vocab_size: int = 128
    block_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    dtype: Any = None  # every layer's computation dtype, the way Flax examples pass it; None: inputs'/params'
    attention_impl: str | None = None  # None (automatic), "xla" or "cudnn": see causal_attention
    scan_layers: bool = False
    remat: Remat = "none"
    decode: bool = False  # generation: keys and values cached in the "cache" collection (train.models.kv_cache)
    kv_store: Any = None  # how the cache stores them (a kv_cache.KVStore; None: as computed)

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.remat not in typing.get_args(Remat):
            raise ValueError(f"remat must be one of {typing.get_args(Remat)}, got {self.remat!r}")
        length = tokens.shape[1]
        if length > self.block_size:
            raise ValueError(f"sequence length {length} exceeds block_size {self.block_size}")
        x = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype, name="tokens")(tokens)
        positions = cache_position(self, length) if self.decode else jnp.arange(length)
        start = positions[0] if self.decode else None  # the position every layer's cache writes at
        x = x + nn.Embed(self.block_size, self.d_model, dtype=self.dtype, name="positions")(positions)[None]
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        block = {"num_heads": self.num_heads, "mlp_ratio": self.mlp_ratio, "dropout": self.dropout,
                 "dtype": self.dtype, "attention_impl": self.attention_impl}
        if self.decode:
            block |= {"decode": True, "kv_store": self.kv_store}
        if self.scan_layers:
            layers = nn.scan(_ScannedBlock, variable_axes={"params": 0, "cache": 0},
                             split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast, length=self.num_layers)
            x, _ = layers(block, self.remat, train, name="blocks")(x, start)
        else:
            for i in range(self.num_layers):
                x = _block_class(self.remat)(**block, name=f"block_{i}")(x, train, start)
        return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(nn.LayerNorm(dtype=self.dtype, name="ln_f")(x))
