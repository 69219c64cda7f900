"""Tensor parallelism proven on the program XLA's GPU compiler makes for 8 H100s, compile-only
(marked ``gpu_compile``: needs JAX's CUDA plugin, no GPU; CI's compile-only step runs them).

A Llama written the way Hugging Face writes it (``examples/user_models/hf_style.py``), two
layers: under ``mesh.fsdp=2 mesh.tensor=4`` its matmul pairs and vocabulary split, every
activation gathered across ``tensor`` in bfloat16 (the loss's per-shard statistics aside),
the row-parallel sums reduce-scattered in float32, and under ``mesh.fsdp=8`` every split
param's gradient a reduce-scatter, none an all-reduce of the whole gradient.
"""

import functools

import pytest

from docs_pages import ROOT
from helpers import h100_device
from train.config import load_config
from train.inspections.compile_for import compile_for

gpu_compile = pytest.mark.gpu_compile
LLAMA = ROOT / "examples" / "user_models" / "hf_style.yaml"
SHAPE = ["model.name=hf_style.py:Llama", "model.width=512", "model.heads=8", "model.kv_heads=4", "model.layers=2",
         "data.num_classes=8192", "data.seq_len=512", "data.batch_size=8", "data.num_train=65536",
         "workdir=/tmp/unused"]


@pytest.fixture(autouse=True)
def _needs_plugin():
    if h100_device() is None:
        pytest.skip("needs JAX's CUDA plugin (no GPU): pip install '.[gpu-compile]'")


@functools.lru_cache(maxsize=None)
def _compiled(*mesh):
    return compile_for(load_config(LLAMA, [*SHAPE, *mesh]), "h100", 8)


@gpu_compile
def test_tensor_parallel_llama_on_8_h100s_gathers_in_bf16_and_sums_in_f32():
    report = _compiled("mesh.fsdp=2", "mesh.tensor=4")
    assert report.fits and report.mesh == {"data": 1, "fsdp": 2, "tensor": 4}
    assert report.communication.stage == "compiled"
    big = [c for c in report.communication.collectives if c.bytes > 2 ** 20]  # the loss's statistics are smaller
    gathered = {c.dtype for c in big if c.kind == "all-gather" and c.carries in ("activations", "params")}
    assert gathered == {"bf16"}, report.communication.rows()
    rows = [c for c in big if c.carries == "activations" and c.kind == "reduce-scatter" and c.group == 4]
    assert len(rows) >= 4 and {c.dtype for c in rows} == {"f32"}  # o_proj, down_proj (and their inputs' gradients)
    assert not [c for c in big if c.kind == "all-reduce" and c.dtype == "f32"], report.communication.rows()
    split = {"/".join(s.path) for s in report.tensor_plan.splits if s.dim is not None}
    assert {"layers_0_self_attn/q_proj/kernel", "layers_0_self_attn/o_proj/kernel", "layers_1_down_proj/kernel",
            "embed_tokens/embedding", "lm_head/kernel"} <= split


@gpu_compile
def test_fsdp_gradients_are_reduce_scattered_never_all_reduced_whole():
    report = _compiled("mesh.fsdp=8")
    gradients = [c for c in report.communication.collectives if c.carries == "gradients" and c.bytes > 2 ** 20]
    assert gradients and {c.kind for c in gradients} == {"reduce-scatter"}, report.communication.rows()
    assert {c.dtype for c in gradients} == {"f32"}  # precision.reduce_dtype auto: float32 on a mesh
