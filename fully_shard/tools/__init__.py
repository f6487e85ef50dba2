"""Tools built on the library (not part of the core): the profiler, the tuner and their helpers.

``profile.py`` (with ``measurements.py`` and ``export.py``) is ``fully_shard.profile``; ``tune/`` is
``python -m fully_shard.tune``; ``memory.py`` and ``timing.py`` are shared with ``benchmarks/``;
``watch.py`` (collectives seen at the dispatcher) with ``benchmarks/`` and ``tests/``.
"""
