"""The GPT's compile- and memory-saving options: blocks scanned over stacked
params, and remat policies. Same function, same precision, less kept."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision
from benchmarks.measure import saved_residuals
from train.config import ConfigError, from_dict
from train.models import GPT

TOKENS = (jnp.arange(2 * 16).reshape(2, 16) * 7) % 32
GPT_SMALL = GPT(vocab_size=32, block_size=16, num_layers=3, num_heads=2, d_model=32)


def _stacked(params):
    """Unrolled ``block_i`` params restacked as the scanned model's ``blocks/block``."""
    blocks = [params[f"block_{i}"] for i in range(GPT_SMALL.num_layers)]
    rest = {k: v for k, v in params.items() if not k.startswith("block_")}
    return {**rest, "blocks": {"block": jax.tree_util.tree_map(lambda *a: jnp.stack(a), *blocks)}}


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scanned_and_rematerialised_blocks_compute_the_same_function(scan, remat):
    params = GPT_SMALL.init(jax.random.key(0), TOKENS)["params"]
    model = GPT_SMALL.clone(scan_layers=scan, remat=remat)
    mine = _stacked(params) if scan else params
    assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(
        model.init(jax.random.key(0), TOKENS)["params"])

    def loss(model, p):
        return jnp.mean(model.apply({"params": p}, TOKENS) ** 2)

    np.testing.assert_allclose(loss(model, mine), loss(GPT_SMALL, params), rtol=1e-5)
    grads = jax.grad(lambda p: loss(model, p))(mine)
    reference = jax.grad(lambda p: loss(GPT_SMALL, p))(params)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(_stacked(reference) if scan else reference)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_remat_keeps_less_for_the_backward_pass_and_the_policy_still_reaches_every_matmul():
    def kept(remat):
        model = precision.with_policy(GPT_SMALL.clone(scan_layers=True, remat=remat), "mixed_bf16")
        params = model.init(jax.random.key(0), TOKENS)["params"]
        residuals = saved_residuals(lambda p: model.apply({"params": p}, TOKENS).astype(jnp.float32).sum(), params)
        return sum(nbytes for _, _, nbytes, source in residuals if not source.startswith("from the argument"))

    none, dots, full = kept("none"), kept("dots"), kept("full")
    assert full < dots < none
    for remat in ("dots", "full"):
        explanation = precision.explain(GPT_SMALL.clone(scan_layers=True, remat=remat), TOKENS, policy="mixed_bf16")
        assert explanation.half_share == 1.0, explanation


def test_the_options_are_config_fields():
    config = from_dict({"model": {"name": "gpt", "scan_layers": True, "remat": "dots"}})
    assert config.model.options == {"scan_layers": True, "remat": "dots"}
    with pytest.raises(ConfigError, match="model.remat: unknown value 'some'; valid: none, full, dots"):
        from_dict({"model": {"name": "gpt", "remat": "some"}})
