"""A trained run's weights for serving, what needs no model: the frozen base's 8/4-bit codes
read back, LoRA adapters merged into the weights they adapt, the files written whole.

The orchestration (the run's model, its policy's rules, the accuracy check) is
:func:`train.inspections.export.export_run`; this module holds its pure parts:

- :func:`dequantized_base`: ``<param>/codes`` and ``<param>/scales`` of a checkpoint
  (a :class:`precision.QuantizedWeight` saved) as the float32 weight;
- :func:`adapter_layouts`, :func:`pick_layout`, :func:`lora_delta`: how qwix's adapters
  ``<param>_lora_a`` / ``<param>_lora_b`` map onto ``<param>``. qwix adds
  ``x @ A @ B * alpha / rank`` beside the matmul that reads the param, with A reshaped to
  ``(*batch, *contract, rank)`` and B to ``(*batch, rank, *remain)`` in the order of the
  matmul's dimension numbers, which a param's shape does not tell (a Hugging Face GPT-2
  ``Conv1D`` kernel is read transposed; a square one looks the same either way). The
  candidates are listed from the shapes, and the one whose adjoint maps the param's gradient
  onto the adapters' gradients (``dL/dB = s * A^T dL/dW``, in that layout) is taken;
- the export's files: ``params.safetensors`` (every collection, keys ``params/Dense_0/kernel``)
  with ``export.json``, or a Hugging Face directory (``model.safetensors``, keys joined by
  dots, as ``save_pretrained`` writes them), staged in a temporary directory and renamed
  into place (:func:`staged`), so a failed export leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import secrets
import shutil
from typing import Any, Iterator, NamedTuple

import numpy as np
from flax import traverse_util

from precision.quantized_weights import QuantizedWeight, dequantize_weight

__all__ = ["ExportError", "ExportReport", "EXPORT_DTYPES", "PARAMS_FILE", "MANIFEST", "HF_WEIGHTS", "Layout",
           "export_dtype", "dequantized_base", "adapter_pairs", "adapter_layouts", "pick_layout", "lora_delta",
           "staged", "write_params", "read_export", "write_huggingface", "write_manifest"]

#: ``--dtype`` names and the dtype each stands for.
EXPORT_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "float16": "float16",
                 "fp16": "float16", "f32": "float32", "float32": "float32", "fp32": "float32", "int8": "int8"}
#: An export of a model of this framework: every collection, keys ``collection/module/.../param``.
PARAMS_FILE = "params.safetensors"
#: What an export holds and where it came from (JSON).
MANIFEST = "export.json"
#: A Hugging Face model's weights, as ``save_pretrained(..., safe_serialization=True)`` writes Flax ones.
HF_WEIGHTS = "model.safetensors"
#: Files of a Hugging Face directory copied beside its weights (the tokenizer's, for serving).
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
            "merges.txt", "special_tokens_map.json", "added_tokens.json", "spiece.model", "tokenizer.model")

Flat = dict[tuple[str, ...], Any]


class ExportError(ValueError):
    """The export cannot be made: bad input or weights that do not fit the model (one line)."""


class ExportReport(NamedTuple):
    """What an export wrote: ``out`` (the directory), ``dtype``, ``source`` (the run's workdir)
    and its checkpoint's ``step``, ``format`` (``"params"`` or ``"huggingface"``), ``files``,
    ``params`` (arrays) and ``values`` exported, ``bytes`` written (export.json aside),
    ``kept_float32`` (param path: the rule that keeps it), ``merged`` (weights the adapters were merged into),
    ``lora_match`` (the merged model's largest output difference from the LoRA model's,
    relative, float32; None without adapters), ``accuracy`` (:func:`train.inference_report`
    of the exported weights against float32, when checked), ``diagnosis`` (the doctor on
    serving them, when asked: ``healthy``, ``summary``, ``export_again`` with its verified fix), ``int8``
    (the weights written as int8 codes with a scale per output channel, :mod:`train.weights.int8`)."""

    out: str
    dtype: str
    source: str
    step: int | None
    format: str
    files: tuple[str, ...]
    params: int
    values: int
    bytes: int
    kept_float32: dict[str, str]
    merged: tuple[str, ...]
    lora_match: float | None = None
    accuracy: dict[str, dict[str, float]] | None = None
    diagnosis: dict[str, Any] | None = None
    int8: tuple[str, ...] = ()


def export_dtype(name: str) -> str:
    """The dtype ``--dtype name`` stands for (``"bfloat16"``, ``"float16"``, ``"float32"``, or
    ``"int8"``: weight-only int8 with bfloat16 for the rest, :mod:`train.weights.int8`)."""
    key = str(name).strip().lower()
    if key not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {name!r}: give bf16, f16, f32 or int8")
    return EXPORT_DTYPES[key]


def stored_codes(flat: Flat, shapes: dict[tuple[str, ...], tuple[int, ...]]) -> dict[tuple[str, ...], QuantizedWeight]:
    """Each weight ``flat`` (a checkpoint's params, flattened) saved as 8/4-bit codes
    (``<path>/codes`` and ``<path>/scales``), as the :class:`QuantizedWeight` of the shape the
    model gives its ``path`` (``shapes``), read as float32: int8 codes are ``int8``, nf4 ones
    two per ``uint8``."""
    out = {}
    for path in {k[:-1] for k in flat if k[-1] == "codes" and k[:-1] in shapes}:
        codes, scales = np.asarray(flat[path + ("codes",)]), np.asarray(flat[path + ("scales",)], np.float32)
        code = "int8" if codes.dtype == np.int8 else "nf4"
        shape = tuple(shapes[path])
        per_block = 64 if code == "int8" else 32
        if codes.ndim != 2 or codes.shape[1] != per_block or codes.shape[0] * 64 < math.prod(shape):
            raise ExportError(f"{'/'.join(path)}: codes of shape {codes.shape} do not hold the model's {shape} "
                              f"weight in {code} blocks of 64")
        out[path] = QuantizedWeight(codes, scales, shape, np.dtype(np.float32), code)
    return out


def dequantized_base(flat: Flat, shapes: dict[tuple[str, ...], tuple[int, ...]],
                     codes: dict[tuple[str, ...], QuantizedWeight] | None = None) -> Flat:
    """``flat`` (a checkpoint's params, flattened) with each weight saved as 8/4-bit codes
    (:func:`stored_codes`, or ``codes`` where the caller has them) read back as float32."""
    codes = stored_codes(flat, shapes) if codes is None else codes
    out = {k: v for k, v in flat.items() if k[-1] not in ("codes", "scales") or k[:-1] not in shapes}
    out.update({path: np.asarray(dequantize_weight(q), np.float32) for path, q in codes.items()})
    return out


def adapter_pairs(flat: Flat) -> dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]]:
    """``{weight path: (A path, B path)}`` for each param with both adapters beside it."""
    pairs = {}
    for path in flat:
        name = str(path[-1])
        if name.endswith("_lora_a"):
            weight = path[:-1] + (name.removesuffix("_lora_a"),)
            b = path[:-1] + (name.removesuffix("_lora_a") + "_lora_b",)
            if weight in flat and b in flat:
                pairs[weight] = (path, b)
    return pairs


class Layout(NamedTuple):
    """How ``A @ B`` lies in a weight: ``perm`` lists the weight's axes as the matmul reads
    them, ``batch`` axes first (A ``(*batch, C, r)``, B ``(*batch, r, R)``), then the
    contracted ones (their product C), then the rest (R)."""

    perm: tuple[int, ...]
    batch: int = 0


def adapter_layouts(w_shape: tuple[int, ...], a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> list[Layout]:
    """Every :class:`Layout` of adapters of these shapes on a weight of ``w_shape`` that qwix
    can make (``dot_general``: contracted axes in any order, the rest in order; ``einsum``:
    A and B keep the weight's own axes, in order); the weight's own axis order first."""
    n, r = len(w_shape), a_shape[-1]
    found: list[Layout] = []
    if n > 6:  # no matmul reads a weight of more axes
        return found
    size = math.prod(w_shape)
    if len(b_shape) >= 2 and b_shape[0] == r and math.prod(a_shape[:-1]) * math.prod(b_shape[1:]) == size:
        for k in range(1, n + 1):
            for contract in itertools.permutations(range(n), k):
                rest = tuple(i for i in range(n) if i not in contract)
                dims_c, dims_r = [w_shape[i] for i in contract], [w_shape[i] for i in rest]
                if math.prod(dims_c) != math.prod(a_shape[:-1]):
                    continue
                if len(a_shape) > 2 and (dims_c != list(a_shape[:-1]) or list(contract) != sorted(contract)):
                    continue
                if len(b_shape) > 2 and dims_r != list(b_shape[1:]):
                    continue
                found.append(Layout(contract + rest))
    nb = len(a_shape) - 2
    if nb > 0 and len(b_shape) == len(a_shape) and a_shape[:nb] == b_shape[:nb] and b_shape[-2] == r:
        for batch in itertools.permutations(range(n), nb):
            if [w_shape[i] for i in batch] != list(a_shape[:nb]):
                continue
            others = [i for i in range(n) if i not in batch]
            for k in range(1, len(others) + 1):
                for contract in itertools.permutations(others, k):
                    rest = tuple(i for i in others if i not in contract)
                    if (math.prod(w_shape[i] for i in contract) == a_shape[-2]
                            and math.prod(w_shape[i] for i in rest) == b_shape[-1]):
                        found.append(Layout(batch + contract + rest, nb))
    found = list(dict.fromkeys(found))
    return sorted(found, key=lambda layout: layout.perm != tuple(range(n)))


def lora_delta(layout: Layout, w_shape: tuple[int, ...], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``A @ B`` laid out as the weight (not yet scaled by ``alpha / rank``)."""
    r = a.shape[-1]
    product = np.matmul(a, b) if layout.batch else a.reshape(-1, r) @ b.reshape(r, -1)
    return product.reshape([w_shape[i] for i in layout.perm]).transpose(np.argsort(layout.perm))


def _adjoints(layout: Layout, a: np.ndarray, b: np.ndarray, g_w: np.ndarray, scale: float
              ) -> tuple[np.ndarray, np.ndarray]:
    """The gradients of A and B that a gradient ``g_w`` of the weight implies, were the
    adapters laid out as ``layout`` says."""
    r = a.shape[-1]
    moved = g_w.transpose(layout.perm)
    if layout.batch:
        g = moved.reshape(*a.shape[:-1], b.shape[-1])
        return scale * g @ np.swapaxes(b, -1, -2), scale * np.swapaxes(a, -1, -2) @ g
    g = moved.reshape(math.prod(a.shape[:-1]), -1)
    return (scale * (g @ b.reshape(r, -1).T)).reshape(a.shape), (scale * (a.reshape(-1, r).T @ g)).reshape(b.shape)


def _close(x: np.ndarray, y: np.ndarray, rtol: float) -> bool:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y)) <= rtol * (float(np.linalg.norm(x)) + float(np.linalg.norm(y))) + 1e-30


def pick_layout(layouts: list[Layout], a: np.ndarray, b: np.ndarray, grads: tuple[np.ndarray, np.ndarray, np.ndarray],
                scale: float, rtol: float = 1e-3) -> Layout | None:
    """The first of ``layouts`` under which the gradients ``(g_w, g_a, g_b)`` of the weight and
    its adapters (one backward pass of the LoRA model, float32) agree; None if none does (the
    weight is read elsewhere too, e.g. a tied embedding: the adapters cannot be merged)."""
    g_w, g_a, g_b = (np.asarray(g, np.float32) for g in grads)
    for layout in layouts:
        want_a, want_b = _adjoints(layout, np.asarray(a, np.float32), np.asarray(b, np.float32), g_w, scale)
        if _close(want_a, g_a, rtol) and _close(want_b, g_b, rtol):
            return layout
    return None


@contextlib.contextmanager
def staged(out: str) -> Iterator[str]:
    """A temporary directory beside ``out``, renamed to ``out`` when the block ends without an
    error (an empty ``out`` is replaced), removed when it raises: ``out`` appears whole or not at all."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    temp = os.path.join(parent, f".{os.path.basename(out)}.{secrets.token_hex(4)}.partial")
    os.mkdir(temp)  # with the user's umask, as OUT itself would be made
    try:
        yield temp
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked before the export began)
        os.replace(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _safetensors(path: str, flat: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in flat.items()}, path, metadata=metadata)


def write_params(directory: str, variables: dict) -> str:
    """``directory/params.safetensors``: every collection of ``variables``, keys joined by ``/``."""
    flat = traverse_util.flatten_dict(variables, sep="/")
    path = os.path.join(directory, PARAMS_FILE)
    _safetensors(path, flat, {"format": "flax", "layout": "collection/path"})
    return path


def read_export(directory: str) -> tuple[dict, str]:
    """``(variables, file)``: the collections an export's ``params.safetensors`` holds, as nested
    dicts of numpy arrays (params in the dtypes they were exported in)."""
    from safetensors.numpy import load_file

    path = os.path.join(directory, PARAMS_FILE)
    try:
        flat = load_file(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
        raise ExportError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          ) from None
    return traverse_util.unflatten_dict(flat, sep="/"), path


def write_huggingface(directory: str, variables: dict, model_path: str, architecture: str | None) -> list[str]:
    """A Hugging Face ``save_pretrained`` directory: ``model.safetensors`` (Flax's layout: the params
    tree alone, or every collection when there are others; keys joined by dots) and the files of
    ``model_path`` that describe the model (config.json, the tokenizer's). Returns the files written."""
    tree = variables["params"] if set(variables) == {"params"} else variables
    _safetensors(os.path.join(directory, HF_WEIGHTS), traverse_util.flatten_dict(tree, sep="."), {"format": "flax"})
    written = [HF_WEIGHTS]
    for name in HF_FILES:
        source = os.path.join(os.path.expanduser(model_path), name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(directory, name))
            written.append(name)
    if architecture and "config.json" in written:  # the module exported is the one the run trained
        config_file = os.path.join(directory, "config.json")
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
        config["architectures"] = [architecture.removeprefix("Flax")]
        with open(config_file, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    return written


def write_manifest(directory: str, report: ExportReport) -> str:
    """``directory/export.json``: the report, less its directory (which may move)."""
    path = os.path.join(directory, MANIFEST)
    fields = {k: v for k, v in report._asdict().items() if k != "out"}
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"exported_by": "python -m train export", **fields}, f, indent=2)
    return path
