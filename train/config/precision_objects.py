"""The objects a config's precision section describes: the autocast op lists and the loss scale,
built once its fields are valid (the section's validator builds them to check them). ``p``: a
:class:`~train.config.schema.PrecisionConfig`."""

from __future__ import annotations

import re
from typing import Any

import precision
from train.config.errors import ConfigError

__all__ = ["build_op_lists", "build_loss_scale"]


def build_op_lists(p: Any) -> precision.OpLists | None:
    """The autocast op lists the precision section describes (None: the defaults)."""
    if (not (p.allow or p.deny or p.follow) and p.fuse_attention and p.fuse_norms and p.blockwise_loss == "auto"
            and p.split_projections):
        return None
    try:
        return precision.op_lists(allow=p.allow, deny=p.deny, follow=p.follow, fuse_attention=p.fuse_attention,
                                  fuse_norms=p.fuse_norms, blockwise_loss=p.blockwise_loss,
                                  split_projections=p.split_projections)
    except (TypeError, precision.PolicyError) as e:
        raise ConfigError(f"precision.allow/deny/follow: {e}") from None


def build_loss_scale(p: Any) -> precision.LossScale:
    """The loss scale the precision section describes."""
    kind = p.loss_scale
    if kind == "auto":
        auto = precision.get_loss_scale("auto", p.policy)
        kind = "dynamic" if isinstance(auto, precision.DynamicLossScale) else "none"
    try:
        # Checked whatever the kind: a setting given is a valid setting, also when auto resolves to none
        # (the initial scale against max_scale only where it starts a dynamic scale).
        dynamic = precision.DynamicLossScale(
            p.initial_scale if kind == "dynamic" else p.min_scale, period=p.growth_interval, factor=p.growth_factor,
            min_loss_scale=p.min_scale, backoff_factor=p.backoff_factor, max_loss_scale=p.max_scale,
            hysteresis=p.hysteresis)
        if kind == "dynamic":
            return dynamic
        precision.StaticLossScale(p.initial_scale)
        return precision.get_loss_scale(kind, p.policy, initial_scale=p.initial_scale)
    except ValueError as e:
        raise ConfigError(f"precision: {_config_names(str(e))}") from None


#: The loss scales' argument names, as the precision section names them.
_CONFIG_NAMES = ((r"\bmin_loss_scale\b", "min_scale"), (r"\bmax_loss_scale\b", "max_scale"),
                 (r"\bloss_scale\b", "initial_scale"), (r"\bperiod\b", "growth_interval"),
                 (r"\bfactor\b", "growth_factor"), (r"^(Dynamic|Static)LossScale: ", ""))


def _config_names(message: str) -> str:
    for pattern, name in _CONFIG_NAMES:
        message = re.sub(pattern, name, message)
    return message
