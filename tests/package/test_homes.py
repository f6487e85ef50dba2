"""Mechanisms called from their one home: collectives from comm/ (and two stated exceptions), stream ordering
from comm/streams.py.

design/overview.md states both rules. Every call is read from the source (``ast``), so a call added in
the wrong room fails here, naming the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "fully_shard"

# torch.distributed's collectives and point-to-point calls
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "barrier", "monitored_barrier", "all_to_all",
    "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv",
}
# design/overview.md: the runtime's collectives live in comm/; the checkpoint package (its control plane with its
# own gloo group and deadlines; save_hf's point-to-point assembly of whole tensors) and the tools' measurements
# call torch.distributed themselves, and so does the weight sync's wire (point-to-point to receivers, bounded waits)
COLLECTIVE_HOMES = ("comm/", "checkpoint/control.py", "checkpoint/hf_save.py", "tools/timing.py",
                    "tools/tune/worker.py", "weights/wire.py")
# design/streams.md: the core orders streams only through CommContext's verbs
STREAM_CALLS = {"wait_stream", "record_event", "wait_event", "stream", "current_stream", "on", "synchronize"}


def _dist_names(tree: ast.Module) -> set[str]:
    """The names ``torch.distributed`` is bound to in a module (``import torch.distributed as dist``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
    return names


def _calls(path: Path) -> list[tuple[int, str, str]]:
    """(line, the called object's source, the attribute called) of every ``x.attr(...)`` in ``path``."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            out.append((node.lineno, ast.unparse(node.func.value), node.func.attr))
    return out


def _collective_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    dist = _dist_names(tree) | {"torch.distributed"}
    return [f"{path.relative_to(ROOT)}:{line} {obj}.{attr}" for line, obj, attr in _calls(path)
            if obj in dist and attr in COLLECTIVES]


def _stream_calls(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} {obj}.{attr}" for line, obj, attr in _calls(path)
            if attr in STREAM_CALLS]


def test_collectives_are_called_from_comm_and_the_stated_exceptions() -> None:
    stray = [call for path in sorted(ROOT.rglob("*.py"))
             if not str(path.relative_to(ROOT)).startswith(COLLECTIVE_HOMES) for call in _collective_calls(path)]
    assert not stray, "torch.distributed collectives called outside comm/ (design/overview.md):\n" + "\n".join(stray)


def test_the_core_orders_streams_only_through_comm_context_verbs() -> None:
    """No file of core/ calls ``wait_stream``, ``record_event``, ``wait_event`` or enters a stream context:
    the whole protocol of an all-gather and of a reduce is ``CommContext``'s (comm/streams.py)."""
    stray = [call for path in sorted((ROOT / "core").rglob("*.py")) for call in _stream_calls(path)]
    assert not stray, "stream ordering outside comm/streams.py (design/streams.md):\n" + "\n".join(stray)


def test_the_scans_see_what_they_look_for() -> None:
    """Both scans find real calls: the collectives in comm/, the stream protocol in comm/streams.py."""
    assert any(".all_reduce" in c for c in _collective_calls(ROOT / "comm" / "collectives.py"))
    found = {c.rsplit(".", 1)[1] for c in _stream_calls(ROOT / "comm" / "streams.py")}
    assert {"wait_stream", "record_event", "wait_event", "stream"} <= found, found


def _test_module_imports(path: Path) -> list[str]:
    """``from tests.x.test_y import ...`` / ``from tests.x import test_y`` / ``import tests.x.test_y``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests":
            parts = node.module.split(".") + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            parts = [p for a in node.names if a.name.split(".")[0] == "tests" for p in a.name.split(".")]
        else:
            continue
        if any(p.startswith("test_") for p in parts):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_benchmarks_take_shared_models_from_one_place_not_from_test_modules() -> None:
    """A benchmark or by-hand check that needs the tests' models imports their shared module
    (tests/parallel/moe_common.py, moe_parity.py, tp_common.py, the harness), never a test file."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    stray = [imp for path in sorted(bench.glob("*.py")) for imp in _test_module_imports(path)]
    assert not stray, "benchmarks import from test modules:\n" + "\n".join(stray)
    probe = Path(__file__).resolve().parent / "test_homes.py"
    assert _test_module_imports(probe) == [], "this file imports no test module"
    assert _test_module_imports.__doc__ and "tests.x import test_y" in _test_module_imports.__doc__
