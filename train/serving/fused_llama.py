"""A Hugging Face Flax Llama's decode step on the fused kernels (``--decode-kernels fused``).

The models of its family: Mistral-style grouped queries, a SiLU-gated MLP, RMS norms, no
biases, plain rotary positions. A layer is five kernels (:mod:`train.serving.decode_kernels`,
:mod:`train.serving.decode_attention`): the norm, q/k/v and the rotary embedding; the
attention; o_proj and the residual; the norm, gate and up and ``silu(gate) * up``; down_proj
and the residual. The rotary table is the model's own (``create_sinusoidal_positions``,
Hugging Face Flax Llama's fixed theta included).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.serving import decode_kernels as kernels
from train.serving.decode_attention import attend
from train.serving.layout import ContractedLast

__all__ = ["refusal", "kernel_form", "widths", "step"]


def refusal(config: Any) -> str | None:
    """Why a Llama-family ``config`` cannot take the fused kernels, or None."""
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "the fused Llama kernels take no projection biases"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "rope_scaling", None):
        return "the fused Llama kernels take a SiLU MLP and plain rotary positions"
    if getattr(config, "tie_word_embeddings", False):
        return "the fused Llama kernels read an untied head (lm_head), not the embedding transposed"
    return None


def kernel_form(w: Any) -> Any:
    """A served ``Dense`` kernel's ``(out, in)`` form (serving stores it so), or None."""
    return w.stored if isinstance(w, ContractedLast) and w.order == (1, 0) else None


def widths(config: Any) -> tuple[int, ...]:
    """``(hidden, head width, the other widths)`` the kernels' blocks must fit."""
    hd = config.hidden_size // config.num_attention_heads
    return (config.hidden_size, hd, config.num_attention_heads * hd, config.num_key_value_heads * hd,
            config.intermediate_size, config.vocab_size)


def step(config: Any):
    """``(params, cache, tokens, index) -> (logits (B, 1, vocab), cache)``: one token a row at
    ``index``, the weights in their ``(out, in)`` forms. Each kernel is named for the modules it
    does (``model/layers/N/...``: profiles and ``--compile-for``)."""
    hd = config.hidden_size // config.num_attention_heads
    table = _rotary_table(config.max_position_embeddings, hd)

    def run(params, cache, tokens, index):
        model = params["model"]
        x = jnp.take(model["embed_tokens"]["embedding"], tokens, axis=0).astype(jnp.float32)
        sincos = jnp.asarray(table)[index]
        layers, after = dict(cache["model"]["layers"]), (index + 1).astype(jnp.int32)  # every layer's cache_index
        for name in sorted(model["layers"], key=int):
            x, layers[name] = _layer(config, f"model/layers/{name}", model["layers"][name],
                                     layers[name]["self_attn"], x, sincos, index)
            layers[name]["self_attn"]["cache_index"] = after
        with jax.named_scope("model/norm+lm_head"):
            logits = kernels.norm_gemv(x, _norm(config, model["norm"]), params["lm_head"]["kernel"])
        return logits[:, None, :], {"model": {"layers": layers}}

    return run


def _norm(config: Any, p: dict) -> kernels.Norm:
    return kernels.Norm("rms", p["weight"], eps=config.rms_norm_eps)


def _layer(config: Any, scope: str, p: dict, cache: dict, x, sincos, index):
    """One decoder layer on the residual rows ``x`` ``(B, d)`` float32: the rows after it, and its cache."""
    attn, mlp = p["self_attn"], p["mlp"]
    with jax.named_scope(f"{scope}/input_layernorm+self_attn/qkv+rotary_emb"):
        qkv = kernels.norm_qkv(x, _norm(config, p["input_layernorm"]), attn["q_proj"]["kernel"],
                               attn["k_proj"]["kernel"], attn["v_proj"]["kernel"], sincos)
    with jax.named_scope(f"{scope}/self_attn"):
        out, keys, values = attend(qkv, cache["cached_key"], cache["cached_value"], index,
                                   config.num_attention_heads)
    with jax.named_scope(f"{scope}/self_attn/o_proj+residual"):
        x = kernels.gemv_add(out, attn["o_proj"]["kernel"], x)
    with jax.named_scope(f"{scope}/post_attention_layernorm+mlp/gate_proj+up_proj"):
        act = kernels.norm_swiglu(x, _norm(config, p["post_attention_layernorm"]), mlp["gate_proj"]["kernel"],
                                  mlp["up_proj"]["kernel"])
    with jax.named_scope(f"{scope}/mlp/down_proj+residual"):
        x = kernels.gemv_add(act, mlp["down_proj"]["kernel"], x)
    return x, {"self_attn": {"cached_key": keys, "cached_value": values}}


def _rotary_table(positions: int, head_dim: int) -> np.ndarray:
    """``(positions, head_dim)``: the sines then the cosines of each position's ``head_dim / 2``
    angles, as the model makes them (``create_sinusoidal_positions``: its frequencies repeat
    over the two halves of a head)."""
    from transformers.models.llama.modeling_flax_llama import create_sinusoidal_positions

    sincos = np.asarray(create_sinusoidal_positions(positions, head_dim))[:, 0, :]
    return np.concatenate([sincos[:, :head_dim // 2], sincos[:, head_dim:head_dim + head_dim // 2]], axis=1)
