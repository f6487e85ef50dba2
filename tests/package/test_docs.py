"""What the documents name exists: every repository path, every ``module.name`` and ``Class.attr`` of the
package, every design document, and every module in design/overview.md's map (and the map names them all).

The documents are design/*.md, docs/*.md, README.md and benchmarks/README.md. A path is a token that
starts with a top-level directory of the repository (``fully_shard/``, ``tests/``, ``benchmarks/``,
``examples/``, ``design/``, ``docs/``) or with a subpackage of ``fully_shard`` (``core/group.py``);
``core/grad_mode.no_grad`` names a module and one of its top-level names. torch's own paths
(``torch/distributed/...``, ``nn/modules/...``) do not start so and are not read.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "fully_shard"
TOP = ("fully_shard", "tests", "benchmarks", "examples", "design", "docs")
SUBPACKAGES = tuple(sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
# names the documents use for a variable, not for the module of that name: an nn.Module, a DeviceMesh,
# a custom collective, the fully_shard function (``fully_shard.state``)
VARIABLES = {"module", "mesh", "comm", "fully_shard"}
# file names that are not ours: a user's training script in a launch command
# not this repository's: train.py, and torch's own FSDP1 test files (test/distributed/fsdp/, not in its wheel)
# that tests/manual/torch_fsdp1_suite.py runs
NOT_OURS = {"train.py", "test_fsdp_core.py", "test_fsdp_traversal.py", "test_fsdp_clip_grad_norm.py",
            "test_fsdp_grad_acc.py", "test_fsdp_state_dict.py"}

PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w.-]*/)+[\w.-]*)")
BARE_FILE = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:py|md))\b")
TICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\(.*\))?$")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")  # a Markdown link or image: [text](target), relative


def documents() -> list[Path]:
    docs = sorted((REPO / "design").glob("*.md")) + sorted((REPO / "docs").glob("*.md"))
    return docs + [REPO / "README.md", REPO / "benchmarks" / "README.md"]


def _lines(doc: Path) -> Iterator[tuple[str, str]]:
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        yield f"{doc.relative_to(REPO)}:{number}", line


def _repository_path(token: str) -> Path | None:
    """The file or directory ``token`` names in the repository, or None where it names none of ours."""
    first = token.split("/", 1)[0]
    if first in TOP:
        return REPO / token
    if first in SUBPACKAGES:
        return PACKAGE / token
    return None


class _Names:
    """Top-level names per module stem and attributes per class, read from the package's source (``ast``)."""

    def __init__(self) -> None:
        self.modules: dict[str, set[str]] = defaultdict(set)  # module stem -> top-level names (+ its classes')
        self.classes: dict[str, set[str]] = defaultdict(set)  # class -> names defined on it or on self
        self.bases: dict[str, set[str]] = defaultdict(set)
        self.by_file: dict[Path, set[str]] = {}
        aliases: dict[str, str] = {}  # an entry point that is another module (compat.py: interop/patch.py)
        for path in PACKAGE.rglob("*.py"):
            tree = ast.parse(path.read_text())
            top = _top_level(tree)
            stem = path.parent.name if path.name == "__init__.py" else path.stem
            self.by_file[path] = top
            self.modules[stem] |= top
            if (alias := _module_alias(tree)) is not None:
                aliases[stem] = alias
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    attrs = _class_names(node)
                    self.classes[node.name] |= attrs
                    self.modules[stem] |= attrs  # ``snapshot.check``: a method of the module's object
                    self.bases[node.name] |= {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
        for stem, target in aliases.items():
            self.modules[stem] |= self.modules[target]

    def on_class(self, cls: str, attr: str) -> bool:
        seen, todo = set(), [cls]
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            if attr in self.classes.get(c, ()):
                return True
            todo += self.bases.get(c, ())
        return False


def _top_level(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _module_alias(tree: ast.Module) -> str | None:
    """The module a module makes itself (``sys.modules[__name__] = patch``): ``patch``, else None."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
                and ast.unparse(node.targets[0]) == "sys.modules[__name__]"):
            return node.value.id
    return None


def _class_names(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(sub.name)
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
            names.add(sub.attr)
        elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
            names.add(sub.target.id)
        elif isinstance(sub, ast.Assign):
            names |= {t.id for t in sub.targets if isinstance(t, ast.Name)}
    return names


def _missing_paths(where: str, line: str, names: _Names) -> Iterator[str]:
    for match in PATH.finditer(line):
        token = match.group(1).rstrip(".")
        target = _repository_path(token)
        if target is None or target.exists():
            continue
        # ``core/grad_mode.no_grad``: a module and one of its names
        module, _, name = token.rpartition(".")
        source = _repository_path(module + ".py") if module else None
        if source is not None and source.exists() and name in names.by_file.get(source, ()):
            continue
        if source is not None and source.exists():
            yield f"{where}: {token} ({module}.py has no top-level {name!r})"
        else:
            yield f"{where}: {token}"


def _missing_files(where: str, line: str, files: set[str]) -> Iterator[str]:
    for match in BARE_FILE.finditer(line):
        name = match.group(1)
        if name not in files and name not in NOT_OURS and not _torch_file(name):
            yield f"{where}: {name}"


def _torch_file(name: str) -> bool:
    """torch's own files, named in design/compat.md (``stage.py``, ``schedules.py``)."""
    import torch

    return name.endswith(".py") and any(Path(torch.__file__).parent.rglob(name))


def _missing_attributes(where: str, line: str, names: _Names) -> Iterator[str]:
    for match in TICKED.finditer(line):
        dotted = DOTTED.match(match.group(1).strip())
        if dotted is None:
            continue
        owner, attr = dotted.groups()
        if owner in names.classes:
            if not names.on_class(owner, attr):
                yield f"{where}: `{owner}.{attr}` ({owner} has no {attr!r})"
        elif (owner in names.modules and owner not in VARIABLES and attr not in ("py", "md")
              and attr not in names.modules[owner]):
            yield f"{where}: `{owner}.{attr}` (no module {owner}.py defines {attr!r})"


def test_every_path_the_documents_name_exists() -> None:
    names = _Names()
    missing = [m for doc in documents() for where, line in _lines(doc) for m in _missing_paths(where, line, names)]
    assert not missing, "paths named in the documents that do not exist:\n" + "\n".join(missing)


def test_every_file_name_the_documents_name_exists() -> None:
    """Bare names (``data-path.md``, ``gather_plan.py``): a file of the repository (or torch's own)."""
    files = {p.name for p in REPO.rglob("*") if not {".git", ".venv"} & set(p.parts)}
    missing = [m for doc in documents() for where, line in _lines(doc) for m in _missing_files(where, line, files)]
    assert not missing, "file names in the documents that name no file:\n" + "\n".join(missing)


def _broken_links(doc: Path) -> Iterator[str]:
    """Markdown links (``[docs/ft.md](docs/ft.md)``, ``![..](../benchmarks/results/tune.png)``) that resolve
    to nothing, relative to the document's folder (as a renderer reads them); web addresses are not read."""
    for where, line in _lines(doc):
        for match in LINK.finditer(line):
            target = match.group(1)
            if "://" not in target and not target.startswith("mailto:") and not (doc.parent / target).exists():
                yield f"{where}: ({target})"


def test_every_link_in_the_documents_resolves() -> None:
    """README.md's feature table and the guides in docs/ link one hop to each other: every link lands."""
    broken = [m for doc in documents() for m in _broken_links(doc)]
    assert not broken, "links in the documents that resolve to nothing:\n" + "\n".join(broken)


def test_every_module_and_class_attribute_the_documents_name_exists() -> None:
    """``ReduceQueue.budgeted``, ``collectives.all_gather``: the class (or a base) or module defines it."""
    names = _Names()
    missing = [m for doc in documents() for where, line in _lines(doc)
               for m in _missing_attributes(where, line, names)]
    assert not missing, "names in the documents the package does not define:\n" + "\n".join(missing)


def _overview_map() -> dict[str, tuple[set[str], set[str]]]:
    """design/overview.md's tree of ``fully_shard/``: subpackage -> (the entries that start a line under it,
    every file or folder name its lines mention: ``format.py ... validate.py strict JSON``)."""
    text = (REPO / "design" / "overview.md").read_text()
    block = text.split("```\nfully_shard/\n", 1)[1].split("```", 1)[0]
    tree: dict[str, tuple[set[str], set[str]]] = {}
    package = ""
    for line in block.splitlines():
        head = re.match(r"^  ([a-z_]+)/", line)
        if head:
            package = head.group(1)
            tree[package] = (set(), set())
            continue
        if not package:
            continue
        entries, mentioned = tree[package]
        entry = re.match(r"^    ([\w./]+(?: [\w./]+)*)", line)
        if entry:
            entries |= set(re.findall(r"\w+(?:\.py|/)", entry.group(1)))
        mentioned |= set(re.findall(r"\w+(?:\.py|/)", line))
    return tree


def test_overview_map_names_every_module_where_it_is() -> None:
    """Each subpackage's modules (and sub-folders) in design/overview.md's map, under their folder.

    A subpackage listed without entries (``tools/``) is told in a sentence; its files are not listed.
    """
    tree = _overview_map()
    assert set(tree) == set(SUBPACKAGES), f"the map's folders {sorted(tree)} != the package's {SUBPACKAGES}"
    wrong = []
    for package, (entries, mentioned) in tree.items():
        if not entries:
            continue
        here = {p.name for p in (PACKAGE / package).glob("*.py") if p.name != "__init__.py"}
        here |= {p.name + "/" for p in (PACKAGE / package).iterdir() if (p / "__init__.py").exists()}
        wrong += [f"{package}/{e}: named in the map, not in the package" for e in sorted(entries - here)]
        wrong += [f"{package}/{e}: in the package, not in the map" for e in sorted(here - mentioned)]
    assert not wrong, "design/overview.md's map (fully_shard/ tree):\n" + "\n".join(wrong)


def test_the_scans_see_what_they_look_for() -> None:
    """The scans find the names they check: a path, a module's name, a class attribute, a map entry."""
    names = _Names()
    line = "`ReduceQueue.nope` and `collectives.nope`, core/nope.py, core/grad_mode.nope, core/group.py, nope.md"
    found = list(_missing_paths("x", line, names)) + list(_missing_attributes("x", line, names))
    found += list(_missing_files("x", line, {"group.py"}))
    assert found == ["x: core/nope.py", "x: core/grad_mode.nope (core/grad_mode.py has no top-level 'nope')",
                     "x: `ReduceQueue.nope` (ReduceQueue has no 'nope')",
                     "x: `collectives.nope` (no module collectives.py defines 'nope')", "x: nope.md"], found
    assert "group.py" in _overview_map()["core"][0]
    readme = REPO / "README.md"
    assert list(_broken_links(readme)) == [], "README.md's links"
    assert any(LINK.search(line) for _, line in _lines(readme)), "the link scan finds README.md's links"
    assert LINK.findall("see [x](docs/nope.md#a) and ![p](../r.png)") == ["docs/nope.md", "../r.png"]
