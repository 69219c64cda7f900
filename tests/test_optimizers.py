"""Any optax optimizer and schedule, or the user's own, from a config: names and
arguments checked in one line, the objects built as optax would, training under
mixed precision and the lean stored-state policies, and resuming bit for bit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from docs_pages import ROOT, blocks
from helpers import assert_bitwise_equal, saved_leaves
import precision
from precision.quantized import Blockwise, dequantize
from train import ConfigError, build_optimizer, create_train_state, load_config, make_train_step, read_metrics, run
from train.config import from_dict, to_dict
from train.data import load_dataset
from train.models import MLP

DEFAULT = ROOT / "configs" / "default.yaml"
EXAMPLE = ROOT / "examples" / "user_models" / "my_optimizer.py"
DIGITS = load_dataset("digits")
PARAMS = {"w": jnp.arange(12.0).reshape(4, 3) / 10 - 0.5, "b": jnp.ones(3)}
GRADS = jax.tree_util.tree_map(lambda p: 0.5 * p + 0.1, PARAMS)


def _opt(**raw):
    return from_dict({"optimizer": raw}).optimizer


def _first_update(tx):
    return tx.update(GRADS, tx.init(PARAMS), PARAMS)[0]


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("raw", [
    {"name": "lamb"}, {"name": "adafactor", "weight_decay": 1e-4}, {"name": "muon"}, {"name": "rmsprop", "eps": 1e-6},
    {"name": "rmsprop", "weight_decay": 0.0},  # no weight decay: nothing to pass
    {"name": "path/to/opt.py:make", "momentum": 0.5},  # a factory's arguments are checked when built
    {"schedule": "exponential_decay", "schedule_options": {"decay_rate": 0.5}}, {"schedule": "pkg.sched:make"},
])
def test_optax_names_and_references_parse(raw):
    assert _opt(**raw).name == raw.get("name", "adamw")


@pytest.mark.parametrize("raw, message", [
    ({"name": "lamm"}, "optimizer.name: unknown optimizer 'lamm'. Did you mean 'lamb'? Valid: adam, adamw, sgd, lion, "
                       "an optax optimizer (acprop, adabelief"),
    ({"name": "lamm"}, "lamb, lars, lbfgs"),
    ({"name": "lamm"}, "), or a factory path/to/file.py:make / package.module:make"),
    ({"name": "pkg.mod:"}, "optimizer.name: 'pkg.mod:' is not a factory reference of the form path/to/file.py:make"),
    ({"name": "lamb", "options": {"eps_rot": 0.0}}, "optimizer.options.eps_rot: optax.lamb takes no argument "
     "'eps_rot'. Did you mean 'optimizer.options.eps_root'? Its arguments: learning_rate, b1, b2, eps, eps_root, "
     "weight_decay, mask"),
    ({"name": "lamb", "momentum": 0.5}, "optimizer.momentum: optax.lamb takes no argument 'momentum' "
                                        "(optimizer.momentum=0.5 is set)"),
    ({"name": "rmsprop", "weight_decay": 1e-4}, "optimizer.weight_decay: optax.rmsprop takes no argument "
                                                "'weight_decay'"),
    ({"name": "lamb", "b1": 0.8, "options": {"b1": 0.7}}, "optimizer.options.b1: set twice, as optimizer.b1 too"),
    ({"name": "dpsgd"}, "optimizer.options.l2_norm_clip: optax.contrib.dpsgd needs argument 'l2_norm_clip'; set "
                        "optimizer.options.l2_norm_clip, optimizer.options.noise_multiplier, optimizer.options.seed"),
    ({"name": "lamb", "options": {"learning_rate": 1.0}}, "optimizer.options.learning_rate: the learning rate comes "
                                                          "from optimizer.lr and optimizer.schedule"),
    ({"name": "adam", "options": {"b1": 0.5}}, "optimizer.options.b1: adam takes it from optimizer.b1"),
    ({"name": "lion", "options": {"eps": 0.5}}, "optimizer.options.eps: optax.lion takes no argument 'eps'"),
    ({"schedule": "cosine_decay"}, "optimizer.schedule: unknown schedule 'cosine_decay'. Did you mean "
                                   "'cosine_decay_schedule'?"),
    ({"schedule": "exponential_decay"}, "optimizer.schedule_options.decay_rate: optax.exponential_decay needs "
                                        "argument 'decay_rate'"),
    ({"schedule": "linear_schedule", "schedule_options": {"end_val": 0.0}}, "optimizer.schedule_options.end_val: "
     "optax.linear_schedule takes no argument 'end_val'. Did you mean 'optimizer.schedule_options.end_value'?"),
    ({"schedule": "cosine", "schedule_options": {"alpha": 0.1}}, "optimizer.schedule_options: the built-in schedule "
                                                                 "'cosine' takes none"),
])
def test_bad_names_and_arguments_fail_in_one_line_naming_the_key(raw, message):
    with pytest.raises(ConfigError) as info:
        _opt(**raw)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_assignment_is_checked_and_a_file_field_is_named_with_its_file(tmp_path):
    c = from_dict({"optimizer": {"momentum": 0.5}})
    with pytest.raises(ConfigError, match="optimizer.momentum: optax.lamb takes no argument"):
        c.optimizer.name = "lamb"
    assert c.optimizer.name == "adamw"  # a failed assignment leaves the value as it was
    with pytest.raises(ConfigError, match=r"default.yaml: optimizer.weight_decay: optax.rmsprop takes no argument"):
        load_config(DEFAULT, ["optimizer.name=rmsprop"])
    assert load_config(DEFAULT, ["optimizer.name=adafactor"]).optimizer.weight_decay == 1e-4


def test_a_dump_keeps_only_the_fields_set_so_it_reads_back_the_same():
    c = from_dict({"optimizer": {"name": "lamb", "b1": 0.8}})
    dumped = to_dict(c)["optimizer"]
    assert dumped["b1"] == 0.8 and not {"b2", "eps", "momentum", "nesterov", "weight_decay"} & set(dumped)
    again = from_dict(to_dict(c)).optimizer
    chex.assert_trees_all_close(_first_update(build_optimizer(again, 10)[0]),
                                _first_update(build_optimizer(c.optimizer, 10)[0]))
    assert {"b2", "momentum", "nesterov"} <= set(to_dict(from_dict({}))["optimizer"])  # the built-ins: every field


# ----------------------------------------------------------------------------- building


@pytest.mark.parametrize("raw, reference", [
    ({"name": "lamb", "lr": 0.01, "weight_decay": 0.1, "options": {"eps_root": "1e-8"}},  # YAML 1.1's 1e-8 string
     optax.lamb(0.01, weight_decay=0.1, eps_root=1e-8)),
    ({"name": "adafactor", "lr": 0.01, "weight_decay": 0.1, "momentum": 0.5, "options": {"decay_rate": 0.5}},
     optax.adafactor(0.01, weight_decay_rate=0.1, momentum=0.5, decay_rate=0.5)),
    ({"name": "lars", "lr": 0.1, "nesterov": True}, optax.lars(0.1, nesterov=True)),
    ({"name": "adamw", "lr": 0.01, "options": {"nesterov": True}},  # a built-in's fields as always, and options
     optax.adamw(0.01, 0.9, 0.999, 1e-8, weight_decay=0.0, nesterov=True)),
])
def test_build_optimizer_gives_what_optax_gives(raw, reference):
    tx, schedule = build_optimizer(_opt(**raw), 100)
    assert float(schedule(7)) == pytest.approx(raw["lr"])
    chex.assert_trees_all_close(_first_update(tx), _first_update(reference), rtol=1e-6)


@pytest.mark.parametrize("raw, steps, expected", [
    ({"schedule": "cosine", "lr": 1.0, "warmup_steps": 10, "min_lr": 0.1}, 110,  # the built-in, unchanged
     {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.55, 110: 0.1}),
    ({"schedule": "warmup_cosine_decay_schedule", "lr": 1.0, "warmup_steps": 10, "min_lr": 0.1}, 110,
     {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.5)), 110: 0.1}),  # its own warmup
    ({"schedule": "exponential_decay", "lr": 1.0, "warmup_steps": 20, "schedule_options": {"decay_rate": 0.5}}, 100,
     {10: 0.5, 20: 1.0, 60: 0.5 ** 0.5, 100: 0.5}),  # the warmup joined in front, decaying over the 80 after it
    ({"schedule": "piecewise_constant_schedule", "lr": 2.0, "schedule_options": {"boundaries_and_scales": {50: 0.1}}},
     100, {0: 2.0, 49: 2.0, 50: 0.2}),
    ({"schedule": "polynomial_schedule", "lr": 1.0, "min_lr": 0.2, "schedule_options": {"power": 2}}, 10,
     {0: 1.0, 5: 0.8 * 0.25 + 0.2, 10: 0.2}),
    ({"schedule": "cosine_onecycle_schedule", "lr": 1.0, "schedule_options": {"pct_start": 0.5}}, 100,
     {0: 1 / 25, 50: 1.0, 100: 1 / 25 / 1e4}),
])
def test_optax_schedules_get_lr_steps_and_min_lr_from_the_config(raw, steps, expected):
    _, schedule = build_optimizer(_opt(**raw), steps)
    got = {step: float(schedule(step)) for step in expected}
    np.testing.assert_allclose(list(got.values()), list(expected.values()), rtol=1e-5, atol=1e-7, err_msg=str(got))


USER_CODE = """
import optax
import optax.contrib

def make(learning_rate, decay=0.9):
    return optax.chain(optax.scale_by_rms(decay=decay), optax.scale_by_learning_rate(learning_rate))

def fixed():
    return optax.sgd(0.1)

def not_an_optimizer(learning_rate):
    return 3

def plateau(learning_rate):
    return optax.chain(optax.adam(learning_rate), optax.contrib.reduce_on_plateau(patience=2))

def halve(lr, steps):
    return lambda step: lr * 0.5 ** (step / steps)
"""


def test_a_user_factory_from_a_file_is_called_with_its_options_and_checked(tmp_path):
    (tmp_path / "opt.py").write_text(USER_CODE)
    ref = f"{tmp_path}/opt.py"
    tx, _ = build_optimizer(_opt(name=f"{ref}:make", lr=0.1, options={"decay": 0.5}), 12)
    reference = optax.chain(optax.scale_by_rms(decay=0.5), optax.scale_by_learning_rate(0.1))
    chex.assert_trees_all_close(_first_update(tx), _first_update(reference))
    _, schedule = build_optimizer(_opt(lr=0.1, schedule=f"{ref}:halve", warmup_steps=2), 12)
    np.testing.assert_allclose([float(schedule(s)) for s in (1, 2, 12)], [0.05, 0.1, 0.05], rtol=1e-6)  # 10 after
    fixed, none = build_optimizer(_opt(name=f"{ref}:fixed"), 12)
    assert none is None and _first_update(fixed)["b"].shape == (3,)  # its learning rate is its own
    build_optimizer(_opt(name=f"{ref}:plateau"), 12)  # reads value=, which a train step gives: the loss
    (tmp_path / "run.yaml").write_text("optimizer: {name: opt.py:make, options: {decay: 0.5}}\n")
    assert load_config(tmp_path / "run.yaml").optimizer.name == f"{ref}:make"  # found next to the config
    for raw, message in [
        ({"name": f"{ref}:make", "options": {"decy": 0.5}}, f"optimizer.options.decy: {ref}:make takes no argument "
         "'decy'. Did you mean 'optimizer.options.decay'? Its arguments: learning_rate, decay"),
        ({"name": f"{ref}:make", "b1": 0.5}, f"optimizer.b1: {ref}:make takes no argument 'b1'"),
        ({"name": f"{ref}:fixed", "lr": 0.1}, f"optimizer.lr: {ref}:fixed takes no learning_rate, so optimizer.lr "
                                              "would be unused"),
        ({"name": f"{ref}:not_an_optimizer"}, "returned a int, not an optax GradientTransformation"),
        ({"name": f"{ref}:mkae"}, "has no attribute 'mkae'. Did you mean 'make'?"),
        ({"name": f"{tmp_path}/none.py:make"}, "optimizer.name: file"),
        ({"schedule": f"{ref}:halve", "schedule_options": {"rate": 2}}, f"optimizer.schedule_options.rate: {ref}:halve "
                                                                        "takes no argument 'rate'"),
        ({"name": "lbfgs"}, "optimizer.name: optax.lbfgs's update needs arguments a train step does not give "
                            "(TypeError: "),
    ]:
        with pytest.raises(ConfigError) as info:
            build_optimizer(_opt(**raw), 12)
        assert message in str(info.value) and "\n" not in str(info.value)


def test_the_docs_yaml_and_the_example_factory_build():
    section = [b for b in blocks(ROOT / "docs" / "experiments.md") if b.section == "Optimizers and schedules"]
    _, schedule = build_optimizer(from_dict(yaml.safe_load(next(b for b in section if b.lang == "yaml").text))
                                  .optimizer, 1000)
    np.testing.assert_allclose([float(schedule(s)) for s in (0, 100, 1000)], [0.0, 1e-2, 1e-4], rtol=1e-6)
    config = load_config(DEFAULT, [f"optimizer.name={EXAMPLE}:make", f"optimizer.schedule={EXAMPLE}:inverse_sqrt"])
    tx, schedule = build_optimizer(config.optimizer, 1000)
    np.testing.assert_allclose([float(schedule(s)) for s in (50, 100, 400)], [5e-4, 1e-3, 5e-4], rtol=1e-6)
    zero = jax.tree_util.tree_map(jnp.zeros_like, PARAMS)
    updates = tx.update(zero, tx.init(PARAMS), PARAMS)[0]  # no gradient: only the decay, of the matrix alone
    assert float(jnp.abs(updates["w"]).sum()) > 0 and float(jnp.abs(updates["b"]).sum()) == 0


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("policy, tx, stored", [
    ("mixed_bf16", optax.lamb(3e-3), jnp.float32),  # an optimizer that reads the params in its update
    ("lean_bf16", optax.adafactor(1e-2), jnp.bfloat16),  # factored moments, stored in bfloat16
    ("lean_int8", optax.lamb(3e-3), Blockwise),  # moments in 8-bit blocks
])
def test_create_train_state_takes_any_optax_optimizer_under_any_policy(policy, tx, stored):
    state = create_train_state(MLP(hidden=(64,), num_classes=10), policy, tx, jax.random.PRNGKey(0),
                               DIGITS.sample_input(1), max_grad_norm=1.0)
    inner = jax.tree_util.tree_leaves(state.opt_state.inner_state, is_leaf=lambda x: isinstance(x, Blockwise))
    kinds = {Blockwise if isinstance(x, Blockwise) else x.dtype for x in inner if isinstance(x, Blockwise) or x.ndim}
    expected = stored if stored is Blockwise else jnp.dtype(stored)
    assert expected in kinds and kinds <= {expected, jnp.dtype(jnp.bfloat16)}  # int8: small arrays in bfloat16
    step = make_train_step(donate=False)
    losses = []
    for i in range(12):
        state, metrics = step(state, DIGITS.train_batch(i, 64, 0))
        losses.append(float(metrics["loss"]))
    assert bool(metrics["grads_finite"]) and np.mean(losses[-3:]) < losses[0] - 0.2, losses


def test_an_optax_optimizer_and_schedule_from_yaml_train_and_resume_bit_for_bit(tmp_path):
    config = {"steps": 8, "log_every": 1, "checkpoint_every": 4, "eval_every": 0, "progress": False,
              "inference_dtypes": [], "compile_cache": None,
              "model": {"name": "mlp", "hidden": [32]},
              "data": {"name": "digits", "batch_size": 32, "eval_batches": 1},
              "optimizer": {"name": "lamb", "lr": 1.0e-2, "weight_decay": 1.0e-4, "min_lr": 1.0e-3,
                            "schedule": "warmup_cosine_decay_schedule", "warmup_steps": 2},
              "precision": {"policy": "mixed_f16"}}
    (tmp_path / "lamb.yaml").write_text(yaml.safe_dump(config))

    def load(name):
        return load_config(tmp_path / "lamb.yaml", [f"workdir={tmp_path / name}"])

    run(load("straight"), out=open("/dev/null", "w"))
    records = [r for r in read_metrics(str(tmp_path / "straight")) if r["kind"] == "train"]
    assert records[-1]["loss"] < records[0]["loss"]
    _, schedule = build_optimizer(load("straight").optimizer, 8)
    checked = [r for r in records if r["skipped_steps"] == 0]
    assert checked and all(r["learning_rate"] == pytest.approx(float(schedule(r["step"] - 1))) for r in checked)

    def interrupt(record):
        if record["kind"] == "train" and record["step"] == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt, match="saved a checkpoint at step 6"):
        run(load("resumed"), out=open("/dev/null", "w"), on_record=interrupt)
    run(load("resumed"), out=open("/dev/null", "w"))
    assert_bitwise_equal(saved_leaves(tmp_path / "straight")[1], saved_leaves(tmp_path / "resumed")[1])


def _schedule_free(opt_state):
    return [s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.contrib.ScheduleFreeState))
            if isinstance(s, optax.contrib.ScheduleFreeState)][0]


@pytest.mark.parametrize("policy", ["fp32", "mixed_f16", "pure_bf16", "lean_bf16", "lean_int8"])
def test_a_schedule_free_optimizer_is_evaluated_at_its_average_not_where_it_takes_gradients(policy):
    """schedule_free_adamw takes gradients at y; its model is x (optax.contrib.schedule_free_eval_params).
    The eval step computes at x: from the float32 masters where kept, with the state read as stored."""
    from train import make_eval_step

    model = MLP(hidden=(64,), num_classes=10)
    state = create_train_state(model, policy, optax.contrib.schedule_free_adamw(3e-2, warmup_steps=2),
                               jax.random.PRNGKey(0), DIGITS.sample_input(1))
    step = make_train_step(donate=False)
    for i in range(8):
        state, metrics = step(state, DIGITS.train_batch(i, 64, 0))
    assert bool(metrics["grads_finite"])
    free = _schedule_free(state.opt_state)
    masters = state.opt_state.master_params
    y = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), state.params if masters is None else masters)
    z = jax.tree_util.tree_map(lambda a: dequantize(a) if isinstance(a, Blockwise) else a.astype(jnp.float32),
                               free.z, is_leaf=lambda a: isinstance(a, Blockwise))
    evaluated = precision.evaluation_params(state.params, state.opt_state)
    expected = optax.contrib.schedule_free_eval_params(free._replace(z=z), y)  # optax's formula, float32 state
    chex.assert_trees_all_close(evaluated, expected, rtol=1e-6, atol=1e-7)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(evaluated),
                                                             jax.tree_util.tree_leaves(y)))
    assert moved > 1e-3  # x is not y: evaluating y would be another model

    batch = {**DIGITS.train_batch(100, 64, 0), "mask": np.ones(64, bool)}
    sums = make_eval_step()(state, batch)
    at_x = make_eval_step()(state.replace(params=jax.tree_util.tree_map(
        lambda e, p: e.astype(p.dtype), evaluated, state.params), opt_state=optax.adam(1.0).init(state.params)), batch)
    at_y = make_eval_step()(state.replace(opt_state=optax.adam(1.0).init(state.params)), batch)
    # the same params, though computed in the eval step (XLA fuses the average into its first matmul)
    np.testing.assert_allclose(float(sums["loss_sum"]), float(at_x["loss_sum"]), rtol=2e-5)
    assert abs(float(at_y["loss_sum"]) - float(at_x["loss_sum"])) > 1e-3 * abs(float(at_x["loss_sum"]))
