"""The loss from large logits computed a block of rows at a time, on unmodified models.

A language model's loss reads its whole ``[tokens, vocabulary]`` logits: in float32 at
GPT-2's vocabulary and 16 x 1024 tokens, 3.3 GB, and as much again for their gradient.
:func:`blockwise_loss` transforms a function (a train step's forward and loss): where
its traced program makes logits with a matmul and computes a loss from them row by row
(softmax cross-entropy as optax, Flax or :func:`precision.cross_entropy` write it, label
smoothing, a z-loss, masks; :mod:`.rows` proves each op keeps rows apart), that part
runs as a scan over blocks of rows, each block's logits made in the compute dtype,
reduced in float32 and dropped, and made again in the backward pass. Anything else (the
logits also returned, or kept) is left as written. :func:`plan` says what it would do.

Modules: :mod:`.program` (a traced program as a flat list, and its evaluation),
:mod:`.region` (the head matmul and the loss region), :mod:`.rows` (the proof, op by
op, that the region keeps rows apart), :mod:`.transform` (the blocks).
"""

from precision.blockwise.transform import (AUTO_MIN_LOGITS_BYTES, BLOCK_BYTES, MIN_LOGITS_BYTES, Plan, blockwise_loss,
                                           min_logits_bytes, plan)

__all__ = ["AUTO_MIN_LOGITS_BYTES", "BLOCK_BYTES", "MIN_LOGITS_BYTES", "Plan", "blockwise_loss", "min_logits_bytes",
           "plan"]
