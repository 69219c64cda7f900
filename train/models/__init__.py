"""Plain Flax Linen models. None of them contains precision code: a policy is
applied from outside with :func:`precision.with_policy`.

Every model takes ``(inputs, train: bool)`` and returns logits.
"""

from train.models.gpt import GPT, CausalSelfAttention, Softmax, TransformerBlock
from train.models.mlp import MLP
from train.models.resnet import ResidualBlock, ResNet

#: Model names usable in a config's ``model.name``.
MODELS = {"mlp": MLP, "resnet": ResNet, "gpt": GPT}

__all__ = ["MODELS", "MLP", "ResNet", "ResidualBlock", "GPT", "CausalSelfAttention", "Softmax",
           "TransformerBlock"]
