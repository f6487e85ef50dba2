"""Run torch's own FSDP1 tests against torch's FSDP1 and against ours (``patch_torch(fsdp1=True)``).

Manual, CPU/gloo. torch's tests are not shipped with torch: copy the files of torch's
``test/distributed/fsdp/`` you want into a folder (not into this repository) and point ``--tests`` at
it. torch's testing helpers (``torch.testing._internal.common_fsdp`` ...) come from the installed torch;
they need ``expecttest``: install it outside the venv and pass that folder with ``--pythonpath``::

    pip install --target /tmp/fsuite_deps expecttest
    python tests/manual/torch_fsdp1_suite.py --tests /tmp/torch_fsdp_tests \\
        --pythonpath /tmp/fsuite_deps --unskip [--real-groups] [--files test_wrap.py ...]

Each file runs twice under pytest, in a fresh process each time: once as is (torch's FSDP1) and once
with a preamble that calls ``fully_shard.compat.patch_torch(fsdp1=True)`` before anything of torch's
testing code is imported (so ``common_fsdp``'s and the test module's ``FSDP`` are ours; the preamble is
imported first by the test module itself, so the spawned ranks patch too). Both sides run the same
rewritten copy of the file; every rewrite is printed:

- device: ``"cuda"`` -> ``"cpu"``, ``.cuda()`` -> ``.cpu()``, ``torch.cuda.set_device(..)`` dropped,
  ``torch.cuda.current_device()`` / ``torch.device(self.rank)`` -> cpu, DDP ``device_ids=[self.rank]`` ->
  None, ``backend="nccl"`` -> ``"gloo"`` (tests that hard-code CUDA only as a device string run on CPU);
- torch side only, on a machine with no accelerator: ``FullyShardedDataParallel(device_id=None)`` becomes
  ``device_id=cpu`` (torch's FSDP1 otherwise refuses: "FSDP needs a non-CPU accelerator device");
- names torch renamed since the stored copy (``CUDAInitMode`` -> ``DEVICEInitMode``,
  ``cuda_init_mode`` -> ``device_init_mode``, ``_maybe_cuda``, ``_FSDPPolicy``, ``_shard_utils.
  _gather_state_dict``) are aliased;
- ``--unskip``: ``skip_if_lt_x_gpu`` runs the test, one-line ``unittest.skipIf(...torch.cuda...)``
  decorators are dropped, and ``FSDPTest`` / ``FSDPTestContinuous`` spawn 2 gloo ranks on CPU (torch's
  harness otherwise skips every multi-rank test without 2 accelerators);
- ``--real-groups``: ``DummyProcessGroup(rank=0, size=1)`` (an object with only ``rank()`` /
  ``size()``) becomes a real 1-rank gloo group; other sizes stay dummies.

Prints per file: tests, passed/failed/skipped for torch and for ours, and the tests that fail only with
ours, each with its error's last line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PREAMBLE = r'''
"""Written by tests/manual/torch_fsdp1_suite.py: imported first by the rewritten torch test file."""
import functools
import inspect
import os
import sys
import textwrap
import types

if os.environ.get("FSUITE_SIDE") == "ours":
    from fully_shard import compat

    compat.patch_torch(fsdp1=True)

import torch
import torch.distributed as dist
import torch.distributed.fsdp.wrap as _wrap
import torch.testing._internal.common_distributed as _cd
import torch.testing._internal.common_fsdp as _cf

# names torch renamed since older copies of its tests
if not hasattr(_cf, "CUDAInitMode"):
    _cf.CUDAInitMode = types.SimpleNamespace(
        CUDA_BEFORE=_cf.DEVICEInitMode.DEVICE_BEFORE,
        CUDA_AFTER=_cf.DEVICEInitMode.DEVICE_AFTER,
        CUDA_NEVER=_cf.DEVICEInitMode.DEVICE_NEVER,
    )
if not hasattr(_cf, "_maybe_cuda"):
    _cf._maybe_cuda = lambda model, move: _cf._move_to_device(model, move)
if not hasattr(_wrap, "_FSDPPolicy") and hasattr(_wrap, "_Policy"):
    _wrap._FSDPPolicy = _wrap._Policy
import torch.distributed._state_dict_utils as _sdu  # noqa: E402
import torch.distributed.fsdp._shard_utils as _shard_utils  # noqa: E402

if not hasattr(_shard_utils, "_gather_state_dict"):
    _shard_utils._gather_state_dict = _sdu._gather_state_dict
if not hasattr(_shard_utils, "_all_gather_sharded_tensor"):
    def _all_gather_sharded_tensor(*args, **kwargs):
        raise NotImplementedError("torch_fsdp1_suite: _all_gather_sharded_tensor is gone from torch")

    _shard_utils._all_gather_sharded_tensor = _all_gather_sharded_tensor

# torch's FSDP1 on a machine with no accelerator needs device_id=cpu (else "FSDP needs a non-CPU
# accelerator device"): its tests pass a CUDA device or none, so the torch side defaults it to cpu
if os.environ.get("FSUITE_SIDE") == "torch" and torch.accelerator.device_count() == 0:
    from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP

    _torch_init = _TorchFSDP.__init__

    @functools.wraps(_torch_init)
    def _cpu_init(self, module, *args, **kwargs):
        if len(args) < 9 and kwargs.get("device_id") is None:
            kwargs["device_id"] = torch.device("cpu")
        _torch_init(self, module, *args, **kwargs)

    _TorchFSDP.__init__ = _cpu_init


def _rewrite_classmethod(cls, name, old, new):
    fn = inspect.getattr_static(cls, name).__func__
    src = textwrap.dedent(inspect.getsource(fn))
    if old not in src:
        raise RuntimeError(f"torch_fsdp1_suite: {cls.__name__}.{name} no longer contains {old!r}")
    # exec'd code has no __class__ cell: spell out zero-argument super()
    module = sys.modules[fn.__module__]
    setattr(module, f"_fsuite_{cls.__name__}", cls)
    src = src.replace(old, new).replace("super()", f"super(_fsuite_{cls.__name__}, cls)")
    ns = {}
    exec(compile(src, inspect.getsourcefile(fn), "exec"), vars(module), ns)
    setattr(cls, name, ns[name])


if os.environ.get("FSUITE_UNSKIP") == "1":
    _cd.skip_if_lt_x_gpu = lambda x, **kwargs: (lambda f: f)
    _cf.skip_if_lt_x_gpu = _cd.skip_if_lt_x_gpu
    if torch.accelerator.device_count() < 2:
        _cf.DEVICE_COUNT = 2
        _cf.FSDPTestContinuous.world_size = 2
        _count = "if torch.accelerator.device_count() < "
        _rewrite_classmethod(_cf.FSDPTest, "_run", _count + "self.world_size:", "if False:")
        _rewrite_classmethod(_cf.FSDPTestContinuous, "_init_pg", _count + "world_size:", "if False:")

if os.environ.get("FSUITE_REAL_GROUPS") == "1":
    _Dummy = _cf.DummyProcessGroup

    def _real_or_dummy(rank, size):
        if size != 1:
            return _Dummy(rank, size)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        if dist.get_world_size() != 1:
            return _Dummy(rank, size)
        return dist.distributed_c10d._get_default_group()

    _cf.DummyProcessGroup = _real_or_dummy
'''

# (name, pattern, replacement, only with --unskip)
REWRITES: list[tuple[str, str, str, bool]] = [
    ("device: torch.cuda.set_device(..) dropped", r"torch\.cuda\.set_device\([^()]*\)", "None", False),
    ("device: torch.device(\"cuda\", torch.cuda.current_device()) -> cpu",
     r"torch\.device\([\"']cuda[\"'],\s*torch\.cuda\.current_device\(\)\)", 'torch.device("cpu")', False),
    ("device: torch.cuda.current_device() -> cpu", r"torch\.cuda\.current_device\(\)", 'torch.device("cpu")', False),
    ("device: torch.device(self.rank) -> cpu", r"torch\.device\(self\.rank\)", 'torch.device("cpu")', False),
    ("device: DDP device_ids=[self.rank] -> None", r"device_ids=\[self\.rank\]", "device_ids=None", False),
    ("device: .cuda() -> .cpu()", r"\.cuda\(\)", ".cpu()", False),
    ("device: \"cuda\" -> \"cpu\"", r"([\"'])cuda\1", r"\1cpu\1", False),
    ("device: backend nccl -> gloo", r"([\"'])nccl\1", r"\1gloo\1", False),
    ("name: cuda_init_mode -> device_init_mode", r"\bcuda_init_mode\b", "device_init_mode", False),
    ("unskip: one-line @unittest.skipIf(..torch.cuda..) dropped",
     r"(?m)^[ \t]*@(?:unittest\.)?skipIf\([^\n]*torch\.cuda[^\n]*\)[ \t]*\n", "", True),
]


@dataclass
class Outcome:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    # skipped by torch's FSDPTestContinuous harness because an earlier test of the class failed
    poisoned: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def total(self) -> int:
        return len(self.passed) + len(self.failed) + len(self.skipped)


def rewrite(src: str, unskip: bool) -> tuple[str, list[str]]:
    done = []
    for name, pattern, repl, needs_unskip in REWRITES:
        if needs_unskip and not unskip:
            continue
        src, n = re.subn(pattern, repl, src)
        if n:
            done.append(f"{name} (x{n})")
    lines = src.splitlines(keepends=True)
    # the preamble goes before the first import (after a leading comment/docstring/__future__ block)
    at = next(i for i, line in enumerate(lines) if re.match(r"(import |from (?!__future__))", line))
    lines.insert(at, "import _fsuite_preamble  # noqa: F401  (torch_fsdp1_suite)\n")
    return "".join(lines), done


_ERR_LINE = re.compile(r"^\s*(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Failure|Exit)\b.*)$")


def last_error_line(text: str) -> str:
    found = [m.group(1).strip() for line in text.splitlines() if (m := _ERR_LINE.match(line))]
    if found:
        return found[-1][:300]
    rest = [line.strip() for line in text.splitlines() if line.strip()]
    return rest[-1][:300] if rest else "(no message)"


def parse_junit(path: Path) -> Outcome:
    out = Outcome()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            out.failed[name] = last_error_line((failure.get("message") or "") + "\n" + (failure.text or ""))
        elif (skipped := case.find("skipped")) is not None:
            out.skipped.append(name)
            if "Previous test failed" in (skipped.get("message") or "") + (skipped.text or ""):
                out.poisoned.append(name)
        else:
            out.passed.append(name)
    return out


def run_side(test_file: Path, side: str, args: argparse.Namespace, workdir: Path) -> Outcome:
    """One pytest run of the file; then each test that torch's FSDPTestContinuous harness skipped because
    an earlier test of its class failed runs again alone (so one failure does not hide the rest)."""
    outcome = run_pytest(test_file, side, args, workdir, None, "")
    for name in list(outcome.poisoned):
        cls, test = name.split(".", 1)
        alone = run_pytest(test_file, side, args, workdir, f"{test_file.name}::{cls}::{test}", f".{test}")
        outcome.skipped.remove(name)
        outcome.poisoned.remove(name)
        outcome.passed += alone.passed
        outcome.failed.update(alone.failed)
        outcome.skipped += alone.skipped
        if not alone.total:
            outcome.failed[name] = f"rerun alone gave no result: {alone.note}"
    return outcome


def run_pytest(test_file: Path, side: str, args: argparse.Namespace, workdir: Path, node: str | None,
               suffix: str) -> Outcome:
    xml = workdir / f"{test_file.stem}.{side}{suffix}.xml"
    env = dict(os.environ)
    env["FSUITE_SIDE"] = side
    env["FSUITE_UNSKIP"] = "1" if args.unskip else "0"
    env["FSUITE_REAL_GROUPS"] = "1" if args.real_groups else "0"
    paths = [str(workdir), str(REPO)] + [p for p in (args.pythonpath or [])] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    cmd = [sys.executable, "-m", "pytest", node or str(test_file), "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           f"--junitxml={xml}", f"--timeout={args.test_timeout}", "--rootdir", str(workdir)]
    if args.k and node is None:
        cmd += ["-k", args.k]
    log = workdir / f"{test_file.stem}.{side}{suffix}.log"
    try:
        with log.open("w") as fh:
            subprocess.run(cmd, cwd=workdir, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=args.file_timeout,
                           check=False)
    except subprocess.TimeoutExpired:
        outcome = parse_junit(xml) if xml.exists() else Outcome()
        outcome.note = f"file run timed out after {args.file_timeout}s (log {log})"
        return outcome
    if not xml.exists():
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        return Outcome(note=f"no result (collection failed?): {' '.join(tail)} (log {log})")
    return parse_junit(xml)


def fmt(o: Outcome) -> str:
    poisoned = f" ({len(o.poisoned)} after a failure)" if o.poisoned else ""
    return f"{len(o.passed)}/{len(o.failed)}/{len(o.skipped)}{poisoned}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", type=Path, required=True, help="folder with torch's test_*.py files")
    ap.add_argument("--files", nargs="*", help="only these file names (default: every test_*.py there)")
    ap.add_argument("--pythonpath", action="append", help="extra import folder (expecttest ...)")
    ap.add_argument("--unskip", action="store_true", help="run tests torch skips for lack of GPUs on 2 gloo ranks")
    ap.add_argument("--real-groups", action="store_true", help="DummyProcessGroup(size=1) -> a real 1-rank gloo group")
    ap.add_argument("--sides", nargs="+", default=["torch", "ours"], choices=["torch", "ours"])
    ap.add_argument("-k", help="pytest -k expression")
    ap.add_argument("--test-timeout", type=int, default=300, help="seconds per test")
    ap.add_argument("--file-timeout", type=int, default=3600, help="seconds per file and side")
    ap.add_argument("--workdir", type=Path, help="where the rewritten copies, logs and junit files go")
    args = ap.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fsuite_"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "_fsuite_preamble.py").write_text(PREAMBLE)
    files = [args.tests / f for f in args.files] if args.files else sorted(args.tests.glob("test_*.py"))
    print(f"workdir {workdir}; flags: unskip={args.unskip} real_groups={args.real_groups}", flush=True)
    rows = []
    for src in files:
        text, done = rewrite(src.read_text(), args.unskip)
        copy = workdir / src.name
        copy.write_text(text)
        print(f"\n== {src.name}: rewrites applied to both sides: {'; '.join(done) or 'none'}", flush=True)
        res = {side: run_side(copy, side, args, workdir) for side in args.sides}
        for side, o in res.items():
            print(f"  {side}: {o.total} tests, passed/failed/skipped {fmt(o)} {o.note}", flush=True)
        if "torch" in res and "ours" in res:
            only = {n: m for n, m in res["ours"].failed.items() if n not in res["torch"].failed}
            fixed = [n for n in res["torch"].failed if n in res["ours"].passed]
            for n, m in sorted(only.items()):
                print(f"    ours-only failure: {n}: {m}", flush=True)
            for n in sorted(fixed):
                print(f"    torch-only failure: {n}: {res['torch'].failed[n]}", flush=True)
        rows.append((src.name, res))
    print("\n| file | tests | " + " | ".join(f"{s} p/f/s" for s in args.sides) + " | ours-only failures |")
    print("|---|---|" + "---|" * len(args.sides) + "---|")
    for name, res in rows:
        tests = max(o.total for o in res.values())
        only = len([n for n in res["ours"].failed if n not in res["torch"].failed]) if len(res) == 2 else "-"
        print(f"| {name} | {tests} | " + " | ".join(fmt(res[s]) for s in args.sides) + f" | {only} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
