"""Key maps between Hugging Face tensor names and a model's state_dict: renames and structural transforms.

A ``KeyMap`` says once how the tensors of a ``save_pretrained`` directory become the model's tensors;
``load_hf`` reads through it and ``save_hf`` writes through its inverse. It has renames (a dict of
names or ``*`` patterns, regex pairs, or a callable) and four structural transforms:

* ``Fuse(model, [hf, ...], dim)``: the model tensor is the HF tensors concatenated along ``dim``
  (``q_proj``/``k_proj``/``v_proj`` -> ``qkv``; ``gate_proj``/``up_proj`` -> ``w13``).
* ``Split(hf, [model, ...], dim)``: the HF tensor is the model tensors concatenated (fuse's mirror).
* ``Stack(model, hf, dim)``: per-expert HF tensors (``#`` in ``hf`` is the expert index 0..E-1)
  stacked into one ``[E, ...]`` model tensor along ``dim``.
* ``Transpose(model, hf)``: the model tensor is the 2-D HF tensor transposed.

In patterns ``*`` matches one dot-separated name part (``layers.*.mlp``) and is carried over to the
other side in order; ``#`` (Stack only) matches the expert index. Resolving a map against concrete
names gives ``Link``s: which box of which model tensor is which box of which HF tensor, and how
(``COPY``, ``TRANSPOSE`` or ``STACK``); the reader and the writer only ever see links. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .boxes import Box, full_box
from .errors import CheckpointError

COPY, TRANSPOSE, STACK = "copy", "transpose", "stack"

Shape = tuple[int, ...]
RenameSpec = Mapping[str, str] | Sequence[tuple[str, str]] | Callable[[str], str] | None


@dataclass(frozen=True)
class Fuse:
    """Model tensor ``model`` = the HF tensors ``hf`` concatenated along ``dim``.

    ``sizes`` (each source's extent along ``dim``) is needed only by ``save_hf`` to cut the fused tensor
    back; ``load_hf`` takes the sizes from the files (and checks them against ``sizes`` when given).
    """

    model: str
    hf: Sequence[str]
    dim: int = 0
    sizes: Sequence[int] | None = None


@dataclass(frozen=True)
class Split:
    """HF tensor ``hf`` = the model tensors ``model`` concatenated along ``dim`` (sizes from the model)."""

    hf: str
    model: Sequence[str]
    dim: int = 0


@dataclass(frozen=True)
class Stack:
    """Model tensor ``model`` = the HF tensors ``hf`` (``#`` = index 0..E-1) stacked along new dim ``dim``."""

    model: str
    hf: str
    dim: int = 0


@dataclass(frozen=True)
class Transpose:
    """Model tensor ``model`` = the 2-D HF tensor ``hf`` transposed."""

    model: str
    hf: str


Transform = Fuse | Split | Stack | Transpose


@dataclass(frozen=True)
class Link:
    """Box ``model_box`` of model tensor ``model`` is box ``hf_box`` of HF tensor ``hf``, through ``op``.

    COPY: same sizes. TRANSPOSE: 2-D, sizes reversed. STACK: ``model_box`` has size 1 at ``dim``, which
    ``hf_box`` lacks.
    """

    model: str
    model_box: Box
    hf: str
    hf_box: Box
    op: str = COPY
    dim: int = 0

    def to_hf(self, part: Box) -> Box:
        """The HF box holding ``part`` (global model indices, inside ``model_box``)."""
        rel = [o - b for o, b in zip(part.offsets, self.model_box.offsets)]
        sizes = list(part.sizes)
        if self.op == TRANSPOSE:
            rel, sizes = rel[::-1], sizes[::-1]
        elif self.op == STACK:
            del rel[self.dim], sizes[self.dim]
        return Box(tuple(h + r for h, r in zip(self.hf_box.offsets, rel)), tuple(sizes))


class _Pattern:
    """A name with ``*`` (one name part) and, optionally, ``#`` (an index) wildcards."""

    def __init__(self, text: str, *, where: str, index: bool = False) -> None:
        if not isinstance(text, str) or not text:
            raise CheckpointError(f"key map {where}: expected a non-empty name pattern, found {text!r}; fix: pass "
                                  "a tensor name, with * for one name part")
        if "#" in text and not index:
            raise CheckpointError(f"key map {where}: '#' (expert index) is allowed only in Stack's hf pattern, found "
                                  f"{text!r}; fix: use * for a name part")
        if index and text.count("#") != 1:
            raise CheckpointError(f"key map {where}: Stack's hf pattern needs exactly one '#' (the expert index), "
                                  f"found {text!r}; fix: e.g. 'model.layers.*.mlp.experts.#.gate_proj.weight'")
        self.text = text
        self.stars = text.count("*")
        parts = []
        for ch in re.split(r"([*#])", text):
            parts.append({"*": r"([^.]+)", "#": r"(?P<index>0|[1-9][0-9]*)"}.get(ch, re.escape(ch)))
        self.regex = re.compile("".join(parts) + r"\Z")

    def match(self, name: str) -> tuple[tuple[str, ...], int | None] | None:
        """(the ``*`` parts, the ``#`` index or None), or None when ``name`` does not match."""
        m = self.regex.match(name)
        if m is None:
            return None
        groups = [g for i, g in enumerate(m.groups(), 1) if i != m.re.groupindex.get("index")]
        index = m.group("index") if "index" in m.re.groupindex else None
        return tuple(groups), (int(index) if index is not None else None)

    def fill(self, stars: Sequence[str], index: int | None = None) -> str:
        it = iter(stars)
        return "".join(next(it) if ch == "*" else str(index) if ch == "#" else ch
                       for ch in re.split(r"([*#])", self.text))


class _Rename:
    """One direction of a rename: a dict (names or ``*`` patterns), regex pairs, or a callable."""

    def __init__(self, spec: RenameSpec, where: str) -> None:
        self.where = where
        self.fn: Callable[[str], str] | None = None
        self.exact: dict[str, str] = {}
        self.patterns: list[tuple[_Pattern, _Pattern]] = []
        self.regexes: list[tuple[re.Pattern[str], str]] = []
        if spec is None:
            return
        if callable(spec):
            self.fn = spec
        elif isinstance(spec, Mapping):
            for a, b in spec.items():
                pa, pb = _Pattern(a, where=where), _Pattern(b, where=where)
                if pa.stars != pb.stars:
                    raise CheckpointError(f"key map {where}: {a!r} -> {b!r}: both sides need the same number of *, "
                                          f"found {pa.stars} and {pb.stars}; fix: write one * per varying name part")
                if pa.stars:
                    self.patterns.append((pa, pb))
                else:
                    self.exact[a] = b
        elif isinstance(spec, Sequence) and not isinstance(spec, str):
            for pair in spec:
                if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                    raise CheckpointError(f"key map {where}: expected (regex, replacement) pairs, found {pair!r}; fix: "
                                          "pass e.g. [(r'^model\\.', '')]")
                try:
                    self.regexes.append((re.compile(pair[0]), pair[1]))
                except re.error as e:
                    raise CheckpointError(f"key map {where}: bad regex {pair[0]!r} ({e}); fix: correct it") from None
        else:
            raise CheckpointError(f"key map {where}: expected a dict, a list of (regex, replacement) pairs or a "
                                  f"callable, found {type(spec).__name__}; fix: pass one of those")

    @property
    def identity(self) -> bool:
        return self.fn is None and not self.exact and not self.patterns and not self.regexes

    def __call__(self, name: str) -> str:
        if self.fn is not None:
            out = self.fn(name)
            if not isinstance(out, str):
                raise CheckpointError(f"key map {self.where}: the callable returned {out!r} for {name!r}, expected a "
                                      "str; fix: return the new name")
            return out
        if name in self.exact:
            return self.exact[name]
        for a, b in self.patterns:
            m = a.match(name)
            if m is not None:
                return b.fill(m[0])
        for regex, repl in self.regexes:
            name = regex.sub(repl, name)
        return name

    def inverse(self) -> _Rename | None:
        """The reverse direction for dict renames; None for regexes and callables (not invertible)."""
        if self.fn is not None or self.regexes:
            return None
        out = _Rename(None, self.where + " (inverted)")
        out.exact = {b: a for a, b in self.exact.items()}
        out.patterns = [(b, a) for a, b in self.patterns]
        return out


@dataclass
class Resolved:
    """A map applied to concrete names: per model tensor its links (model order), and what is left."""

    links: dict[str, list[Link]] = field(default_factory=dict)  # model name -> links
    shapes: dict[str, Shape] = field(default_factory=dict)  # model shapes (load) or HF shapes (save)
    unexpected: list[str] = field(default_factory=list)  # HF names no model tensor uses (load)
    missing: list[str] = field(default_factory=list)  # model names no HF tensor provides (load)
    problems: list[str] = field(default_factory=list)  # inconsistent shapes (fuse/stack/split)


class KeyMap:
    """How HF names become model names: ``rename`` plus structural ``transforms`` (see the module doc).

    ``rename`` maps HF names to model names: a dict (exact names or ``*`` patterns; inverted
    automatically for ``save_hf``), a list of ``(regex, replacement)`` pairs applied in order, or a
    callable. For the last two, ``save_hf`` needs ``rename_inverse`` (model name -> HF name). Renames
    apply to HF tensors that no transform uses; transforms name both sides in full.
    """

    def __init__(self, rename: RenameSpec = None, *, transforms: Sequence[Transform] = (),
                 rename_inverse: RenameSpec = None) -> None:
        self.rename = _Rename(rename, "rename")
        given = _Rename(rename_inverse, "rename_inverse") if rename_inverse is not None else None
        self.rename_inverse = given if given is not None else self.rename.inverse()
        self.transforms = list(transforms)
        for i, t in enumerate(self.transforms):
            if not isinstance(t, (Fuse, Split, Stack, Transpose)):
                raise CheckpointError(f"key map transforms[{i}]: expected Fuse, Split, Stack or Transpose, found "
                                      f"{t!r}; fix: build transforms with those classes")
            self._check(i, t)

    @classmethod
    def of(cls, spec: KeyMap | RenameSpec) -> KeyMap:
        """``spec`` as a KeyMap (a bare dict, pair list or callable is a rename)."""
        return spec if isinstance(spec, KeyMap) else cls(spec)

    def _check(self, i: int, t: Transform) -> None:
        where = f"transforms[{i}] {type(t).__name__}"
        if isinstance(t, (Fuse, Split)):
            many = t.hf if isinstance(t, Fuse) else t.model
            one = t.model if isinstance(t, Fuse) else t.hf
            if isinstance(many, str) or len(many) < 2:
                raise CheckpointError(f"key map {where}: expected a list of at least 2 names, found {many!r}; fix: "
                                      "list every part in order")
            stars = {_Pattern(n, where=where).stars for n in [one, *many]}
            if len(stars) != 1:
                raise CheckpointError(f"key map {where}: every name needs the same number of *, found {stars}")
            if isinstance(t, Fuse) and t.sizes is not None and len(t.sizes) != len(t.hf):
                raise CheckpointError(f"key map {where}: sizes {list(t.sizes)} has {len(t.sizes)} entries for "
                                      f"{len(t.hf)} HF tensors; fix: one size per HF tensor")
        else:
            a = _Pattern(t.model, where=where)
            b = _Pattern(t.hf, where=where, index=isinstance(t, Stack))
            if a.stars != b.stars:
                raise CheckpointError(f"key map {where}: {t.model!r} and {t.hf!r} need the same number of *")

    # ------------------------------------------------------------------------------------------------
    # Load direction: HF names and shapes + the model's shapes -> links per model tensor.

    def resolve_load(self, hf: Mapping[str, Shape], model: Mapping[str, Shape]) -> Resolved:
        """Links for every model tensor the HF tensors provide; missing/unexpected names; shape problems."""
        out = Resolved()
        used: set[str] = set()
        for i, t in enumerate(self.transforms):
            where = f"transforms[{i}] {type(t).__name__}"
            if isinstance(t, Fuse):
                self._load_fuse(t, where, hf, out, used)
            elif isinstance(t, Split):
                self._load_split(t, where, hf, model, out, used)
            elif isinstance(t, Stack):
                self._load_stack(t, where, hf, out, used)
            else:
                pm, ph = _Pattern(t.model, where=where), _Pattern(t.hf, where=where)
                for name in sorted(hf):
                    m = ph.match(name)
                    if m is None or name in used:
                        continue
                    used.add(name)
                    shape = hf[name]
                    if len(shape) != 2:
                        out.problems.append(f"{name}: {where} needs a 2-D tensor, found shape {list(shape)}")
                        continue
                    target = pm.fill(m[0])
                    out.shapes[target] = (shape[1], shape[0])
                    out.links[target] = [Link(target, full_box(out.shapes[target]), name, full_box(shape), TRANSPOSE)]
        for target in [t for t in out.links if t not in model]:  # a transform made a tensor the model lacks
            out.unexpected += [link.hf for link in out.links.pop(target)]
            del out.shapes[target]
        for name in hf:
            if name in used:
                continue
            target = self.rename(name)
            if target in out.links:
                out.problems.append(f"{name}: renamed to {target!r}, which another HF tensor already provides "
                                    f"({out.links[target][0].hf!r})")
                continue
            if target not in model:
                out.unexpected.append(name)
                continue
            shape = hf[name]
            out.shapes[target] = shape
            out.links[target] = [Link(target, full_box(shape), name, full_box(shape))]
        out.missing = sorted(set(model) - set(out.links))
        out.unexpected.sort()
        return out

    def _load_fuse(self, t: Fuse, where: str, hf: Mapping[str, Shape], out: Resolved, used: set[str]) -> None:
        pm, first = _Pattern(t.model, where=where), _Pattern(t.hf[0], where=where)
        sources = [_Pattern(s, where=where) for s in t.hf]
        for name in sorted(hf):
            m = first.match(name)
            if m is None or name in used:
                continue
            names = [p.fill(m[0]) for p in sources]
            absent = [n for n in names if n not in hf]
            target = pm.fill(m[0])
            if absent:
                out.problems.append(f"{target}: {where} needs HF tensors {names}; absent: {absent}")
                continue
            shapes = [hf[n] for n in names]
            problem = _cat_problem(shapes, t.dim)
            if problem is None and t.sizes is not None and [s[t.dim] for s in shapes] != list(t.sizes):
                problem = f"sizes along dim {t.dim} are {[s[t.dim] for s in shapes]}, the map declares {list(t.sizes)}"
            if problem:
                out.problems.append(f"{target}: {where} of {names}: {problem}")
                continue
            used.update(names)
            shape = list(shapes[0])
            shape[t.dim] = sum(s[t.dim] for s in shapes)
            out.shapes[target] = tuple(shape)
            out.links[target] = _cat_links(target, tuple(shape), names, shapes, t.dim, model_is_cat=True)

    def _load_split(self, t: Split, where: str, hf: Mapping[str, Shape], model: Mapping[str, Shape],
                    out: Resolved, used: set[str]) -> None:
        ph = _Pattern(t.hf, where=where)
        targets = [_Pattern(s, where=where) for s in t.model]
        for name in sorted(hf):
            m = ph.match(name)
            if m is None or name in used:
                continue
            names = [p.fill(m[0]) for p in targets]
            absent = [n for n in names if n not in model]
            if absent:
                out.problems.append(f"{name}: {where} into {names}: the model has no {absent}")
                continue
            shapes = [model[n] for n in names]
            problem = _cat_problem(shapes, t.dim)
            cat = list(shapes[0])
            if problem is None:
                cat[t.dim] = sum(s[t.dim] for s in shapes)
                if tuple(cat) != hf[name]:
                    problem = f"the model tensors concatenate to {cat}, the file has {list(hf[name])}"
            if problem:
                out.problems.append(f"{name}: {where} into {names}: {problem}")
                continue
            used.add(name)
            for link in _cat_links(name, tuple(cat), names, shapes, t.dim, model_is_cat=False):
                out.shapes[link.model] = link.model_box.sizes
                out.links[link.model] = [link]

    def _load_stack(self, t: Stack, where: str, hf: Mapping[str, Shape], out: Resolved, used: set[str]) -> None:
        pm, ph = _Pattern(t.model, where=where), _Pattern(t.hf, where=where, index=True)
        groups: dict[tuple[str, ...], dict[int, str]] = {}
        for name in sorted(hf):
            m = ph.match(name)
            if m is not None and name not in used:
                assert m[1] is not None  # the pattern has exactly one '#'
                groups.setdefault(m[0], {})[m[1]] = name
        for stars, members in groups.items():
            target = pm.fill(stars)
            count = len(members)
            if sorted(members) != list(range(count)):
                lacking = sorted(set(range(max(members) + 1)) - set(members))[:8]
                out.problems.append(f"{target}: {where} needs experts 0..{max(members)}; absent: "
                                    f"{[ph.fill(stars, e) for e in lacking]}")
                continue
            shapes = {hf[members[e]] for e in range(count)}
            if len(shapes) != 1:
                out.problems.append(f"{target}: {where}: the experts' shapes differ: {sorted(shapes)}")
                continue
            (one,) = shapes
            if not 0 <= t.dim <= len(one):
                out.problems.append(f"{target}: {where}: dim {t.dim} is out of range for {len(one)}-D experts")
                continue
            used.update(members.values())
            shape = (*one[:t.dim], count, *one[t.dim:])
            out.shapes[target] = shape
            links = []
            for e in range(count):
                offsets = [0] * len(shape)
                offsets[t.dim] = e
                sizes = list(shape)
                sizes[t.dim] = 1
                links.append(Link(target, Box(tuple(offsets), tuple(sizes)), members[e], full_box(one), STACK, t.dim))
            out.links[target] = links

    # ------------------------------------------------------------------------------------------------
    # Save direction: model names and shapes -> HF tensors, as links per model tensor.

    def resolve_save(self, model: Mapping[str, Shape]) -> Resolved:
        """Links for every model tensor; ``shapes`` holds the HF tensors' shapes. Raises on what cannot invert."""
        out = Resolved()
        for name in model:
            out.links[name] = []
        done: set[str] = set()
        for i, t in enumerate(self.transforms):
            where = f"transforms[{i}] {type(t).__name__}"
            if isinstance(t, Split):
                self._save_split(t, where, model, out, done)
                continue
            pm = _Pattern(t.model, where=where)
            for name in model:
                m = pm.match(name)
                if m is None or name in done:
                    continue
                done.add(name)
                shape = model[name]
                if isinstance(t, Fuse):
                    if t.sizes is None:
                        raise CheckpointError(f"save_hf: {name}: key map {where} has no sizes, so the fused tensor "
                                              "cannot be cut back into its HF tensors; fix: give Fuse(..., sizes=[...])"
                                              " (e.g. [q rows, k rows, v rows])")
                    names = [_Pattern(s, where=where).fill(m[0]) for s in t.hf]
                    if not 0 <= t.dim < len(shape) or sum(t.sizes) != shape[t.dim]:
                        raise CheckpointError(f"save_hf: {name} has shape {list(shape)}; key map {where} sizes "
                                              f"{list(t.sizes)} must add up to its dim {t.dim}; fix: correct sizes")
                    shapes = []
                    for s in t.sizes:
                        part = list(shape)
                        part[t.dim] = s
                        shapes.append(tuple(part))
                    out.links[name] = _cat_links(name, shape, names, shapes, t.dim, model_is_cat=True)
                elif isinstance(t, Stack):
                    if not 0 <= t.dim < len(shape):
                        raise CheckpointError(f"save_hf: {name} has shape {list(shape)}; key map {where} stacks "
                                              f"along dim {t.dim}; fix: correct dim")
                    ph = _Pattern(t.hf, where=where, index=True)
                    one = shape[:t.dim] + shape[t.dim + 1:]
                    links = []
                    for e in range(shape[t.dim]):
                        offsets, sizes = [0] * len(shape), list(shape)
                        offsets[t.dim], sizes[t.dim] = e, 1
                        links.append(Link(name, Box(tuple(offsets), tuple(sizes)), ph.fill(m[0], e), full_box(one),
                                          STACK, t.dim))
                    out.links[name] = links
                else:
                    if len(shape) != 2:
                        raise CheckpointError(f"save_hf: {name} has shape {list(shape)}; key map {where} needs 2-D")
                    target = _Pattern(t.hf, where=where).fill(m[0])
                    out.links[name] = [Link(name, full_box(shape), target, full_box(shape[::-1]), TRANSPOSE)]
        for name in model:
            if name in done:
                continue
            if self.rename_inverse is None:
                raise CheckpointError(f"save_hf: key map renames with regexes or a callable, which cannot be inverted "
                                      f"(model tensor {name!r}); fix: pass KeyMap(..., rename_inverse=...) mapping "
                                      "model names back to HF names, or a dict rename")
            target = self.rename_inverse(name)
            out.links[name] = [Link(name, full_box(model[name]), target, full_box(model[name]))]
        seen: dict[str, str] = {}
        for name, links in out.links.items():
            for link in links:
                out.shapes[link.hf] = _hf_shape(out.shapes.get(link.hf), link)
                if link.hf in seen and seen[link.hf] != name and not any(
                        isinstance(t, Split) for t in self.transforms):
                    raise CheckpointError(f"save_hf: model tensors {seen[link.hf]!r} and {name!r} both map to HF "
                                          f"tensor {link.hf!r}; fix: correct the key map")
                seen.setdefault(link.hf, name)
        return out

    def _save_split(self, t: Split, where: str, model: Mapping[str, Shape], out: Resolved, done: set[str]) -> None:
        first = _Pattern(t.model[0], where=where)
        for name in model:
            m = first.match(name)
            if m is None or name in done:
                continue
            names = [_Pattern(s, where=where).fill(m[0]) for s in t.model]
            absent = [n for n in names if n not in model]
            if absent:
                raise CheckpointError(f"save_hf: key map {where}: {name} has no partners {absent} in the model")
            shapes = [model[n] for n in names]
            problem = _cat_problem(shapes, t.dim)
            if problem:
                raise CheckpointError(f"save_hf: key map {where} of {names}: {problem}")
            cat = list(shapes[0])
            cat[t.dim] = sum(s[t.dim] for s in shapes)
            target = _Pattern(t.hf, where=where).fill(m[0])
            for link in _cat_links(target, tuple(cat), names, shapes, t.dim, model_is_cat=False):
                out.links[link.model] = [link]
                done.add(link.model)


def _hf_shape(known: Shape | None, link: Link) -> Shape:
    """The HF tensor's shape, grown to cover ``link.hf_box`` (links of one HF tensor tile it)."""
    ends = link.hf_box.ends
    if known is None:
        return ends
    return tuple(max(a, b) for a, b in zip(known, ends))


def _cat_problem(shapes: Sequence[Shape], dim: int) -> str | None:
    ranks = {len(s) for s in shapes}
    if len(ranks) != 1 or not 0 <= dim < len(shapes[0]):
        return f"shapes {[list(s) for s in shapes]} cannot be concatenated along dim {dim}"
    rest = {s[:dim] + s[dim + 1:] for s in shapes}
    if len(rest) != 1:
        return f"shapes {[list(s) for s in shapes]} differ outside dim {dim}"
    return None


def _cat_links(whole: str, shape: Shape, names: Sequence[str], shapes: Sequence[Shape], dim: int, *,
               model_is_cat: bool) -> list[Link]:
    """Links between tensor ``whole`` (of ``shape``) and its parts ``names`` concatenated along ``dim``.

    ``model_is_cat``: ``whole`` is the model tensor (Fuse), else the HF tensor (Split).
    """
    links, pos = [], 0
    for name, part in zip(names, shapes):
        offsets = [0] * len(shape)
        offsets[dim] = pos
        box = Box(tuple(offsets), tuple(part))
        if model_is_cat:
            links.append(Link(whole, box, name, full_box(part)))
        else:
            links.append(Link(name, full_box(part), whole, box))
        pos += part[dim]
    return links
