"""A Llama's decode step in five kernels a layer (``--decode-kernels fused``).

Hugging Face's Flax Llama (and the models of its family: Mistral-style grouped queries, a
SiLU-gated MLP, RMS norms, no biases) decodes through its own modules: XLA makes about
twenty kernels of each layer. :func:`fused_decoder` wraps the model's decoder
(:mod:`train.serving.cache`) so that a step of one token runs the layers on
:mod:`train.serving.decode_kernels` instead, on the same weights and the same cache (the
model's ``cached_key``, ``cached_value`` and ``cache_index`` per layer): the prompt still
goes through the model's own modules, and a cache either wrote the other reads.

Its numerics are the model's in the served dtype: weights, normed activations and the
projections' results rounded to it, sums in float32, the residual stream and the softmax
in float32, the rotary table the model's own (``create_sinusoidal_positions``, its quirks
included). :func:`fused_refusal` says why a model or a batch cannot take it (the step
then runs the model's modules, as with ``xla``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax import traverse_util

from precision.channel_weights import is_channel_int8
from train.serving import decode_kernels as kernels
from train.serving.layout import ContractedLast, is_stored_weight

__all__ = ["DECODE_KERNELS", "fused_refusal", "fused_decoder"]

#: ``--decode-kernels``: the model's own modules compiled by XLA, or the fused kernels.
DECODE_KERNELS = ("xla", "fused")
_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def fused_refusal(module: Any, params: Any, batch: int = 1) -> str | None:
    """Why ``module`` (the served model) at ``batch`` rows cannot decode with the fused
    kernels, or None when it can."""
    config = getattr(module, "config", None)
    if getattr(config, "model_type", None) not in ("llama", "mistral"):
        return (f"the fused decode kernels are written for Llama-family Hugging Face models; "
                f"{type(module).__name__} is not one")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "the fused decode kernels take no projection biases"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "rope_scaling", None):
        return "the fused decode kernels take a SiLU MLP and plain rotary positions"
    if getattr(config, "tie_word_embeddings", False):
        return "the fused decode kernels read an untied head (lm_head), not the embedding transposed"
    flat = traverse_util.flatten_dict(params, is_leaf=lambda _, x: is_stored_weight(x))
    for path, w in flat.items():
        if path[-1] == "kernel" and not _stored_nk(w):
            return (f"the fused decode kernels read weights stored (out, in), as float arrays or int8 with a "
                    f"scale a row; {'/'.join(path)} is {type(w).__name__}")
    return _shape_refusal(config, batch)


def _shape_refusal(config: Any, batch: int) -> str | None:
    """Why the kernels' blocks do not fit ``config``'s widths at ``batch`` rows, or None."""
    hd = config.hidden_size // config.num_attention_heads
    widths = (config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size,
              config.vocab_size)
    if kernels.fits(batch, config.hidden_size, hd, *widths):
        return None
    return (f"the fused decode kernels need the batch and the head width powers of two (a head at least 16) and "
            f"every width a multiple of 16: batch {batch}, head {hd}, widths {config.hidden_size}, {widths}")


def fused_decoder(decoder: Any, module: Any) -> Any:
    """``decoder`` (a Hugging Face Llama's, :class:`train.serving.cache.Decoder`) with its
    one-token steps on the fused kernels (the model checked by :func:`fused_refusal` beforehand);
    batches the kernels' blocks do not fit, and prompts,
    go through the model's modules."""
    config = module.config
    inner = decoder.forward
    hd = config.hidden_size // config.num_attention_heads
    table = _rotary_table(config.max_position_embeddings, hd)

    def forward(params, cache, tokens, index):
        if tokens.shape[1] != 1 or _shape_refusal(config, tokens.shape[0]):  # the model: refused at init
            return inner(params, cache, tokens, index)
        return _step(config, table, _nk(params), cache, tokens[:, 0], index)

    return decoder._replace(forward=forward)


def _stored_nk(w: Any) -> bool:
    if not isinstance(w, ContractedLast) or w.order != (1, 0):
        return False
    w = w.stored
    return is_channel_int8(w) or np.dtype(w.dtype) in _FLOATS


def _rotary_table(positions: int, head_dim: int) -> np.ndarray:
    """``(positions, head_dim)``: the sines then the cosines of each position's ``head_dim / 2``
    angles, as the model makes them (``create_sinusoidal_positions``: its frequencies repeat
    over the two halves of a head)."""
    from transformers.models.llama.modeling_flax_llama import create_sinusoidal_positions

    sincos = np.asarray(create_sinusoidal_positions(positions, head_dim))[:, 0, :]
    return np.concatenate([sincos[:, :head_dim // 2], sincos[:, head_dim:head_dim + head_dim // 2]], axis=1)


def _nk(params: Any) -> Any:
    """The served weights with each projection's ``(out, in)`` stored form (array or int8 codes)."""
    return jax.tree_util.tree_map(lambda w: w.stored if isinstance(w, ContractedLast) else w, params,
                                  is_leaf=lambda x: isinstance(x, ContractedLast))


def _step(config: Any, table: np.ndarray, params: dict, cache: dict, tokens: jax.Array, index: jax.Array):
    """Logits ``(B, 1, vocab)`` of one token a row at ``index``, and the cache with it. Each
    kernel is named for the modules it does (``model/layers/N/...``: profiles and ``--compile-for``)."""
    eps, heads = config.rms_norm_eps, config.num_attention_heads
    model = params["model"]
    x = jnp.take(model["embed_tokens"]["embedding"], tokens, axis=0).astype(jnp.float32)
    sincos = jnp.asarray(table)[index]
    layers, after = dict(cache["model"]["layers"]), (index + 1).astype(jnp.int32)  # every layer's cache_index
    for name in sorted(model["layers"], key=int):
        p, c = model["layers"][name], layers[name]["self_attn"]
        attn, mlp = p["self_attn"], p["mlp"]
        with jax.named_scope(f"model/layers/{name}/input_layernorm+self_attn/qkv+rotary_emb"):
            qkv = kernels.norm_qkv(x, p["input_layernorm"]["weight"], attn["q_proj"]["kernel"],
                                   attn["k_proj"]["kernel"], attn["v_proj"]["kernel"], sincos, eps)
        with jax.named_scope(f"model/layers/{name}/self_attn"):
            out, keys, values = kernels.attend(qkv, c["cached_key"], c["cached_value"], index, heads)
        with jax.named_scope(f"model/layers/{name}/self_attn/o_proj+residual"):
            x = kernels.gemv_add(out, attn["o_proj"]["kernel"], x)
        with jax.named_scope(f"model/layers/{name}/post_attention_layernorm+mlp/gate_proj+up_proj"):
            act = kernels.norm_swiglu(x, p["post_attention_layernorm"]["weight"], mlp["gate_proj"]["kernel"],
                                      mlp["up_proj"]["kernel"], eps)
        with jax.named_scope(f"model/layers/{name}/mlp/down_proj+residual"):
            x = kernels.gemv_add(act, mlp["down_proj"]["kernel"], x)
        layers[name] = {"self_attn": {"cached_key": keys, "cached_value": values, "cache_index": after}}
    with jax.named_scope("model/norm+lm_head"):
        logits = kernels.norm_gemv(x, model["norm"]["weight"], params["lm_head"]["kernel"], eps)
    return logits[:, None, :], {"model": {"layers": layers}}
