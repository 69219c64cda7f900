"""Training itself, for any loop: a model bound to a policy, its train state, the jitted
steps, losses, checkpoints.

- :mod:`.binding`: any Flax model (Linen or NNX) under a policy as ``init`` / ``apply``;
- :mod:`.state` (``TrainState``, ``create_train_state``), :mod:`.step` (train and eval
  steps, accumulation, several steps per call), :mod:`.forward` (a step's forward and loss,
  the loss from large logits in blocks of rows), :mod:`.tasks` (losses and metrics);
- :mod:`.checkpoint` (Orbax, bit-exact resume), :mod:`.inference` (half-precision
  serving), :mod:`.tree_paths`.

- :mod:`.diagnose`: a train state and batch diagnosed by :func:`precision.diagnose`.

May import :mod:`precision`, :mod:`train.references`, :mod:`train.parallel`,
:mod:`train.data`, :mod:`train.config` and :mod:`train.weights` (docs/design.md).
"""
