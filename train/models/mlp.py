"""A multilayer perceptron for flat or image inputs."""

from typing import Sequence

import flax.linen as nn
import jax


class MLP(nn.Module):
    """Dense layers with ReLU (and LayerNorm) between them; inputs are flattened."""

    hidden: Sequence[int] = (256, 256)
    num_classes: int = 10
    layer_norm: bool = True
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.Dense(width)(x)
            if self.layer_norm:
                x = nn.LayerNorm()(x)
            x = nn.relu(x)
            if self.dropout:
                x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)
