"""Finds how a model splits over ``tensor`` devices from its traced program, not from names.

Walking the program forward, each matmul that reads a param (a *weight*) with an activation
starts a *group*: its output features are labelled split (column-parallel). The label
follows the values computed from them (:mod:`.labels`: elementwise ops, heads made by
reshapes, attention's batched products over heads, fused q/k/v parts) until a matmul
contracts the split features with another weight: the row-parallel half of the pair, whose
product is a partial sum. A group is kept when every split value ends in such a matmul, or,
for a head, leaves the model (a vocabulary head: the loss reduces its logits across
devices). Anything else stops it (a norm over the split features, a residual add of whole
activations...) and its params stay whole, named with why. A lookup into a table of
tokens splits the vocabulary.

:func:`find` returns the params' splits, the params left whole, the sites the step rewrites
(:mod:`.sites`) and the sizes ``tensor`` does not divide.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import DropVar, Literal

from precision.autocast.program import scan_counts
from precision.autocast.regions import module_path, scope_names
from train.parallel.tensor.dims import dot_roles
from train.parallel.tensor.groups import Groups
from train.parallel.tensor.labels import ELEMENTWISE, Label, Stop, View, moved_label, moved_view
from train.parallel.tensor.sites import Column, Embedding, Row, Unfuse
from train.parallel.tensor.verdict import Found, verdict

__all__ = ["Found", "find"]

#: Sub-programs the rewrite reaches into (their sites are rewritten) and those it only reads.
_INTO = ("jit", "pjit", "remat2", "checkpoint", "scan")
_OPAQUE = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


class _Finder(Groups):
    def __init__(self, tensor: int, parts: dict):
        super().__init__()
        self.tensor = tensor
        self.parts = parts  # seed location -> parts of a fused matmul (from the first pass)
        self.reads: dict[tuple, list[str]] = {}  # param path -> why each read leaves it whole
        self.embeddings: dict[tuple, tuple] = {}  # param path -> (dim, module, size, location, site)
        self.seed_at: dict[int, tuple] = {}  # group -> location of its first seed
        self.sequences: set = set()  # the sequence length of each result sequence parallelism would split

    # ------------------------------------------------------------------ the walk

    def walk(self, jaxpr: Any, env: dict, loc: tuple, prefix: tuple, top: bool, opaque: bool) -> list:
        """Follows ``jaxpr`` with ``env`` (var -> its fact: a View, a Label, "float" for a whole
        floating activation, "input" for other values computed from the model's inputs);
        returns the facts of its outputs."""
        for i, eqn in enumerate(jaxpr.eqns):
            scope = prefix + scope_names(eqn.source_info.name_stack)
            facts = [_fact(env, v) for v in eqn.invars]
            outs = self.equation(eqn, facts, loc + (i,), scope, opaque)
            for var, fact in zip(eqn.outvars, outs):
                if not isinstance(var, DropVar) and fact is not None:
                    env[var] = fact
        results = [_fact(env, v) for v in jaxpr.outvars]
        if top:
            for fact in results:
                if isinstance(fact, Label):
                    self.group(fact.group).output = True
        return results

    def equation(self, eqn: Any, facts: list, loc: tuple, scope: tuple, opaque: bool) -> list:
        name = eqn.primitive.name
        module = "/".join(module_path(scope)) or "(outside any module)"
        labels = [f for f in facts if isinstance(f, Label)]
        views = [f for f in facts if isinstance(f, View)]
        if name in _INTO or name in _OPAQUE:
            return self.sub_program(eqn, facts, loc, scope, opaque or name in _OPAQUE, module)
        if name == "dot_general":
            return self.dot(eqn, facts, loc, module, opaque)
        if name == "gather" and isinstance(facts[0], View):
            return self.lookup(eqn, facts, loc, module, opaque)
        if views and not labels and len(eqn.outvars) == 1 and isinstance(facts[0], View) and len(views) == 1:
            moved = moved_view(eqn, facts[0])
            if moved is not None:
                return [moved]
        if labels:
            return self.carry(eqn, facts, labels, loc, module)
        for f in views:
            self.whole(f, f"read by {name} in {module}")
        return [_whole(eqn, facts)] * len(eqn.outvars)

    def whole(self, view: View, why: str) -> None:
        self.reads.setdefault(view.path, []).append(why)

    # ------------------------------------------------------------------ matmuls

    def dot(self, eqn: Any, facts: list, loc: tuple, module: str, opaque: bool) -> list:
        """A matmul: a pair's first half (a weight and a whole activation), its second (a weight
        and the split features contracted), or a product of split activations (attention)."""
        kinds = [_kind(f) for f in facts]
        if "view" in kinds and "label" in kinds:
            return self.row(eqn, facts, kinds.index("label"), kinds.index("view"), loc, module, opaque)
        if kinds.count("label") == 2:
            return self.batched(eqn, facts, module)
        if "label" in kinds:
            a = kinds.index("label")
            role, where = dot_roles(eqn, a)[facts[a].dim]
            other = facts[1 - a]
            if role == "free" and other != "float":
                return [facts[a]._replace(dim=where)]
            self.stop(facts[a], f"a product of the split features with a whole activation in {module}")
            return ["float"]
        if "view" in kinds and "float" in kinds and not opaque:
            return self.column(eqn, facts, kinds.index("view"), loc, module)
        for f in facts:
            if isinstance(f, View):
                self.whole(f, f"read by a matmul inside a custom derivative rule in {module}" if opaque
                           else f"a product with values computed from integers (a one-hot lookup?) in {module}"
                           if "input" in kinds else f"a product of two params in {module}")
        return [_whole(eqn, facts)]

    def column(self, eqn: Any, facts: list, w: int, loc: tuple, module: str) -> list:
        view, a = facts[w], 1 - w
        roles = dot_roles(eqn, w)
        shape = eqn.invars[w].aval.shape
        if any(role == "batch" for role, _ in roles.values()):
            self.whole(view, f"a batched product in {module}")
            return ["float"]
        free = [d for d, (role, _) in roles.items() if role == "free" and view.dims[d] is not None and shape[d] > 1]
        if not free:
            self.whole(view, f"a matmul with no output features in {module}")
            return ["float"]
        d = min(free)
        out_dim = roles[d][1]
        g = self.new_group()
        group = self.groups[g]
        parts = self.parts.get(loc, 1)
        size = shape[d]
        if size % (parts * self.tensor):
            group.sizes.append(f"the {size} output features of {module}" + (f" ({parts} fused parts)" if parts > 1
                                                                            else ""))
        group.seeds.append((view.path, view.dims[d], module, size, loc, parts))
        tokens = tuple(dot_roles(eqn, a)[t][1] for t in sorted(dot_roles(eqn, a)) if dot_roles(eqn, a)[t][0] == "free")
        group.sites[loc] = Column(a, w, d, out_dim, tokens, parts)
        self.seed_at.setdefault(g, loc)
        return [Label(out_dim, g, parts)]

    def row(self, eqn: Any, facts: list, a: int, w: int, loc: tuple, module: str, opaque: bool) -> list:
        label, view = facts[a], facts[w]
        role, other = dot_roles(eqn, a)[label.dim]
        if role != "contract" or opaque or view.dims[other] is None:
            self.stop(label, f"the split features meet a weight in {module} other than contracted")
            return ["float"]
        if label.parts > 1:
            self.stop(label, f"a fused matmul's parts contracted together in {module}")
            return ["float"]
        group = self.group(label.group)
        group.rows.append((view.path, view.dims[other], module))
        roles = dot_roles(eqn, a)
        tokens = tuple(roles[t][1] for t in sorted(roles) if roles[t][0] == "free")
        group.sites[loc] = Row(tokens, a, label.dim, tuple(t for t in sorted(roles) if roles[t][0] == "free"))
        self.sequences.add(eqn.outvars[0].aval.shape[tokens[1]] if len(tokens) > 1 else None)
        return ["float"]

    def batched(self, eqn: Any, facts: list, module: str) -> list:
        """A product of two split activations: fine where both split dimensions are the same
        batch dimension (heads), the result split along it."""
        roles = [dot_roles(eqn, s)[facts[s].dim] for s in (0, 1)]
        g = self.join([facts[0].group, facts[1].group])
        if roles[0][0] == roles[1][0] == "batch" and roles[0][1] == roles[1][1]:
            return [Label(roles[0][1], g)]
        self.groups[g].stop = self.groups[g].stop or f"a product across the split features in {module}"
        return ["float"]

    # ------------------------------------------------------------------ vocabularies

    def lookup(self, eqn: Any, facts: list, loc: tuple, module: str, opaque: bool) -> list:
        """A lookup into a param: a vocabulary (split) when the indices come from the inputs."""
        view, index = facts[0], facts[1]
        dims = eqn.params["dimension_numbers"]
        table = eqn.invars[0].aval.shape
        if index != "input" or opaque or len(dims.start_index_map) != 1 or len(table) != 2:
            self.whole(view, f"looked up at fixed positions in {module}" if index is None
                       else f"looked up in {module}")
            return [_whole(eqn, facts)]
        (d,) = dims.start_index_map
        out = eqn.outvars[0].aval.shape
        tokens = tuple(i for i in range(len(out)) if i not in dims.offset_dims)
        self.sequences.add(out[tokens[1]] if len(tokens) > 1 else None)
        self.embeddings.setdefault(view.path, (view.dims[d], module, table[d], loc, Embedding(tokens)))
        return ["float"]

    # ------------------------------------------------------------------ everything else

    def carry(self, eqn: Any, facts: list, labels: list, loc: tuple, module: str) -> list:
        """An op with split operands: elementwise ops, moves, splits and slices of fused parts."""
        name = eqn.primitive.name
        if name in ELEMENTWISE:
            return self.elementwise(eqn, facts, labels, loc, module)
        if name == "split" and len(labels) == 1:
            return self.split(eqn, labels[0], loc, module)
        if name == "slice":
            return self.slice(eqn, labels[0], loc, module)
        if name == "concatenate":
            dim = eqn.params["dimension"]
            if all(isinstance(f, Label) and f.dim == labels[0].dim != dim for f in facts):
                return [Label(labels[0].dim, self.join([f.group for f in facts]))]
            self.stop(labels[0], f"concatenates split features in {module}")
            return ["float"]
        if len(facts) == 1 or (name in ("pad",) and not isinstance(facts[1], Label)):
            moved = moved_label(eqn, labels[0])
            if isinstance(moved, Stop):
                self.stop(labels[0], f"{moved.why} in {module}")
                return ["float"]
            if eqn.primitive.name == "reshape":
                self.check_heads(eqn, labels[0], moved, module)
            return [moved]
        self.stop(labels[0], f"{name} in {module}")
        return ["float"] * len(eqn.outvars)

    def elementwise(self, eqn: Any, facts: list, labels: list, loc: tuple, module: str) -> list:
        out = eqn.outvars[0].aval.shape
        dims = {f.dim for f in labels}
        g = self.join([f.group for f in labels])
        label = Label(dims.pop(), g, max(f.parts for f in labels))
        if dims:
            self.groups[g].stop = self.groups[g].stop or f"split features meet other split features in {module}"
            return ["float"]
        d = label.dim
        for f, var in zip(facts, eqn.invars):
            shape = getattr(var.aval, "shape", ())
            wide = len(shape) == len(out) and shape[d] == out[d] and out[d] > 1
            if isinstance(f, View) and wide:
                if f.dims[d] is None:
                    self.stop(label, f"a param broadcast along the split features in {module}")
                    return ["float"]
                self.groups[g].features.append((f.path, f.dims[d], module, label.parts))
            elif f == "float" and wide:
                self.stop(label, f"the split features meet whole activations in {module} ({eqn.primitive.name})")
                return ["float"]
        return [label] * len(eqn.outvars)

    def split(self, eqn: Any, label: Label, loc: tuple, module: str) -> list:
        if eqn.params["axis"] != label.dim:
            return [label] * len(eqn.outvars)
        sizes = [int(s) for s in eqn.params["sizes"]]
        if len(set(sizes)) != 1:
            self.stop(label, f"splits the features into unequal parts in {module}")
            return ["float"] * len(sizes)
        return self.parts_of(label, len(sizes), loc, Unfuse(label.dim, len(sizes)), module, len(sizes))

    def slice(self, eqn: Any, label: Label, loc: tuple, module: str) -> list:
        d = label.dim
        start, limit = eqn.params["start_indices"][d], eqn.params["limit_indices"][d]
        size = eqn.invars[0].aval.shape[d]
        strides = eqn.params.get("strides")
        if (start, limit) == (0, size):
            return [label]
        part = limit - start
        if (strides and strides[d] != 1) or size % part or start % part:
            self.stop(label, f"slices the split features in {module}")
            return ["float"]
        return self.parts_of(label, size // part, loc, Unfuse(d, size // part, start // part), module, 1)

    def parts_of(self, label: Label, parts: int, loc: tuple, site: Unfuse, module: str, outputs: int) -> list:
        """The parts of a fused matmul's result (q, k, v of one kernel): each split on its own."""
        group = self.group(label.group)
        if label.parts == 1:  # the first pass: the matmul is fused, in this many parts
            group.parts = parts
            return [label] * outputs
        if label.parts != parts:
            self.stop(label, f"takes {parts} parts of a matmul fused in {label.parts} in {module}")
            return ["float"] * outputs
        group.sites[loc] = site
        return [label._replace(parts=1)] * outputs

    def check_heads(self, eqn: Any, before: Label, after: Label, module: str) -> None:
        """Features reshaped into heads: ``tensor`` must divide the heads (of each part)."""
        shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        heads = shape_out[after.dim]
        if heads % (self.tensor * before.parts):
            group = self.group(before.group)
            rest = shape_in[before.dim] // max(heads, 1)
            per = f"{heads // before.parts} heads per part" if before.parts > 1 else f"{heads} heads"
            seed = group.seeds[-1][2] if group.seeds else module
            group.sizes.append(f"the {per} of {seed} ({shape_in[before.dim]} features as {heads} x {rest}, in "
                               f"{module})")

    def sub_program(self, eqn: Any, facts: list, loc: tuple, scope: tuple, opaque: bool, module: str) -> list:
        name = eqn.primitive.name
        body = _body(eqn)
        if name == "scan":
            return self.scan(eqn, facts, body, loc, scope, opaque, module)
        inner = {v: f for v, f in zip(body.invars, facts[len(facts) - len(body.invars):]) if f is not None}
        return self.walk(body, inner, loc, scope, False, opaque)

    def scan(self, eqn: Any, facts: list, body: Any, loc: tuple, scope: tuple, opaque: bool, module: str) -> list:
        """A loop's body (a scan over layers): its params sliced along their first dimension."""
        consts, carry = scan_counts(eqn.params)
        inner = {}
        for i, (v, f) in enumerate(zip(body.invars, facts)):
            if isinstance(f, Label):
                self.stop(f, f"enters a loop in {module}")
                f = "float"
            if isinstance(f, View) and i >= consts + carry:
                f = View(f.path, f.dims[1:])
            if f is not None:
                inner[v] = f
        outs = self.walk(body, inner, loc, scope, False, opaque)
        results = []
        for f in outs:
            if isinstance(f, Label):
                self.stop(f, f"leaves a loop in {module}")
                f = "float"
            results.append(None if isinstance(f, View) else f)
        return results


def _fact(env: dict, var: Any) -> Any:
    if isinstance(var, Literal):
        return None
    return env.get(var)


def _kind(fact: Any) -> str | None:
    return {View: "view", Label: "label"}.get(type(fact), fact)


def _whole(eqn: Any, facts: list) -> Any:
    """The fact of a result computed whole: a floating activation if a floating operand (or
    a param) made it, "input" if the model's inputs did, else None (constants)."""
    if any(f == "float" or isinstance(f, (View, Label)) for f in facts):
        return "float" if any(_floating(v) for v in eqn.outvars) else "input"
    return "input" if "input" in facts else None


def _floating(var: Any) -> bool:
    dtype = getattr(var.aval, "dtype", None)
    return dtype is not None and getattr(dtype, "kind", "") == "f"


def _body(eqn: Any) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            body = eqn.params[key]
            return getattr(body, "jaxpr", body)
    raise KeyError(eqn.primitive.name)


def find(jaxpr: Any, inputs: list, tensor: int) -> Found:
    """The tensor-parallel plan of ``jaxpr`` (a model's program): ``inputs[i]`` is the param
    path of its input ``i`` (None for the batch and other inputs). Two passes: the first finds
    fused matmuls (q, k, v in one kernel), the second follows each with its parts."""
    first = _run(jaxpr, inputs, tensor, {})
    parts = {first.seed_at[g]: grp.parts for g, grp in enumerate(first.groups)
             if first.root(g) == g and grp.parts > 1 and len(grp.seeds) == 1}
    return _found(_run(jaxpr, inputs, tensor, parts), tensor)


def _run(jaxpr: Any, inputs: list, tensor: int, parts: dict) -> _Finder:
    finder = _Finder(tensor, parts)
    env = {}
    for var, path in zip(jaxpr.invars, inputs):
        if path is not None:
            env[var] = View(tuple(path), tuple(range(len(var.aval.shape))))
        else:
            env[var] = "float" if _floating(var) else "input"
    finder.walk(jaxpr, env, (), (), True, False)
    return finder


def _found(finder: _Finder, tensor: int) -> Found:
    return verdict(finder, tensor)  # the groups judged, the params' splits assembled
