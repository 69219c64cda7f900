"""Per-module precision rules: which modules deviate from the model's policy.

A rule is a ``(pattern, policy)`` pair. A pattern matches a module when it is
the name of the module's class (or of a base class), or a glob matching its
path (``"encoder/block_3/attn"``) or the trailing segments of it (``"attn"``,
``"block_*/attn"``). Rules are tried in order; the first match wins; a module
no rule matches follows its parent, so a rule on ``"attn"`` covers every layer
inside the attention block.

A matched module keeps its params in the rule's param dtype and computes in the
rule's compute dtype; its outputs return to the enclosing compute dtype, so one
float32 LayerNorm does not silently turn the rest of the network to float32.

A rule's matmul precision (``("attn", "f32,matmul=highest")``: true float32, not
TF32) applies inside the module; a rule that leaves it ``default`` keeps the
enclosing module's, so a policy's ``matmul=highest`` reaches the float32 islands
its rules make (see :func:`rule_policy`).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Iterable, NamedTuple, Sequence

from precision.policy import Policy, PolicyError, get_policy

__all__ = ["Rule", "NORM_CLASSES", "SOFTMAX_PATTERNS", "norm_rules", "default_rules",
           "get_rules", "as_rules", "match_rule", "rule_policy"]

#: Normalization layers kept in float32 by default (Apex keep_batchnorm_fp32,
#: Paddle O2, Haiku's ImageNet example).
NORM_CLASSES = ("BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm", "InstanceNorm")

#: Modules computing attention probabilities, kept in float32 by preset O1.
SOFTMAX_PATTERNS = ("Softmax", "*softmax*")

_FULL = Policy("f32", "f32", "f32")


class Rule(NamedTuple):
    """Modules matching ``pattern`` follow ``policy`` (params and compute dtypes)."""

    pattern: str
    policy: Policy


def norm_rules() -> tuple[Rule, ...]:
    """Rules keeping every normalization layer in float32."""
    return tuple(Rule(name, _FULL) for name in NORM_CLASSES)


def default_rules() -> tuple[Rule, ...]:
    """The rules used when none are given: normalization layers in float32."""
    return norm_rules()


def get_rules(spec: "str | Policy") -> tuple[Rule, ...]:
    """The rules that go with a policy spec or preset name.

    ``O1`` adds float32 softmax modules to the norm rules; ``O3`` has none
    (pure half), also followed by ``,matmul=...``; every other spec gets :func:`default_rules`.
    """
    name = spec.partition(",")[0].strip().upper() if isinstance(spec, str) else ""
    if name == "O1":
        return norm_rules() + tuple(Rule(p, _FULL) for p in SOFTMAX_PATTERNS)
    if name == "O3":
        return ()
    return default_rules()


def as_rules(rules: "Iterable[Any] | None") -> tuple[Rule, ...]:
    """Validates ``[(pattern, policy_or_spec), ...]`` into a tuple of Rules."""
    if rules is None:
        return default_rules()
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise TypeError("rules must be a list of (pattern, policy) pairs, e.g. "
                        f"[('LayerNorm', 'f32')]; got {rules!r}")
    out = []
    for i, item in enumerate(rules):
        if not (isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2):
            raise TypeError(f"rules[{i}] must be a (pattern, policy) pair, got {item!r}")
        pattern, policy = item
        if not isinstance(pattern, str) or not pattern.strip():
            raise TypeError(f"rules[{i}]: pattern must be a non-empty string, got {pattern!r}")
        try:
            out.append(Rule(pattern.strip(), get_policy(policy)))
        except PolicyError as e:
            raise PolicyError(f"rules[{i}] ({pattern!r}): {e}", spec=e.spec, token=e.token,
                              position=e.position) from None
    return tuple(out)


def _matches(pattern: str, path: str, class_names: Sequence[str]) -> bool:
    if pattern in class_names:
        return True
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*/" + pattern)


def match_rule(rules: Sequence[Rule], path: str, class_names: Sequence[str]) -> Rule | None:
    """The first rule matching a module (by path or class name), or None."""
    for rule in rules:
        if _matches(rule.pattern, path, class_names):
            return rule
    return None


def rule_policy(rule: Rule, enclosing: Policy) -> Policy:
    """The policy of a module ``rule`` matches inside a module under ``enclosing``: the
    rule's, its matmul precision the enclosing one's where the rule leaves it ``default``
    (a rule cannot ask for XLA's default inside a module that asks for more)."""
    if rule.policy.matmul_precision != "default" or enclosing.matmul_precision == "default":
        return rule.policy
    return rule.policy.with_matmul_precision(enclosing.matmul_precision)


def class_names_of(obj: Any) -> tuple[str, ...]:
    """Names of the object's class and its bases, most specific first."""
    return tuple(c.__name__ for c in type(obj).__mro__ if c is not object)


class Resolver:
    """Resolves the effective policy of each module path, with inheritance."""

    def __init__(self, policy: Policy, rules: Sequence[Rule], classes: dict[tuple[str, ...], tuple[str, ...]]):
        self.policy = policy
        self.rules = tuple(rules)
        self.classes = classes
        self._cache: dict[tuple[str, ...], Policy] = {}

    def __call__(self, path: tuple[str, ...]) -> Policy:
        """The policy of the module at ``path`` (a tuple of names; () is the root)."""
        if path in self._cache:
            return self._cache[path]
        parent = self(path[:-1]) if path else self.policy
        rule = match_rule(self.rules, "/".join(path), self.classes.get(path, ()))
        policy = parent if rule is None else rule_policy(rule, parent)
        self._cache[path] = policy
        return policy
