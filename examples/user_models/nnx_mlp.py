"""A user's NNX model, written the way the Flax NNX docs write them: no
precision code, no ``train`` keyword (dropout and BatchNorm follow
``model.train()`` / ``model.eval()``), an ``nnx.Rngs`` in the constructor.

    python -m train examples/user_models/nnx_mlp.yaml
"""

from flax import nnx


class MLP(nnx.Module):
    def __init__(self, in_features: int, num_classes: int, hidden: int = 128, dropout: float = 0.1, *,
                 rngs: nnx.Rngs):
        self.hidden = nnx.Linear(in_features, hidden, rngs=rngs)
        self.norm = nnx.BatchNorm(hidden, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(hidden, num_classes, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nnx.relu(self.norm(self.hidden(x))))
        return self.out(x)
