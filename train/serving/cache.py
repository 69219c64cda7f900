"""Decoding with a KV cache, for the models people write; without one for the rest.

A :class:`Decoder` runs the served model on ``n`` tokens at position ``index`` with a cache,
returning their float32 logits and the cache updated: the prompt is one call, each new token
a call of shape ``(batch, 1)``, so one compiled step serves every token. Which cache:

- **this project's GPT** (:class:`train.models.GPT`): cloned with ``decode=True`` and a
  :class:`~train.models.kv_cache.KVStore` for ``--kv-dtype`` (arrays, or int8/fp8 codes
  with scales, :mod:`train.serving.kv_store`); the prompt in one call;
- **Hugging Face Flax causal LMs** (``train.weights.huggingface:model``, an architecture
  whose module takes ``init_cache``): their own ``cache`` collection (``past_key_values``),
  made by ``init_cache``, called as ``generate`` calls them
  (:meth:`train.weights.huggingface.TokenIds.with_cache`); the prompt in one call;
- **Linen models written with Flax's** ``decode`` **convention** (a ``decode`` field, and
  attention such as ``nn.MultiHeadDotProductAttention(decode=...)`` keeping its ``cache``
  collection, as Flax's lm1b example writes them): cloned with ``decode=True``, the cache
  made by ``init`` on a batch of its full length; such attention takes one token a call,
  so the prompt is a ``lax.scan`` of single-token calls, in one program;
- **any other model**: no cache. The tokens so far sit in a buffer of the full length and
  each call runs the model on all of it (a causal model's outputs at a position do not
  depend on later ones), taking the logits where the new tokens are: the same shapes every
  call, the cost of the whole prefix every token.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import precision
from train.models.gpt import GPT
from train.serving.kv_store import KV_DTYPES, is_quantized_kv, kv_store
from train.serving.tokenizer import SampleError
from train.serving.weights import ServedWeights, materialized, model_reads
from train.training.binding import mode_kwargs
from train.weights.huggingface import TokenIds

__all__ = ["Decoder", "decoder_for", "CACHE_KINDS"]

_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

#: What each kind of decoder is, for the end line.
CACHE_KINDS = {"gpt": "KV cache (this project's GPT)", "huggingface": "KV cache (the Hugging Face model's own)",
               "linen": "KV cache (the model's Flax decode cache)",
               "none": "no KV cache (the whole prefix each token), token ids"}


class Decoder(NamedTuple):
    """``init(batch, length)``: the empty cache (arrays) for ``length`` positions;
    ``forward(params, cache, tokens, index)``: logits ``(batch, n, vocab)`` in float32 of the
    ``n`` tokens at positions ``index ..``, and the cache with them (pure: jit it);
    ``call(params, cache, tokens, index)``: that call as ``(model, args, variables, kwargs)``,
    the bound model's one ``apply`` (the first token's, for a scan), for the doctor."""

    kind: str
    kv: str  # --kv-dtype, or "" without a cache
    init: Callable[[int, int], Any]
    forward: Callable[[Any, Any, jax.Array, jax.Array], tuple[jax.Array, Any]]
    call: Callable[[Any, Any, jax.Array, jax.Array], tuple[Any, tuple, dict, dict]]

    @property
    def cached(self) -> bool:
        return self.kind != "none"

    def describe(self) -> str:
        return CACHE_KINDS[self.kind] + (f" in {self.kv}" if self.kv else "")


def decoder_for(module: Any, served: ServedWeights, kv: str, state: dict | None = None,
                cache: bool = True) -> Decoder:
    """The decoder of ``module`` (the trained model, unbound) serving ``served``, its cache in
    ``kv`` (a ``--kv-dtype`` key); ``cache=False``: the one without a cache, whatever the model."""
    state = state or {}
    quantized = is_quantized_kv(kv)
    if not cache:
        decoder = _uncached(module, served, state)
    elif isinstance(module, GPT):
        decoder = _gpt(module, served, kv, state)
    elif isinstance(module, TokenIds) and "init_cache" in inspect.signature(module.module_class.__call__).parameters:
        _refuse_quantized(quantized, kv, "a Hugging Face model keeps its own cache, of arrays")
        decoder = _huggingface(module, served, kv, state)
    elif isinstance(module, nn.Module) and "decode" in {f.name for f in dataclasses.fields(module)}:
        _refuse_quantized(quantized, kv, f"{type(module).__name__} keeps its own Flax decode cache, of arrays")
        decoder = _linen(module, served, kv, state)
    else:
        decoder = _uncached(module, served, state)
    _record_structure(decoder, served.params)
    return decoder._replace(forward=_never_differentiated(decoder.forward))


def _never_differentiated(forward: Callable) -> Callable:
    """``forward``, traced under :func:`precision.forward_only`: serving takes no gradient, so
    autocast may fuse an attention cuDNN can only run forward (a decode step's one query)."""
    def traced(*args):
        with precision.forward_only():
            return forward(*args)

    return traced


def _record_structure(decoder: Decoder, params: Any) -> None:
    """Has the bound model record its module structure (for the rules) on float32 params and
    cache, abstractly, as autocast traces it: a model writing its keys into a half cache
    without casting them (Hugging Face's, Flax's attention) cannot be traced in the served dtypes."""
    def as_f32(tree):  # half arrays as float32; codes (int8, fp8) as they are
        return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(
            s.shape, jnp.float32 if np.dtype(s.dtype) in _HALF else s.dtype), tree)

    def record(params, cache):
        model, args, variables, kwargs = decoder.call(params, cache, jnp.zeros((1, 1), jnp.int32), jnp.int32(0))
        if hasattr(model, "cast_params"):
            model.cast_params(variables, *args, mutable=[k for k in variables if k != "params"] or False, **kwargs)

    jax.eval_shape(record, as_f32(jax.eval_shape(materialized, params)),
                   as_f32(jax.eval_shape(lambda: decoder.init(1, 2))))


def _refuse_quantized(quantized: bool, kv: str, why: str) -> None:
    if quantized:
        raise SampleError(f"--kv-dtype {kv}: {why}; give bf16, f16 or f32 (int8 and fp8 caches are this "
                          f"project's GPT's)")


def _gpt(module: GPT, served: ServedWeights, kv: str, state: dict) -> Decoder:
    decoding = module.clone(decode=True, kv_store=kv_store(kv), remat="none")
    bound, mode = served.bind(decoding), mode_kwargs(decoding, False)

    def forward(params, cache, tokens, index):
        del index  # the cache counts its positions
        out, updated = bound.apply({"params": model_reads(params), **state, "cache": cache}, tokens,
                                   mutable=["cache"], **mode)
        return _logits(out), updated["cache"]

    def call(params, cache, tokens, index):
        return bound, (tokens,), {"params": params, **state, "cache": cache}, mode

    return Decoder("gpt", kv, _made_by_init(decoding, mode, None), forward, call)


def _huggingface(module: TokenIds, served: ServedWeights, kv: str, state: dict) -> Decoder:
    bound = served.bind(module)

    def init(batch: int, length: int) -> Any:
        ids = jnp.zeros((batch, length), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
        shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), ids, positions, jnp.ones_like(ids), True,
                                                    method=TokenIds.with_cache))["cache"]
        return _zeros(shapes, kv)

    def call(params, cache, tokens, index):
        positions = jnp.broadcast_to(index + jnp.arange(tokens.shape[1]), tokens.shape)
        mask = jnp.ones((tokens.shape[0], _cache_length(cache)), jnp.int32)
        return (bound, (tokens, positions, mask), {"params": params, **state, "cache": cache},
                {"method": TokenIds.with_cache})

    def forward(params, cache, tokens, index):
        model, args, variables, kwargs = call(model_reads(params), cache, tokens, index)
        out, updated = model.apply(variables, *args, mutable=["cache"], **kwargs)
        return _logits(out), updated["cache"]

    return Decoder("huggingface", kv, init, forward, call)


def _linen(module: nn.Module, served: ServedWeights, kv: str, state: dict) -> Decoder:
    decoding = module.clone(decode=True)
    bound, mode = served.bind(decoding), mode_kwargs(decoding, False)

    def forward(params, cache, tokens, index):
        del index
        weights = model_reads(params)

        def one(cache, token):
            out, updated = bound.apply({"params": weights, **state, "cache": cache}, token[:, None],
                                       mutable=["cache"], **mode)
            return updated["cache"], _logits(out)[:, 0]

        cache, logits = jax.lax.scan(one, cache, tokens.T)
        return jnp.swapaxes(logits, 0, 1), cache

    def call(params, cache, tokens, index):
        return bound, (tokens[:, :1],), {"params": params, **state, "cache": cache}, mode

    return Decoder("linen", kv, _made_by_init(decoding, mode, kv), forward, call)


def _uncached(module: Any, served: ServedWeights, state: dict) -> Decoder:
    bound = served.bind(module)
    mode = mode_kwargs(bound, False)

    def init(batch: int, length: int) -> Any:
        return {"tokens": jnp.zeros((batch, length), jnp.int32)}

    def call(params, cache, tokens, index):
        buffer = jax.lax.dynamic_update_slice_in_dim(cache["tokens"], tokens.astype(jnp.int32), index, axis=1)
        return bound, (buffer,), {"params": params, **state}, mode

    def forward(params, cache, tokens, index):
        model, (buffer,), variables, kwargs = call(model_reads(params), cache, tokens, index)
        out = model.apply(variables, buffer, **kwargs)
        return jax.lax.dynamic_slice_in_dim(_logits(out), index, tokens.shape[1], axis=1), {"tokens": buffer}

    return Decoder("none", "", init, forward, call)


def _made_by_init(decoding: nn.Module, mode: dict, kv: str | None) -> Callable[[int, int], Any]:
    """``init(batch, length)`` of a Linen model with ``decode=True``: its ``cache`` collection as
    ``init`` makes it on a batch of that length (abstractly), zeros; floating arrays in ``kv``
    (None: the dtypes the model's store gave them)."""
    def init(batch: int, length: int) -> Any:
        key = jax.random.key(0)
        tokens = jnp.zeros((batch, length), jnp.int32)
        shapes = jax.eval_shape(lambda: decoding.init({"params": key, "dropout": key}, tokens, **mode))["cache"]
        return _zeros(shapes, kv)

    return init


def _zeros(shapes: Any, kv: str | None) -> Any:
    floating = np.dtype(KV_DTYPES[kv]) if kv else None

    def zeros(s):
        dtype = floating if floating is not None and jnp.issubdtype(s.dtype, jnp.floating) else s.dtype
        return jnp.zeros(s.shape, dtype)

    return jax.tree_util.tree_map(zeros, shapes)


def _cache_length(cache: Any) -> int:
    """The positions a cache holds: the second axis of its ``(batch, length, heads, head_dim)`` arrays."""
    return next(x.shape[1] for x in jax.tree_util.tree_leaves(cache) if np.ndim(x) >= 3)


def _logits(out: Any) -> jax.Array:
    """The logits of a model's output (an array, a ``ModelOutput``'s ``logits``, a tuple's first)."""
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return jnp.asarray(out, jnp.float32)
