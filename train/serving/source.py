"""What ``python -m train sample PATH`` serves: a run, an export of one, or a Hugging Face directory.

- **a run** of this framework (``config.yaml`` and ``checkpoints/``): its newest weights as
  ``python -m train export`` reads them (float32 masters, a quantized base read back, LoRA
  adapters merged: :func:`train.inspections.export.merged_run`), its model and data from
  its config; a base in codes also as stored, adapters unmerged (``--dtype nf4``:
  :mod:`train.serving.stored_base`);
- **an export** (``params.safetensors`` and ``export.json``; an int8 one read back): the
  weights it holds, and the model and data of the run it came from (``export.json`` names it);
- **a Hugging Face directory** (``config.json`` and Flax weights, ``save_pretrained``'s or an
  export of a run on one): the Flax module its config names, its weights, the tokenizer
  saved beside it.

The float32 islands the weights keep when served are the run's precision rules (norms by
default), as for ``export``. The tokenizer is the run's character vocabulary, or the Hugging
Face tokenizer beside the model. A run that is not a language model is refused in one line.
"""

from __future__ import annotations

import json
import os
import types
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from flax import traverse_util

from train.config import ConfigError, load_run_config
from train.data import DataError
from train.experiment.builders import build_experiment
from train.inspections.export import ExportError, export_rules, merged_run
from train.models.gpt import GPT
from train.serving.stored_base import StoredBase, stored_base
from train.serving.tokenizer import CharTokenizer, SampleError, huggingface_tokenizer
from train.weights import huggingface
from train.weights.export import MANIFEST, PARAMS_FILE
from train.weights.pretrained import PretrainedError, load_pretrained

__all__ = ["Source", "load_source"]

#: What a Hugging Face directory's weights keep in float32 when served: the default rules' norms.
_DEFAULT_PRECISION = types.SimpleNamespace(policy="mixed_bf16", rules=None)
#: Architectures whose output is the next token's logits.
_CAUSAL_LM = ("LMHead", "ForCausalLM")


class Source(NamedTuple):
    """A model to serve: the (unbound) ``model``, its float32 ``params`` (nested dicts of numpy
    arrays) and other collections (``state``), ``rules(dtype)`` (its float32 islands served in
    ``dtype``), its ``tokenizer``, ``context`` (positions it was made for; None: unknown, and
    what says so), the run's ``data`` (None for a Hugging Face directory) and ``step``; ``base``:
    the weights as a run fine-tuned on a base in codes stored them (``--dtype nf4``), else None."""

    path: str
    kind: str  # "run", "export" or "huggingface"
    model: Any
    params: Any
    state: dict
    rules: Callable[[str], tuple]
    tokenizer: Any
    context: int | None
    context_from: str
    data: Any
    step: int | None
    base: StoredBase | None = None

    def describe(self) -> str:
        step = f" (step {self.step})" if self.step is not None else ""
        return f"{type(self.model).__name__} from {'the ' + self.kind if self.kind != 'huggingface' else 'the Hugging Face directory'} {self.path}{step}"


def load_source(path: str | os.PathLike) -> Source:
    """The model ``path`` holds (a run, an export or a Hugging Face directory), ready to serve.

    Raises:
      SampleError: ``path`` holds none of them, is not a language model, or has no tokenizer.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isdir(path):
        raise SampleError(f"{path} is not a run, an export or a Hugging Face directory: it "
                          f"{'is a file' if os.path.exists(path) else 'does not exist'}")
    if os.path.isfile(os.path.join(path, PARAMS_FILE)):
        return _export(path)
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "config.yaml")):
        return _huggingface(path)
    if not os.path.isfile(os.path.join(path, "config.yaml")):
        raise SampleError(f"{path} is not a run (no config.yaml), an export (no {PARAMS_FILE}) or a Hugging Face "
                          f"directory (no config.json)")
    try:
        run = merged_run(path)
    except ExportError as e:
        raise SampleError(str(e)) from None
    _check_language_model(run.task, run.data, path)
    params = traverse_util.unflatten_dict({k: np.asarray(v, np.float32) if _floating(v) else np.asarray(v)
                                           for k, v in run.params.items()})
    return _from_run(path, "run", run.config, run.data, run.model, params, run.state, run.step)._replace(
        base=stored_base(run))


def _export(path: str) -> Source:
    """An export of a framework model: its weights, and the model and data of its run."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            run_dir = json.load(f)["source"]
    except (OSError, ValueError, KeyError, TypeError):
        raise SampleError(f"{path}: an export without a readable {MANIFEST} naming its run; sample needs the run's "
                          f"config.yaml for the model") from None
    if not os.path.isfile(os.path.join(run_dir, "config.yaml")):
        raise SampleError(f"{path}: the run it was exported from, {run_dir} ({MANIFEST}), has no config.yaml; "
                          f"sample needs it for the model")
    try:
        config = load_run_config(run_dir)
        data, task, model = build_experiment(config, memory=(0, "here"))
        variables, _ = load_pretrained(path)
    except (ConfigError, DataError, PretrainedError) as e:
        raise SampleError(f"{path}: {e}") from None
    _check_language_model(task, data, path)
    state = {k: v for k, v in variables.items() if k != "params"}
    return _from_run(path, "export", config, data, model, variables["params"], state, None)


def _from_run(path: str, kind: str, config: Any, data: Any, model: Any, params: Any, state: dict,
              step: int | None) -> Source:
    tokenizer = None
    if isinstance(model, huggingface.TokenIds):
        tokenizer = huggingface_tokenizer(config.model.options["path"])
    if tokenizer is None and getattr(data, "vocab", None):
        tokenizer = CharTokenizer(data.vocab)
    if tokenizer is None:
        raise SampleError(f"{path}: no tokenizer: its data has no vocabulary and its model no tokenizer files beside "
                          f"it")
    context, where = _context(model)
    return Source(path, kind, model, params, state, lambda dtype: export_rules(config.precision, dtype), tokenizer,
                  context, where, data, step)


def _huggingface(path: str) -> Source:
    try:
        model = huggingface.model(path)
        found = huggingface.read_weights(path)
    except (ConfigError, ValueError) as e:
        raise SampleError(str(e)) from None
    architecture = model.module_class.__name__.removeprefix("Flax").removesuffix("Module")
    if not architecture.endswith(_CAUSAL_LM):
        raise SampleError(f"{path}: {architecture} is not a causal language model; sample needs one whose output is "
                          f"the next token's logits (...LMHeadModel, ...ForCausalLM)")
    if found is None:
        raise SampleError(f"{path}: a config.json and no Flax weights")
    try:
        variables, _ = load_pretrained(path)  # float32, an int8 export read back
    except PretrainedError as e:
        raise SampleError(str(e)) from None
    tokenizer = huggingface_tokenizer(path)
    if tokenizer is None:
        raise SampleError(f"{path}: no tokenizer beside the model (tokenizer.json, or vocab.json and merges.txt...); "
                          f"save one there: tokenizer.save_pretrained({path!r})")
    state = {k: v for k, v in variables.items() if k != "params"}
    context, where = _context(model)
    return Source(path, "huggingface", model, variables["params"], state,
                  lambda dtype: export_rules(_DEFAULT_PRECISION, dtype), tokenizer, context, where, None, None)


def _check_language_model(task: Any, data: Any, path: str) -> None:
    if task.name != "language_model":
        raise SampleError(f"{path} is not a language model: its task is {task.name} (data {data.name}); sample "
                          f"generates text from a model trained to predict the next token (task language_model)")


def _context(model: Any) -> tuple[int | None, str]:
    """The positions ``model`` was made for, and the field saying so."""
    if isinstance(model, huggingface.TokenIds):
        for field in ("n_positions", "max_position_embeddings", "n_ctx"):
            if getattr(model.config, field, None):
                return int(getattr(model.config, field)), f"{field} in its config.json"
        return None, "its config.json names no context"
    for field in ("block_size", "max_len", "max_length", "seq_len"):
        value = getattr(model, field, None)
        if isinstance(value, int) and value > 0:
            return value, f"{field} of {'its position embeddings' if isinstance(model, GPT) else 'the model'}"
    return None, "the model names no context"


def _floating(x: Any) -> bool:
    return jax.numpy.issubdtype(np.asarray(x).dtype, jax.numpy.floating)


def sample_inputs(source: Source, batch: int = 1, length: int = 8) -> Any:
    """A batch of token ids (zeros) to trace ``source``'s model with."""
    length = min(length, source.context or length)
    return jax.numpy.zeros((batch, length), jax.numpy.int32)
