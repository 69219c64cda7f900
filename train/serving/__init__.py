"""Serving what a run trained: text generation with a KV cache, in half precision and int8.

``python -m train sample PATH --prompt TEXT`` (:mod:`train.serving.cli`) and
:func:`train.generate`: a run, an export or a Hugging Face directory (:mod:`.source`), its
weights in ``--dtype`` with the run's float32 islands (:mod:`.weights`), a KV cache in
``--kv-dtype`` for this project's GPT, Hugging Face Flax causal LMs and Linen models written
with Flax's ``decode`` convention (:mod:`.cache`, :mod:`.kv_store`), the prompt in one
compiled pass and each token in one compiled step (:mod:`.generation`), sampling in float32
(:mod:`.sampling`).

May import :mod:`precision` and every package of train below :mod:`train.cli` (docs/design.md).
"""

from train.serving.generation import Generation, Generator, generate
from train.serving.sampling import Sampling
from train.serving.source import Source, load_source
from train.serving.tokenizer import SampleError

__all__ = ["Generation", "Generator", "Sampling", "SampleError", "Source", "generate", "load_source"]
