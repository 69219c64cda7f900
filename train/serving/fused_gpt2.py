"""A Hugging Face Flax GPT-2's decode step on the fused kernels (``--decode-kernels fused``).

A layer is five kernels (:mod:`train.serving.decode_kernels`,
:mod:`train.serving.decode_attention`): ``ln_1`` and ``c_attn`` (its bias added); the
attention; the attention's ``c_proj`` and the residual; ``ln_2``, ``c_fc`` and GELU (the tanh
approximation, ``gelu_new``); the MLP's ``c_proj`` and the residual. The embeddings (token
and learned position) and the head (``ln_f`` and the tied embedding, 50,257 rows: not a
block of the kernels) stay XLA's. The ``Conv1D`` kernels are stored ``(out, in)`` already,
as the kernels read them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from precision.channel_weights import dequantize_channels, is_channel_int8
from train.serving import decode_kernels as kernels
from train.serving.decode_attention import attend
from train.serving.layout import ContractedLast

__all__ = ["refusal", "kernel_form", "widths", "step"]

#: ``activation_function`` values that are the tanh approximation of GELU the kernels apply.
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def refusal(config: Any) -> str | None:
    """Why a GPT-2 ``config`` cannot take the fused kernels, or None."""
    if config.activation_function not in _TANH_GELU:
        return (f"the fused GPT-2 kernels apply GELU's tanh approximation ({', '.join(_TANH_GELU)}), "
                f"not {config.activation_function}")
    if getattr(config, "add_cross_attention", False):
        return "the fused GPT-2 kernels take a decoder without cross-attention"
    return None


def kernel_form(w: Any) -> Any:
    """A served kernel's ``(out, in)`` form: a ``Conv1D``'s as it is, an untied head's (a
    ``Dense``, stored so by serving) transposed back; None for another layout."""
    if isinstance(w, ContractedLast):
        return w.stored if w.order == (1, 0) else None
    return w


def widths(config: Any) -> tuple[int, ...]:
    """``(hidden, head width, the other widths)`` the kernels' blocks must fit (not the vocabulary:
    the head is XLA's)."""
    d = config.n_embd
    return d, d // config.n_head, 3 * d, config.n_inner or 4 * d


def step(config: Any):
    """``(params, cache, tokens, index) -> (logits (B, 1, vocab), cache)``: one token a row at
    ``index``, the weights in their ``(out, in)`` forms. Each kernel is named for the modules it
    does (``transformer/h/N/...``: profiles and ``--compile-for``)."""
    def run(params, cache, tokens, index):
        t = params["transformer"]
        token, position = t["wte"]["embedding"], t["wpe"]["embedding"]
        x = (jnp.take(token, tokens, axis=0) + position[index][None, :]).astype(jnp.float32)
        layers, after = dict(cache["transformer"]["h"]), (index + 1).astype(jnp.int32)
        for name in sorted(t["h"], key=int):
            x, layers[name] = _layer(config, f"transformer/h/{name}", t["h"][name], layers[name]["attn"], x, index)
            layers[name]["attn"]["cache_index"] = after
        with jax.named_scope("transformer/ln_f+lm_head"):
            logits = _head(config, params, x)
        return logits[:, None, :], {"transformer": {"h": layers}}

    return run


def _norm(config: Any, p: dict) -> kernels.Norm:
    return kernels.Norm("layer", p["scale"], p["bias"], config.layer_norm_epsilon)


def _layer(config: Any, scope: str, p: dict, cache: dict, x, index):
    """One block on the residual rows ``x`` ``(B, d)`` float32: the rows after it, and its cache."""
    attn, mlp = p["attn"], p["mlp"]
    with jax.named_scope(f"{scope}/ln_1+attn/c_attn"):
        qkv = kernels.norm_gemv(x, _norm(config, p["ln_1"]), attn["c_attn"]["kernel"], attn["c_attn"]["bias"])
    with jax.named_scope(f"{scope}/attn"):
        out, keys, values = attend(qkv, cache["cached_key"], cache["cached_value"], index, config.n_head)
    with jax.named_scope(f"{scope}/attn/c_proj+residual"):
        x = kernels.gemv_add(out, attn["c_proj"]["kernel"], x, attn["c_proj"]["bias"])
    with jax.named_scope(f"{scope}/ln_2+mlp/c_fc+act"):
        act = kernels.norm_gemv(x, _norm(config, p["ln_2"]), mlp["c_fc"]["kernel"], mlp["c_fc"]["bias"],
                                activation="gelu_tanh")
    with jax.named_scope(f"{scope}/mlp/c_proj+residual"):
        x = kernels.gemv_add(act, mlp["c_proj"]["kernel"], x, mlp["c_proj"]["bias"])
    return x, {"attn": {"cached_key": keys, "cached_value": values}}


def _head(config: Any, params: dict, x):
    """``ln_f`` and the head (the token embedding transposed, or an untied ``lm_head``), float32
    logits rounded to the head's dtype as the model's ``Dense`` gives them."""
    t = params["transformer"]
    w = t["wte"]["embedding"] if config.tie_word_embeddings else params["lm_head"]["kernel"]  # (vocab, d)
    w = dequantize_channels(w) if is_channel_int8(w) else w
    mean = jnp.mean(x, axis=-1, keepdims=True)
    normed = (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + config.layer_norm_epsilon)
    normed = normed * t["ln_f"]["scale"].astype(jnp.float32) + t["ln_f"]["bias"].astype(jnp.float32)
    logits = jnp.einsum("bd,vd->bv", normed.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return logits.astype(w.dtype).astype(jnp.float32)
