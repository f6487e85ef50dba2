"""The GPU check, one command: ``python benchmarks/gpu_check.py`` on the GPU machine (one GPU, no torchrun).

The checks are a test suite in tests/gpu/ (runner.py runs its parts: memory, csan, delay, step, host;
tests/gpu/test_gpu_check.py runs them under pytest); this script runs them all and writes
``benchmarks/results/gpu_check.txt`` and ``.json``, exiting non-zero with ``CHECK FAILED: ...`` when a check
fails. ``--cpu-dry-run`` runs the same code on CPU with tiny models; ``--help`` lists the options.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gpu.runner import main

if __name__ == "__main__":
    sys.exit(main())
