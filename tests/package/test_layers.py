"""The package's layers: imports point down only, no module import cycles, and ``import fully_shard`` stays light.

design/overview.md draws the layers. Every ``import`` of the package is read from the source (module
level, inside functions and under ``TYPE_CHECKING`` alike), so a cycle hidden behind a type-only import
counts too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "fully_shard"

# package -> layer; a module may import from its own package or a lower layer
LAYERS = {"parallel": 0, "comm": 1, "core": 2, "optim": 3, "checkpoint": 4, "ft": 4, "wrap": 5, "weights": 5,
          "interop": 6, "tools": 6, "": 7}
# "": fully_shard/__init__.py and the entry points beside it (compat.py, tune.py)
# wrap/ sits above checkpoint/ and optim/: FSDP1's FullyShardedDataParallel (wrap/fsdp1/) gives its state dicts
# and clip_grad_norm_ through them; interop/patch.py above wrap/ rebinds torch's FSDP1 class to it. weights/ reads
# the units (core/) and names through checkpoint/'s key maps.


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports (``from .x import y`` resolved; ``y`` when it is a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("fully_shard"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                          or (ROOT.parent / sub.replace(".", "/")).is_dir() else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fully_shard")}
    found.discard(name)
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 2 and (ROOT / f"{parts[1]}.py").exists():
        return ""  # a top-level entry point
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}


def test_imports_point_down_the_layers() -> None:
    graph = _graph()
    upward = []
    for module, targets in graph.items():
        for target in targets:
            if _package(target) == _package(module):
                continue
            if LAYERS[_package(target)] >= LAYERS[_package(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(sorted(upward))


def test_no_import_cycles_between_modules() -> None:
    full = _graph()  # (parsed once: the comprehension below asked for it per import)
    graph = {m: {t for t in ts if t in full} for m, ts in full.items()}
    inits = {m for m in graph if (ROOT.parent / m.replace(".", "/")).is_dir()}  # packages re-export: skip
    graph = {m: ts - inits for m, ts in graph.items() if m not in inits}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_layer_check_sees_a_violation() -> None:
    """The checks above read real imports: an upward and a cyclic import are found."""
    assert "fully_shard.core.registry" in _imports(ROOT / "optim" / "__init__.py")
    assert "fully_shard.comm.collectives" in _imports(ROOT / "core" / "gather_plan.py")
    assert LAYERS[_package("fully_shard.optim.step")] > LAYERS[_package("fully_shard.core.api")]


def test_import_fully_shard_loads_no_tools() -> None:
    code = ("import sys, fully_shard; print(sorted(m for m in sys.modules if m.startswith(("
            "'fully_shard.tools', 'fully_shard.checkpoint', 'fully_shard.wrap', 'fully_shard.ft', "
            "'fully_shard.weights', 'torchft', 'safetensors', 'xxhash'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    # the lazy names load; fully_shard.ft itself never imports torchft (the manager is passed in)
    code = ("import sys, fully_shard; from fully_shard import checkpoint, profile, auto_wrap, ft\n"
            "from fully_shard.ft import fault_tolerant, StepSampler\n"
            "print(checkpoint.__name__, ft.__name__, sorted(m for m in sys.modules if m.split('.')[0] == 'torchft'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "fully_shard.checkpoint fully_shard.ft []", out.stdout
    code = ("import fully_shard; from fully_shard import weights, iter_full; "
            "print(weights.__name__, iter_full is weights.iter_full)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "fully_shard.weights True", out.stdout


def test_import_survives_moved_private_torch_names() -> None:
    """The private torch names imported at module level are guarded (design/private-torch.md): if torch
    moves one, ``import fully_shard`` still works and only the feature that needs it says so."""
    code = ("import torch.optim.optimizer as o, torch.distributed.tensor.placement_types as pt\n"
            "del o._device_dtype_check_for_fused, pt._StridedShard\n"
            "import fully_shard, fully_shard.parallel.spmd as spmd, fully_shard.optim.step as step\n"
            "print(spmd._StridedShard, step._device_dtype_check_for_fused)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "None None", out.stdout
