"""What a step sends between devices: its collectives, their dtypes and bytes.

Mixed precision should halve communication as it halves compute: FSDP's
param all-gathers in the compute dtype, gradient reductions in a chosen one.
Whether it does is decided by XLA's SPMD partitioner, so it is read from the
program XLA partitions, not assumed: :func:`explain_communication` lists each
collective of a jitted step with its kind, dtype, array bytes, bytes each
device sends, and what it carries (params, gradients, activations, scalars).

``stage="partitioned"`` (the default) reads the program right after SPMD
partitioning, before backend-specific rewrites: what a GPU or TPU sends.
There a sharded (FSDP) param's gradient is an all-reduce followed by a slice of
each device's part (:attr:`Collective.parts`); XLA's GPU and TPU pipelines can
rewrite that pair into a reduce-scatter, which sends about half
(:attr:`Collective.scattered_sent_bytes`), and ``stage="compiled"`` on them
shows whether they did.
XLA's CPU backend then widens 16-bit collectives to float32 (it has no 16-bit
collectives), which ``stage="compiled"`` shows: what this backend sends.
"""

from __future__ import annotations

import glob
import math
import os
import re
import tempfile
from typing import Any, Callable, NamedTuple

import jax

from urllib.parse import unquote

from precision.autocast.regions import MODULE_PREFIX
from train.parallel.distributed import GATHER_SCOPE

__all__ = ["Collective", "CommunicationReport", "compile_partitioned", "explain_communication", "group_size",
           "hlo_collectives", "layer_of", "module_paths", "sent_fraction"]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?(?P<name>%?[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(KINDS)
    + r")(?P<start>-start)?\((?P<rest>.*)$", re.M)
_OP = re.compile(r"^\s*(?:ROOT\s+)?(?P<name>%?[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[\w\-]+)"
                 r"\((?P<args>[^)]*)\)", re.M)
#: Ops between an all-reduce and the slice that keeps a device's part, moving its values only.
_MOVES = frozenset({"transpose", "copy", "reshape", "bitcast", "convert"})
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
CARRIES = ("params", "gradients", "activations", "scalars")


class Collective(NamedTuple):
    """One collective of a program."""

    kind: str  # all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute
    dtype: str  # HLO element type: bf16, f16, f32...
    shape: tuple[int, ...]  # the whole array: gathered, reduced, or scattered from
    group: int  # devices in each group
    carries: str  # params, gradients, activations or scalars
    op_name: str  # JAX's name for the op it came from
    parts: int = 1  # an all-reduce whose result each device slices: it keeps 1/parts of it

    @property
    def scattered_sent_bytes(self) -> float:
        """Bytes each device would send were a sliced all-reduce a reduce-scatter over its
        group and an all-gather of the ``parts`` among the devices keeping the same one
        (:attr:`sent_bytes` for any other collective)."""
        n, k = self.group, self.parts
        if self.kind != "all-reduce" or k <= 1 or n % k:
            return self.sent_bytes
        replicas = n // k
        return self.bytes * (n - 1) / n + self.bytes / k * (replicas - 1) / replicas

    @property
    def bytes(self) -> int:
        """Bytes of the whole array on each device."""
        return math.prod(self.shape) * _BYTES.get(self.dtype, 4)

    @property
    def sent_bytes(self) -> float:
        """Bytes each device sends (ring algorithms): (n-1)/n of the array to gather,
        scatter or exchange, twice that for an all-reduce."""
        return self.bytes * sent_fraction(self.kind, self.group)


class CommunicationReport(NamedTuple):
    """The collectives of one program, at one stage of its compilation."""

    collectives: tuple[Collective, ...]
    stage: str  # "partitioned" or "compiled"
    backend: str
    modules: frozenset = frozenset()  # the model's module paths (:func:`module_paths`): what a layer is

    def select(self, carries: str | None = None, kind: str | None = None,
               dtype: str | None = None) -> list[Collective]:
        """The collectives that carry ``carries``, of ``kind``, in ``dtype`` (None: any)."""
        return [c for c in self.collectives if (carries is None or c.carries == carries)
                and (kind is None or c.kind == kind) and (dtype is None or c.dtype == dtype)]

    def bytes(self, carries: str | None = None, kind: str | None = None, dtype: str | None = None) -> int:
        """Array bytes of the selected collectives (see :meth:`select`)."""
        return sum(c.bytes for c in self.select(carries, kind, dtype))

    def sent_bytes(self, carries: str | None = None, kind: str | None = None, dtype: str | None = None) -> float:
        """Bytes each device sends for the selected collectives."""
        return sum(c.sent_bytes for c in self.select(carries, kind, dtype))

    def scattered_sent_bytes(self, carries: str | None = None, kind: str | None = None,
                             dtype: str | None = None) -> float:
        """:meth:`sent_bytes` with each sliced all-reduce sent as a reduce-scatter."""
        return sum(c.scattered_sent_bytes for c in self.select(carries, kind, dtype))

    def rows(self) -> list[dict[str, Any]]:
        """One row per (what it carries, kind, dtype): count, array bytes, bytes sent per device."""
        groups: dict[tuple[str, str, str], list[Collective]] = {}
        for c in self.collectives:
            groups.setdefault((c.carries, c.kind, c.dtype), []).append(c)
        order = {name: i for i, name in enumerate(CARRIES)}
        return [{"carries": carries, "kind": kind, "dtype": dtype, "count": len(cs),
                 "bytes": sum(c.bytes for c in cs), "sent_bytes": sum(c.sent_bytes for c in cs)}
                for (carries, kind, dtype), cs in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1:]))]

    def layers(self) -> list[dict[str, Any]]:
        """One row per (layer, what it carries, kind, dtype), a layer being a module path with its
        layer index made ``*`` (``model/layers/*/self_attn/o_proj``; from :attr:`modules`):
        collectives and bytes per layer (the program's, over the number of layers), largest first;
        collectives of no module under ``(outside any module)``."""
        groups: dict[tuple[str, str, str, str], list[Collective]] = {}
        indices: dict[str, set[str]] = {}
        for c in self.collectives:
            layer, index = layer_of(c.op_name, self.modules)
            groups.setdefault((layer, c.carries, c.kind, c.dtype), []).append(c)
            indices.setdefault(layer, set()).add(index)
        rows = [{"layer": layer, "carries": carries, "kind": kind, "dtype": dtype, "layers": len(indices[layer]),
                 "count": len(cs) / len(indices[layer]), "sent_bytes": sum(c.sent_bytes for c in cs) / len(indices[layer])}
                for (layer, carries, kind, dtype), cs in groups.items()]
        return sorted(rows, key=lambda r: -r["sent_bytes"] * r["layers"])

    def layer_lines(self, top: int = 20) -> list[str]:
        """:meth:`layers` as lines, the ``top`` that send most."""
        lines = [f"Collectives per layer ({self.stage} program; the {top} that send the most, each layer's share):",
                 f"  {'layer':<44}{'layers':>7}  {'carries':<12}{'kind':<16}{'dtype':<7}{'count':>6}"
                 f"{'sent MiB/device':>17}"]
        for r in [r for r in self.layers() if r["sent_bytes"] > 0][:top]:
            lines.append(f"  {r['layer'][-44:]:<44}{r['layers']:>7}  {r['carries']:<12}{r['kind']:<16}{r['dtype']:<7}"
                         f"{r['count']:>6.3g}{r['sent_bytes'] / 2 ** 20:>17.3f}")
        return lines

    def __str__(self) -> str:
        lines = [f"Collectives per step ({self.stage} program, {self.backend}):",
                 f"  {'carries':<12}{'kind':<16}{'dtype':<7}{'count':>6}{'array MiB':>11}{'sent MiB/device':>17}"]
        for r in self.rows():
            lines.append(f"  {r['carries']:<12}{r['kind']:<16}{r['dtype']:<7}{r['count']:>6}"
                         f"{r['bytes'] / 2 ** 20:>11.3f}{r['sent_bytes'] / 2 ** 20:>17.3f}")
        if not self.collectives:
            lines.append("  none: every array this step uses is on the device that uses it")
        total = sum(c.sent_bytes for c in self.collectives)
        lines.append(f"  total sent per device: {total / 2 ** 20:.3f} MiB")
        sliced = [c for c in self.collectives if c.scattered_sent_bytes < c.sent_bytes]
        if sliced:
            lines += [f"  {len(sliced)} all-reduces keep only each device's part of their sum (split params' "
                      f"gradients): as reduce-scatters",
                      f"  they would send {sum(c.scattered_sent_bytes for c in sliced) / 2 ** 20:.3f} MiB, not "
                      f"{sum(c.sent_bytes for c in sliced) / 2 ** 20:.3f} (XLA's GPU and TPU compilers can rewrite "
                      f"them so; stage='compiled' there shows it)"]
        if self.stage == "compiled" and self.backend == "cpu":
            lines.append("  (XLA's CPU backend widens 16-bit collectives to float32; stage='partitioned' shows "
                         "what a GPU sends)")
        return "\n".join(lines)


def layer_of(op_name: str, modules: frozenset = frozenset()) -> tuple[str, str]:
    """``(layer, index)`` of the op a collective came from: the module path its innermost
    ``precision.module=`` tag begins (the longest run of names that is a module of ``modules``,
    the param paths' prefixes, or leads to one), a layer index in it (a number a name is or holds
    between underscores: ``0``, ``block_0``, ``layers_0_attn``) made ``*``, and that index;
    ``("(outside any module)", "")`` for none."""
    tail = op_name.rpartition(MODULE_PREFIX)[2] if MODULE_PREFIX in op_name else None
    if tail is None:
        return "(outside any module)", ""
    names = [unquote(n) for n in tail.split("/")]
    known = [k for k in range(len(names) + 1) if tuple(names[:k]) in modules]
    names = names[:max(known)] if known else names[:1]
    index = ""
    for i, name in enumerate(names):
        match = re.search(r"(^|_)(\d+)(_|$)", name)
        if match and not index:
            index, names[i] = match.group(2), f"{name[:match.start(2)]}*{name[match.end(2):]}"
    return "/".join(names) or "(the model)", index


def module_paths(params: Any) -> frozenset:
    """Every module path of a params tree and its prefixes, as tuples of names."""
    from train.parallel.tensor.plan import key_names

    paths = {key_names(path)[:-1] for path, _ in jax.tree_util.tree_leaves_with_path(params)}
    return frozenset(p[:k] for p in paths for k in range(len(p) + 1))


def hlo_collectives(text: str, device_count: int) -> list[Collective]:
    """The collectives of an HLO module's text (a tuple-shaped, combined one counts
    once per array it carries)."""
    found = []
    users = _users(text) if "all-reduce" in text else {}
    arguments = _entry_parameters(text)
    stored = _entry_shapes(text) if "reduce-scatter" in text else frozenset()
    for m in _INSTRUCTION.finditer(text):
        kind, rest = m.group("kind"), m.group("rest")
        arrays = [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(m.group("shape"))]
        # a reduce-scatter XLA made of an all-reduce and a slice keeps no op name: it carries a
        # gradient where each device's part has the shape of a split param's (a step argument)
        gradient = kind == "reduce-scatter" and min(arrays, key=lambda a: math.prod(a[1]), default=None) in stored
        if m.group("start") and kind in ("all-gather", "reduce-scatter") and len(arrays) == 2:
            arrays = [max(arrays, key=lambda a: math.prod(a[1]))]  # (operand, result): the whole array
        group = _group_size(rest, device_count)
        if kind == "reduce-scatter" and not m.group("start"):
            arrays = [(dt, _scattered_from(shape, rest, group)) for dt, shape in arrays]
        op_name = re.search(r'op_name="([^"]*)"', rest)
        name = op_name.group(1) if op_name else ""
        parts = _parts(m.group("name"), users, arrays) if kind == "all-reduce" and not m.group("start") else 1
        # an all-gather of a step's argument is a stored array gathered whole, whatever op XLA
        # names in its metadata (on jax 0.11, FSDP's float32 and uint8 gathers were not found
        # in the gather scope)
        argument = kind == "all-gather" and _first_operand(rest) in arguments
        for dtype, shape in arrays:
            carries = "gradients" if gradient and not name else _carries(name, shape)
            found.append(Collective(kind, dtype, shape, group,
                                    "params" if argument and carries == "activations" else carries, name, parts))
    return found


def _entry_parameters(text: str) -> frozenset[str]:
    """The names of the entry computation's parameters (the step's arguments, split)."""
    entry = re.search(r"^ENTRY[^\n]*\{\n(?P<body>.*?)^\}", text, re.M | re.S)
    if entry is None:
        return frozenset()
    return frozenset(_percent(m.group("name")) for m in _OP.finditer(entry.group("body"))
                     if m.group("op") == "parameter")


def _entry_shapes(text: str) -> frozenset:
    """``(dtype, shape)`` of the entry computation's parameters (the step's arguments, split)."""
    entry = re.search(r"^ENTRY[^\n]*\{\n(?P<body>.*?)^\}", text, re.M | re.S)
    shapes = set()
    for m in _OP.finditer(entry.group("body") if entry else ""):
        if m.group("op") == "parameter":
            shapes.update((dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(m.group("shape")))
    return frozenset(shapes)


def _first_operand(rest: str) -> str:
    operand = re.match(r"\s*(?:[a-z][a-z0-9]*\[[0-9,]*\]\S*\s+)?(%?[\w.\-]+)", rest)
    return _percent(operand.group(1)) if operand else ""


def _users(text: str) -> dict[str, list[tuple[str, str, int]]]:
    """For each instruction name, its users: (name, opcode, elements of the result)."""
    users: dict[str, list[tuple[str, str, int]]] = {}
    for m in _OP.finditer(text):
        arrays = _ARRAY.findall(m.group("shape"))
        size = math.prod(int(d) for d in arrays[0][1].split(",") if d) if len(arrays) == 1 else -1
        for operand in re.findall(r"%[\w.\-]+", m.group("args")):
            users.setdefault(operand, []).append((_percent(m.group("name")), m.group("op"), size))
    return users


def _percent(name: str) -> str:
    return name if name.startswith("%") else "%" + name


def _parts(name: str, users: dict[str, list[tuple[str, str, int]]], arrays: list) -> int:
    """k where every use of an all-reduce's (one) result keeps 1/k of it: dynamic-slices
    of one size, reached through ops that only move values; 1 otherwise."""
    if len(arrays) != 1:
        return 1
    size, kept = math.prod(arrays[0][1]), set()
    pending = [_percent(name)]
    while pending:
        uses = users.get(pending.pop(), [])
        if not uses:
            return 1
        for name, op, elements in uses:
            if op in _MOVES:
                pending.append(name)
            elif op == "dynamic-slice" and 0 < elements < size and size % elements == 0:
                kept.add(size // elements)
            else:
                return 1
    return kept.pop() if len(kept) == 1 else 1


def _scattered_from(shape: tuple[int, ...], rest: str, group: int) -> tuple[int, ...]:
    dims = re.search(r"dimensions=\{(\d+)\}", rest)
    if not dims or not shape:
        return shape
    axis = int(dims.group(1))
    return tuple(d * group if i == axis else d for i, d in enumerate(shape))


def sent_fraction(kind: str, group: int) -> float:
    """Bytes each device sends per byte of the whole array (ring algorithms): ``(n-1)/n`` to
    gather, scatter or exchange, twice that for an all-reduce, the array for a permute."""
    if group <= 1:
        return 0.0
    return {"all-reduce": 2 * (group - 1) / group, "collective-permute": 1.0}.get(kind, (group - 1) / group)


def group_size(rest: str, device_count: int) -> int:
    """Devices per replica group of a collective (the text after its opcode), in any of the
    forms XLA prints them in (``device_count`` where it names none)."""
    return _group_size(rest, device_count)


def _group_size(rest: str, device_count: int) -> int:
    """Devices per replica group, from any of the forms XLA prints them in."""
    explicit = re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)
    if explicit:
        return len([d for d in explicit.group(1).split(",") if d])
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=", rest)
    if iota:
        return int(iota.group(1).split(",")[-1])
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\].*?\{('[^}]*')\}", rest)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes.get(axis, 1)) for axis in re.findall(r"'([^']+)'", mesh.group(2)))
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?", rest)
    if pairs:
        return 2
    return device_count


def _carries(op_name: str, shape: tuple[int, ...]) -> str:
    if math.prod(shape) <= 1:
        return "scalars"
    if "transpose(" in op_name:
        return "gradients"
    if GATHER_SCOPE in op_name:
        return "params"
    return "activations"


def explain_communication(fn: Callable, *args: Any, stage: str = "partitioned", **kwargs: Any
                          ) -> CommunicationReport:
    """The collectives of ``fn(*args, **kwargs)`` (a ``jax.jit`` function, such as
    :func:`train.make_train_step`'s step on a mesh), compiled but not run.

    ``stage``: ``"partitioned"`` (after XLA's SPMD partitioning: what a GPU or
    TPU sends) or ``"compiled"`` (what this backend runs).
    """
    if stage not in ("partitioned", "compiled"):
        raise ValueError(f"explain_communication: stage must be 'partitioned' or 'compiled', got {stage!r}")
    lowered = fn.lower(*args, **kwargs)
    text = _partitioned_text(lowered) if stage == "partitioned" else None
    if text is None:
        text, stage = lowered.compile().as_text(), "compiled"
    devices = max(1, jax.device_count())
    return CommunicationReport(tuple(hlo_collectives(text, devices)), stage, jax.default_backend())


def _partitioned_text(lowered: Any) -> str | None:
    """The HLO text right after SPMD partitioning (None where XLA wrote none)."""
    return compile_partitioned(lowered)[1]


def compile_partitioned(lowered: Any) -> tuple[Any, str | None]:
    """``lowered`` compiled, and its HLO text right after SPMD partitioning (None
    where XLA wrote none), from the one compilation."""
    with tempfile.TemporaryDirectory() as directory:
        compiled = lowered.compile({"xla_dump_to": directory, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        # XLA's GPU compiler names the pass spmd-partitioning, its TPU compiler tpu-spmd-partitioning
        files = [f for f in glob.glob(os.path.join(directory, "*.txt"))
                 if re.search(r"\.after_(tpu-)?spmd-partitioning\.", os.path.basename(f))]
        if not files:
            return compiled, None
        with open(max(files, key=os.path.getsize)) as f:
            return compiled, f.read()

