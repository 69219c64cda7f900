"""Hugging Face Flax models in this framework, and their weights read without transformers.

From YAML, a directory written by ``save_pretrained``::

    model:
      name: train.weights.huggingface:model   # the Flax module of the architecture DIR/config.json names
      path: DIR
      init_from: DIR                  # its weights (train.weights.pretrained)
      output: logits

:func:`model` builds the module (transformers is needed here, only here: the ``hf``
extra, ``transformers<5``, the last with Flax models) and wraps it in :class:`TokenIds`,
which calls it on token ids alone and shares its scope, so its parameter tree is the Hugging
Face one and checkpoints load as they are. Its ``dtype`` stays float32: the precision
policy's autocast sets what each op computes in.

:func:`read_weights` reads a directory's Flax weights (``flax_model.msgpack``, sharded or
not, or ``model.safetensors`` as Hugging Face Flax writes it, keys joined by dots) with
flax.serialization and safetensors; a directory holding only PyTorch or TensorFlow weights
gets one line saying how to convert them.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import serialization, traverse_util

from train.config import ConfigError

__all__ = ["TokenIds", "model", "read_weights", "WEIGHT_FILES"]

#: The files of a ``save_pretrained`` directory holding Flax weights, in the order they are looked for.
WEIGHT_FILES = ("flax_model.msgpack", "flax_model.msgpack.index.json", "model.safetensors",
                "model.safetensors.index.json")
#: Weights of the other frameworks, and the ``from_pretrained`` argument that converts them.
_FOREIGN = {"pytorch_model.bin": "from_pt", "pytorch_model.bin.index.json": "from_pt", "tf_model.h5": "from_tf"}
#: Collections a Hugging Face Flax model may keep next to its params (in one tree with them).
_COLLECTIONS = ("params", "batch_stats")


class TokenIds(nn.Module):
    """A Hugging Face Flax module called on token ids alone, as the framework calls
    models: attention mask of ones, positions ``0 .. n-1``, token types 0, no head
    mask. It shares the module's scope, so the parameter tree is the Hugging Face
    one (a ``save_pretrained`` checkpoint loads as it is). Returns the module's
    output (a ``ModelOutput``: ``model.output: logits`` reads the logits)."""

    module_class: Any  # e.g. transformers' FlaxGPT2LMHeadModule
    config: Any  # its transformers config

    def setup(self) -> None:
        self.inner = self.module_class(config=self.config)
        nn.share_scope(self, self.inner)

    def __call__(self, input_ids: Any, deterministic: bool = True) -> Any:
        ids = jnp.asarray(input_ids)
        given = {"attention_mask": jnp.ones_like(ids), "token_type_ids": jnp.zeros_like(ids),
                 "position_ids": jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape), "head_mask": None}
        takes = inspect.signature(self.module_class.__call__).parameters
        return self.inner(ids, **{k: v for k, v in given.items() if k in takes}, deterministic=deterministic)

    def with_cache(self, input_ids: Any, position_ids: Any, attention_mask: Any, init_cache: bool = False) -> Any:
        """The module on ``input_ids`` at ``position_ids`` with its own decode cache (the
        ``cache`` collection, ``past_key_values`` in transformers: ``init_cache=True`` makes
        it), as Hugging Face's ``generate`` calls it: ``attention_mask`` ``(batch, cache
        length)`` of ones over the whole cache, the cache masking what is not yet written."""
        return self.inner(jnp.asarray(input_ids), attention_mask=attention_mask, position_ids=position_ids,
                          deterministic=True, init_cache=init_cache)


def model(path: str, architecture: str | None = None) -> TokenIds:
    """The Flax module of the architecture ``path/config.json`` names (its first
    ``architectures`` entry, or ``architecture``, e.g. ``GPT2Model`` for the base
    model of a ``GPT2LMHeadModel`` checkpoint), called on token ids (:class:`TokenIds`).
    Its weights come from ``model.init_from`` (``create_train_state(init_from=...)``)."""
    config_file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"model.path: {path} has no config.json; give a directory written by save_pretrained")
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.name: train.weights.huggingface:model needs transformers<5 (Flax models): "
                          "pip install 'flax-mixed-precision[hf]'") from None
    config = transformers.AutoConfig.from_pretrained(os.path.dirname(config_file))
    name = architecture or (getattr(config, "architectures", None) or [None])[0]
    if name is None:
        raise ConfigError(f"model.architecture: {config_file} names no architecture; set model.architecture, "
                          f"e.g. {type(config).__name__.removesuffix('Config')}LMHeadModel")
    flax_class = getattr(transformers, name if name.startswith("Flax") else f"Flax{name}", None)
    module_class = getattr(flax_class, "module_class", None)
    if module_class is None:
        major = int(transformers.__version__.split(".")[0])
        dropped = " (version 5 dropped Flax: pip install 'transformers<5')" if major >= 5 else ""
        raise ConfigError(f"model.architecture: transformers {transformers.__version__} has no Flax {name} "
                          f"(Flax{name.removeprefix('Flax')}){dropped}; name an architecture with a Flax version")
    return TokenIds(module_class=module_class, config=config)


def read_weights(directory: str) -> tuple[dict, str] | None:
    """``({"params": ..., "batch_stats": ...}, file)``: the Flax weights of a
    ``save_pretrained`` directory as nested dicts of numpy arrays, or None if it
    holds none (and no other framework's either).

    Raises:
      ValueError: the directory holds only PyTorch or TensorFlow weights (the
        message says how to convert them), or its weights cannot be read.
    """
    for name in WEIGHT_FILES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".safetensors") and _safetensors_format(path) not in (None, "flax"):
            continue  # PyTorch's or TensorFlow's: converted below
        if name.endswith(".index.json"):
            tree = _read_shards(directory, path)
        else:
            tree = _read_file(path)
        return _as_collections(tree), path
    foreign = [n for n in (*_FOREIGN, "model.safetensors", "model.safetensors.index.json")
               if os.path.isfile(os.path.join(directory, n))]
    if foreign:
        raise ValueError(f"{directory} holds {foreign[0]} only, not Flax weights; convert them once: "
                         f"{_flax_class(directory)}.from_pretrained({directory!r}, "
                         f"{_FOREIGN.get(foreign[0], 'from_pt')}=True).save_pretrained(OUT), and give OUT")
    return None


def _read_file(path: str) -> dict:
    try:
        if path.endswith(".safetensors"):
            from safetensors.numpy import load_file

            return traverse_util.unflatten_dict(load_file(path), sep=".")
        with open(path, "rb") as f:
            return serialization.msgpack_restore(f.read())
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                         ) from None


def _read_shards(directory: str, index: str) -> dict:
    """The tree of a sharded checkpoint: each shard file its index names, merged."""
    try:
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"{index} is not a checkpoint index ({e})") from None
    flat: dict = {}
    for name in files:
        flat.update(traverse_util.flatten_dict(_read_file(os.path.join(directory, name))))
    return traverse_util.unflatten_dict(flat)


def _safetensors_format(path: str) -> str | None:
    """The framework a safetensors file (or its index's first shard) says it holds."""
    if path.endswith(".index.json"):
        try:
            with open(path, encoding="utf-8") as f:
                first = sorted(set(json.load(f)["weight_map"].values()))[0]
        except (OSError, ValueError, KeyError, IndexError):
            return None
        path = os.path.join(os.path.dirname(path), first)
    try:
        from safetensors import safe_open

        with safe_open(path, "np") as f:
            return (f.metadata() or {}).get("format")
    except Exception:  # noqa: BLE001 - unreadable: reported when it is read
        return None


def _as_collections(tree: dict) -> dict:
    """``{"params": ...}``: a Hugging Face Flax model saves its params alone, or all its collections together."""
    if "params" in tree and set(tree) <= set(_COLLECTIONS):
        return {k: v for k, v in tree.items()}
    return {"params": tree}


def _flax_class(directory: str) -> str:
    """The Flax class a directory's config.json names (``FlaxAutoModel`` if it names none)."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            return "Flax" + json.load(f)["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return "FlaxAutoModel"

