"""``python -m train CONFIG --explain``: what the experiment's policy does to its model.

Builds the experiment's data and model as :func:`train.run` would and traces
one training step's forward and backward pass (abstractly: nothing is
computed, no workdir is touched) with :func:`precision.explain`.
"""

from __future__ import annotations

import dataclasses

import precision
from train import config as config_lib
from train.config import ExperimentConfig
from train.data import load_dataset
from train.loop import build_model, check_model_fits_data

__all__ = ["explain_experiment"]


def explain_experiment(config: ExperimentConfig) -> precision.Explanation:
    """The :class:`precision.Explanation` of the model ``config`` trains, on one
    training micro-batch, under its policy, rules and op lists."""
    options = {k: v for k, v in dataclasses.asdict(config.data).items() if k != "name"}
    data = load_dataset(config.data.name, **options, seed=config.seed)
    model = build_model(config.model, data)
    check_model_fits_data(model, data, config.model.name)
    wrapped = precision.with_policy(model, config.precision.policy, config.precision.rules,
                                    ops=config_lib.build_op_lists(config.precision),
                                    autocast=config.precision.autocast)
    return precision.explain(wrapped, data.sample_input(config.data.batch_size), train=True)
