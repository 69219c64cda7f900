"""The project's GPT under qwix's quantized training, for ``benchmarks.int8``: the peer to
``mixed_int8`` that MaxText offers (``qwix.QtProvider`` with ``QtRule(act_qtype=int8,
weight_qtype=int8, bwd_qtype=int8)``), trained by the same CLI on the same data.

    python -m train configs/shakespeare_gpt_mixed_bf16.yaml model.name=benchmarks.qwix_models:QwixInt8GPT
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix

from train.models import GPT


def int8_provider() -> qwix.QtProvider:
    """Every dot_general and einsum in int8 forward (activations and weights) and backward (gradients)."""
    return qwix.QtProvider([qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8,
                                        bwd_qtype=jnp.int8)])


class QwixInt8GPT(nn.Module):
    """:class:`train.models.GPT` (the same keys) with qwix's int8 quantized training applied to it."""

    num_layers: int = 4
    num_heads: int = 4
    d_model: int = 128
    vocab_size: int = 128
    block_size: int = 128
    dropout: float = 0.0

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        gpt = GPT(vocab_size=self.vocab_size, block_size=self.block_size, num_layers=self.num_layers,
                  num_heads=self.num_heads, d_model=self.d_model, dropout=self.dropout, name="gpt")
        return qwix.quantize_model(gpt, int8_provider())(tokens, train=train)
