"""The loss from large logits, a block of rows at a time (precision.blockwise_loss): the
same loss and gradients as the whole computation, for the ways people write a language
model's loss, no logits-sized value in the compiled program, left as written where it
is not the same computation, and in the train step (on one device and split over two)."""

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import precision
from precision.blockwise import transform as blockwise_transform

VOCAB, WIDTH, ROWS, SEQ = 256, 16, 8, 6
SMALL = dict(min_logits_bytes=1, block_bytes=2 * SEQ * VOCAB * 4)  # every head counts; blocks of 2 rows


class _LM(nn.Module):
    """A token model with a pinned float32 hidden layer and an untied head, as people write one."""

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(VOCAB, WIDTH)(tokens)
        h = nn.gelu(nn.Dense(2 * WIDTH, dtype=jnp.float32)(h))
        h = nn.LayerNorm()(h)
        return nn.Dense(VOCAB, name="head")(h)


class _TiedLM(nn.Module):
    """The head is the embedding's transpose (``Embed.attend``)."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, WIDTH)
        h = nn.tanh(nn.Dense(WIDTH)(embed(tokens)))
        return embed.attend(h)


class _NNXLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.hidden = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        return self.head(nnx.relu(self.hidden(self.embed(tokens))))


def _builtin(logits, labels):
    return precision.cross_entropy(logits, labels)[0].mean()


def _optax(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _by_hand(logits, labels):
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1).mean()


def _smoothed_with_z_loss(logits, labels):
    targets = optax.smooth_labels(jax.nn.one_hot(labels, VOCAB), 0.1)
    z = jax.nn.logsumexp(logits, axis=-1)
    return (optax.softmax_cross_entropy(logits, targets) + 1e-4 * z ** 2).mean()


def _ignoring_labels(logits, labels):
    """Labels -1 (padding) are ignored, as Hugging Face's -100."""
    mask = labels >= 0
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
    return (losses * mask).sum() / mask.sum()


def _flattened(logits, labels):
    """``[batch * seq, vocab]``, as many training scripts flatten before the loss."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, VOCAB), labels.reshape(-1)).mean()


def _shifted(logits, labels):
    """Hugging Face's causal-LM loss: position t predicts token t + 1."""
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels[:, 1:]).mean()


LOSSES = {"builtin": _builtin, "optax": _optax, "by_hand": _by_hand, "smoothed_z_loss": _smoothed_with_z_loss,
          "ignoring_labels": _ignoring_labels, "flattened": _flattened, "shifted": _shifted}
#: Gradient error allowed beyond twice the whole computation's own error against float32, per policy.
SLACK = {"fp32": 1e-6, "mixed_bf16": 2e-2, "mixed_f16": 2e-3}


def _batch(rows=ROWS, seed=1):
    tokens = jax.random.randint(jax.random.key(seed), (rows, SEQ), 0, VOCAB)
    labels = jax.random.randint(jax.random.key(seed + 1), (rows, SEQ), 0, VOCAB)
    return tokens, labels.at[0, :2].set(-1).at[3, 4].set(-1)


def _loss_fn(module, policy, loss):
    model = precision.with_policy(module, policy)

    def fn(variables, tokens, labels):
        logits = model.apply(variables, tokens).astype(jnp.float32)
        return loss(logits, jnp.maximum(labels, 0) if loss is not _ignoring_labels else labels)

    return fn


def _relative_errors(grads, reference):
    return [float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))) for g, r in
            zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference))]


@pytest.mark.parametrize("policy", ["fp32", "mixed_bf16", "mixed_f16"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_the_same_loss_and_gradients_as_the_whole_logits(loss, policy):
    tokens, labels = _batch()
    variables = _LM().init(jax.random.key(0), tokens)
    whole = _loss_fn(_LM(), policy, LOSSES[loss])
    plan = precision.plan_blockwise_loss(whole, variables, tokens, labels, **SMALL)
    assert plan.found and plan.blocks == ROWS // 2 and plan.head == "head", plan
    blocked = precision.blockwise_loss(whole, **SMALL)
    value, grads = jax.jit(jax.value_and_grad(blocked))(variables, tokens, labels)
    expected, plain = jax.jit(jax.value_and_grad(whole))(variables, tokens, labels)
    reference = jax.grad(_loss_fn(_LM(), "fp32", LOSSES[loss]))(variables, tokens, labels)
    np.testing.assert_allclose(value, expected, rtol=1e-6 if policy == "fp32" else 2e-3)
    for ours, theirs in zip(_relative_errors(grads, reference), _relative_errors(plain, reference)):
        assert ours <= 2 * theirs + SLACK[policy], (ours, theirs)


def _nnx_loss(policy):
    graph, variables = nnx.split(precision.with_policy(_NNXLM(nnx.Rngs(0)), policy))

    def fn(state, tokens, labels):
        return _optax(nnx.merge(graph, state)(tokens).astype(jnp.float32), labels)

    return fn, variables


@pytest.mark.parametrize("module", ["tied", "nnx"])
def test_a_tied_head_and_an_nnx_model_are_computed_in_blocks_too(module):
    tokens, labels = _batch()
    labels = jnp.maximum(labels, 0)
    if module == "tied":
        variables = _TiedLM().init(jax.random.key(0), tokens)
        fn, reference_fn = (_loss_fn(_TiedLM(), policy, _optax) for policy in ("mixed_bf16", "fp32"))
    else:
        (fn, variables), (reference_fn, _) = _nnx_loss("mixed_bf16"), _nnx_loss("fp32")
    assert precision.plan_blockwise_loss(fn, variables, tokens, labels, **SMALL).found
    value, grads = jax.value_and_grad(precision.blockwise_loss(fn, **SMALL))(variables, tokens, labels)
    expected, plain = jax.value_and_grad(fn)(variables, tokens, labels)
    reference = jax.grad(reference_fn)(variables, tokens, labels)
    np.testing.assert_allclose(value, expected, rtol=2e-3)
    for ours, theirs in zip(_relative_errors(grads, reference), _relative_errors(plain, reference)):
        assert ours <= 2 * theirs + SLACK["mixed_bf16"], (ours, theirs)


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([2, 4, 6, 12]), block=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_any_block_size_gives_the_whole_computation_in_float32(rows, block, seed):
    tokens, labels = _batch(rows, seed)
    variables = _LM().init(jax.random.key(seed), tokens)
    fn = _loss_fn(_LM(), "fp32", _smoothed_with_z_loss)
    blocked = precision.blockwise_loss(fn, min_logits_bytes=1, block_bytes=block * SEQ * VOCAB * 4)
    value, grads = jax.value_and_grad(blocked)(variables, tokens, labels)
    expected, plain = jax.value_and_grad(fn)(variables, tokens, labels)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    chex.assert_trees_all_close(grads, plain, rtol=1e-4, atol=1e-6)


def _largest_arrays(text: str) -> int:
    """Elements of the largest array any instruction of an HLO module makes."""
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\b[a-z]+\d*\[([\d,]+)\]",
                                                                                          text)]
    return max(sizes, default=0)


def test_no_value_of_the_logits_size_in_the_compiled_program():
    tokens, labels = _batch()
    variables = _LM().init(jax.random.key(0), tokens)
    fn = _loss_fn(_LM(), "mixed_bf16", _builtin)
    logits_size = ROWS * SEQ * VOCAB
    compiled = {name: jax.jit(jax.value_and_grad(f)).lower(variables, tokens, labels).compile().as_text()
                for name, f in (("whole", fn), ("blocks", precision.blockwise_loss(fn, **SMALL)))}
    assert _largest_arrays(compiled["whole"]) >= logits_size
    assert _largest_arrays(compiled["blocks"]) < logits_size  # blocks of 2 rows, the head's weights


def test_a_loss_that_is_not_the_same_computation_in_blocks_is_left_as_written():
    tokens, labels = _batch()
    variables = _LM().init(jax.random.key(0), tokens)
    model = precision.with_policy(_LM(), "mixed_bf16")

    def also_returns_logits(v, t, y):
        logits = model.apply(v, t).astype(jnp.float32)
        return _optax(logits, y), logits

    def normalized_over_the_batch(v, t, y):  # a softmax across rows: row i depends on row j
        logits = model.apply(v, t).astype(jnp.float32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=0), y[..., None], -1).mean()

    for fn, why in ((also_returns_logits, "leaves the region whole"),
                    (normalized_over_the_batch, "a reduction over the rows")):
        plan = precision.plan_blockwise_loss(fn, variables, tokens, labels, **SMALL)
        assert not plan.found and why in plan.reason, plan
        chex.assert_trees_all_close(precision.blockwise_loss(fn, **SMALL)(variables, tokens, labels),
                                    fn(variables, tokens, labels))


def test_small_logits_stay_whole_by_default_and_the_plan_says_why():
    tokens, labels = _batch()
    variables = _LM().init(jax.random.key(0), tokens)
    plan = precision.plan_blockwise_loss(_loss_fn(_LM(), "mixed_bf16", _optax), variables, tokens, labels)
    assert not plan.found and "below 256 MiB: whole is cheaper" in plan.reason
    assert plan.describe().startswith("Blockwise loss: not applied")


def test_logits_a_single_default_block_would_hold_still_go_in_blocks_of_a_quarter_at_most():
    """From the threshold up, logits go in blocks: by default each holds at most a quarter of
    the whole float32 logits (and 1 GiB), not one block the size of them all."""
    tokens, labels = _batch()
    variables = _LM().init(jax.random.key(0), tokens)
    fn = _loss_fn(_LM(), "mixed_bf16", _builtin)
    logits_bytes = ROWS * SEQ * VOCAB * 4
    plan = precision.plan_blockwise_loss(fn, variables, tokens, labels, min_logits_bytes=logits_bytes)
    assert plan.found and (plan.blocks, plan.block_rows) == (4, ROWS // 4), plan
    given = precision.plan_blockwise_loss(fn, variables, tokens, labels, min_logits_bytes=logits_bytes,
                                          block_bytes=logits_bytes // 2)  # a budget given is the budget
    assert given.found and given.blocks == 2, given
    one_row = precision.plan_blockwise_loss(fn, variables, tokens[:1], labels[:1], min_logits_bytes=1)
    assert not one_row.found and "one row" in one_row.reason, one_row


def test_a_hugging_face_gpt2_steps_412_mb_of_logits_go_in_blocks_under_true():
    """The issue's case: GPT-2's vocabulary (50,257), 16 x 128 tokens (412 MB of float32 logits,
    above true's 256 MiB, below one 1 GiB block): four blocks of four rows."""
    import train
    from helpers import flax_transformers
    from train.training.tasks import get_task
    from train.weights.huggingface import TokenIds

    transformers = flax_transformers()
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=128)
    model = TokenIds(module_class=transformers.FlaxGPT2LMHeadModel.module_class, config=cfg)
    state = train.create_train_state(model, "mixed_bf16", optax.sgd(0.1), jax.random.key(0),
                                     jnp.zeros((1, 128), jnp.int32), ops=precision.op_lists(blockwise_loss=True))
    tokens = jax.ShapeDtypeStruct((16, 128), jnp.int32)
    plan = train.blockwise_plan(state, {"inputs": tokens, "labels": tokens}, task=get_task("lm", output="logits"))
    assert plan.found and plan.logits == (16, 128, 50257) and (plan.blocks, plan.block_rows) == (4, 4), plan


def test_a_head_whose_gradient_has_a_reduce_dtype_is_still_a_matmul_the_plan_names():
    """Under FSDP (a reduce dtype: each matmul reading a param is bound in a custom VJP) the
    plan names the largest matmul, not "no matmul"."""
    tokens, labels = _batch()
    variables = _LM().init(jax.random.key(0), tokens)
    fn = precision.autocast(lambda v, t, y: _optax(_LM().apply(v, t).astype(jnp.float32), y), "mixed_bf16",
                            reduce_dtype="f32")
    plan = precision.plan_blockwise_loss(fn, variables, tokens, labels)
    assert not plan.found and f"the largest matmul result, {[ROWS, SEQ, VOCAB]}" in plan.reason, plan


def _gpt_state(blockwise: bool):
    import train
    model = train.models.GPT(vocab_size=VOCAB, block_size=SEQ, num_layers=1, num_heads=2, d_model=WIDTH)
    ops = precision.op_lists(blockwise_loss=blockwise)
    return train.create_train_state(model, "mixed_bf16", optax.sgd(0.5), jax.random.key(0),
                                    jnp.zeros((1, SEQ), jnp.int32), ops=ops)


def test_the_train_step_computes_a_language_models_loss_in_blocks(monkeypatch):
    import train
    monkeypatch.setattr(blockwise_transform, "MIN_LOGITS_BYTES", 1)
    monkeypatch.setattr(blockwise_transform, "BLOCK_BYTES", 2 * SEQ * VOCAB * 4)
    tokens, labels = _batch()
    batch = {"inputs": tokens, "labels": jnp.maximum(labels, 0)}
    plans = {on: train.blockwise_plan(_gpt_state(on), batch, task="lm") for on in (True, False)}
    assert plans[True].found and plans[True].blocks == ROWS // 2
    assert not plans[False].found and "turned off" in plans[False].reason
    states = {}
    for on in (True, False):
        state, step = _gpt_state(on), train.make_train_step(task="lm")
        for _ in range(3):
            state, metrics = step(state, batch)
        states[on] = (state, metrics)
    eval_batch = {**batch, "mask": jnp.ones(ROWS, bool)}
    sums = {on: train.make_eval_step(task="lm")(_gpt_state(on), eval_batch) for on in (True, False)}
    chex.assert_trees_all_close(sums[True], sums[False], rtol=1e-3)
    lowered = {on: train.make_eval_step(task="lm").lower(_gpt_state(on), eval_batch).as_text() for on in (True, False)}
    assert "stablehlo.while" in lowered[True] and "stablehlo.while" not in lowered[False]  # the eval step in blocks
    (blocked, m_blocked), (whole, m_whole) = states[True], states[False]
    np.testing.assert_allclose(m_blocked["loss"], m_whole["loss"], rtol=5e-3)
    np.testing.assert_allclose(m_blocked["accuracy"], m_whole["accuracy"], atol=1 / (ROWS * SEQ) + 1e-6)
    chex.assert_trees_all_close(blocked.params, whole.params, atol=5e-3)  # bf16 rounding; numerics: above


def test_the_config_says_when_auto_by_default(monkeypatch):
    """``auto`` (the default) blocks from 8 GiB of float32 logits, ``true`` from 256 MiB,
    ``false`` never; the plan of a step left to decide says how to ask for blocks."""
    import train
    from train import load_config
    from train.config import build_op_lists
    modes = {v: build_op_lists(load_config("configs/default.yaml", [f"precision.blockwise_loss={v}"]).precision)
             for v in ("auto", "true", "false")}
    assert modes["auto"] is None and modes["true"].blockwise_loss == "on" and modes["false"].blockwise_loss == "off"
    assert precision.op_lists().blockwise_loss == "auto"
    with pytest.raises(precision.PolicyError, match="blockwise_loss='sometimes'; valid: 'auto'"):
        precision.op_lists(blockwise_loss="sometimes")
    monkeypatch.setattr(blockwise_transform, "MIN_LOGITS_BYTES", 1)  # "on" from any size; "auto" still 8 GiB
    tokens, labels = _batch()
    batch = {"inputs": tokens, "labels": jnp.maximum(labels, 0)}
    model = train.models.GPT(vocab_size=VOCAB, block_size=SEQ, num_layers=1, num_heads=2, d_model=WIDTH)
    auto = train.create_train_state(model, "mixed_bf16", optax.sgd(0.1), jax.random.key(0), tokens[:1])
    plan = train.blockwise_plan(auto, batch, task="lm")
    assert not plan.found and "below 8192 MiB" in plan.reason and "precision.blockwise_loss=true" in plan.reason


def test_split_over_two_devices_the_same_step_and_no_logits_gathered():
    """Data parallel and FSDP (the head's vocabulary split): the loss and the params after one
    step as on one device with the whole logits; no all-gather of anything logits-sized."""
    import json
    import pathlib
    import subprocess
    import sys

    from helpers import subprocess_env
    script = pathlib.Path(__file__).with_name("blockwise_sharded.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for mesh in ("data2_fsdp1", "data1_fsdp2"):
        run = out[mesh]
        assert run["found"] and run["block_rows"] % 2 == 0 and run["partitioned"], run
        np.testing.assert_allclose(run["loss"], out["one_device"], rtol=1e-5)
        assert run["params_diff"] < 1e-3 and run["largest_gather"] < out["logits"], run


def test_a_step_that_does_not_fit_is_told_to_try_blocks_only_where_auto_left_the_logits_whole():
    from train.inspections.compile_for import blocks_hint
    small = precision.BlockwisePlan(False, "the largest matmul result, [16, 1024, 50304], is 3144.0 MiB in float32, "
                                           "below 8192 MiB: whole is cheaper; precision.blockwise_loss=true computes "
                                           "logits from 256 MiB in blocks")
    assert "precision.blockwise_loss=true" in blocks_hint(small)
    for plan in (None, precision.BlockwisePlan(False, "turned off (precision.blockwise_loss=false)"),
                 precision.BlockwisePlan(False, "the loss from the logits [4, 50] is not computed row by row: x"),
                 precision.BlockwisePlan(True, "", "head", (16, 1024, 50304), "bfloat16", 16, 4, 4, 1, 1)):
        assert blocks_hint(plan) == ""


def test_a_scanned_rematerialized_gpt_keeps_its_head_and_blocks_in_half_precision(monkeypatch):
    """The built-in GPT with ``nn.scan`` over its layers and ``remat``, under mixed_bf16: the
    loss in blocks equals the whole logits', and every matmul of the blocked program (the
    blocks' head included) computes in bfloat16."""
    import train
    monkeypatch.setattr(blockwise_transform, "MIN_LOGITS_BYTES", 1)
    monkeypatch.setattr(blockwise_transform, "BLOCK_BYTES", 2 * SEQ * VOCAB * 4)
    model = train.models.GPT(vocab_size=VOCAB, block_size=SEQ, num_layers=2, num_heads=2, d_model=WIDTH,
                             scan_layers=True, remat="full")
    tokens, labels = _batch()
    batch = {"inputs": tokens, "labels": jnp.maximum(labels, 0)}
    state = train.create_train_state(model, "mixed_bf16", optax.sgd(0.1), jax.random.key(0), tokens[:1],
                                     ops=precision.op_lists(blockwise_loss=True))
    plan = train.blockwise_plan(state, batch, task="lm")
    assert plan.found and plan.logits_dtype == "bfloat16" and plan.blocks == ROWS // 2, plan
    fn = _loss_fn(model, "mixed_bf16", _builtin)
    variables = {"params": state.params}
    blocked = precision.blockwise_loss(fn, **SMALL)
    np.testing.assert_allclose(blocked(variables, tokens, jnp.maximum(labels, 0)),
                               fn(variables, tokens, jnp.maximum(labels, 0)), rtol=2e-3)
    text = str(jax.make_jaxpr(jax.grad(blocked))(variables, tokens, jnp.maximum(labels, 0)))
    products = re.findall(r"(\w+)\[[\d,]*\] = dot_general", text)
    assert products and set(products) == {"bf16"}, sorted(set(products))


def test_a_small_models_train_step_compiles_to_the_same_program_under_auto():
    """``auto`` leaves logits below its threshold whole: the step is the one without blocks."""
    import train
    model = train.models.GPT(vocab_size=VOCAB, block_size=SEQ, num_layers=1, num_heads=2, d_model=WIDTH)
    tokens, labels = _batch()
    batch = {"inputs": tokens, "labels": jnp.maximum(labels, 0)}
    texts = []
    for mode in ("auto", False):
        state = train.create_train_state(model, "mixed_bf16", optax.sgd(0.1), jax.random.key(0), tokens[:1],
                                         ops=precision.op_lists(blockwise_loss=mode))
        texts.append(train.make_train_step(task="lm", donate=False).lower(state, batch).as_text())
    assert texts[0] == texts[1]


def test_a_bad_blockwise_setting_is_one_line_naming_the_key_and_the_valid_ones(tmp_path):
    import subprocess
    import sys

    from helpers import subprocess_env
    proc = subprocess.run([sys.executable, "-m", "train", "configs/default.yaml", "precision.blockwise_loss=maybe",
                           f"workdir={tmp_path}", "--check"], capture_output=True, text=True, timeout=300,
                          env=subprocess_env(JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "precision.blockwise_loss: 'maybe'; valid: auto" in proc.stderr and "true" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_nested_program_closing_over_an_array_is_flattened_with_it():
    # From jax 0.11 a Jaxpr is also a ClosedJaxpr holding its constants: taken as a bare Jaxpr, the nf4
    # read's closed-over shifts became an input and every QLoRA step on an nf4 base failed (KeyError)
    from precision.blockwise.program import flatten, read, run

    q = precision.quantize_weight(jax.random.normal(jax.random.key(0), (64, 96)), "nf4")
    x = jax.random.normal(jax.random.key(1), (3, 64))
    f = lambda q, x: x @ precision.quantized_weights.read_in_program({"w": q})["w"]  # noqa: E731
    closed = jax.make_jaxpr(f)(q, x)
    program = flatten(closed)
    env = dict(zip(program.inputs, jax.tree_util.tree_leaves((q, x)))) | program.consts
    run(program.ops, env)
    np.testing.assert_array_equal(np.asarray(read(env, program.outputs[0])), np.asarray(jax.jit(f)(q, x)))
