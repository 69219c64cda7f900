"""``python -m train CONFIG --explain``: what the experiment's policy does to its model.

Builds the experiment's data and model as :func:`train.run` would and traces
one training step's forward and backward pass (abstractly: nothing is
computed, no workdir is touched) with :func:`precision.explain`.
"""

from __future__ import annotations

import precision
from train import config as config_lib
from train.config import ExperimentConfig
from train.binding import bind
from train.loop import build_experiment
from train.state import explain_model

__all__ = ["explain_experiment"]


def explain_experiment(config: ExperimentConfig) -> precision.Explanation:
    """The :class:`precision.Explanation` of the model ``config`` trains, on one
    training micro-batch, under its policy, rules and op lists."""
    data, _, model = build_experiment(config)
    wrapped = bind(model, config.precision.policy, config.precision.rules,
                   ops=config_lib.build_op_lists(config.precision), autocast=config.precision.autocast)
    return explain_model(wrapped, data.sample_input(config.data.batch_size), train=True, backward=True)
