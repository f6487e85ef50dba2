"""``python -m fully_shard.tools.tune``: the same command line as ``python -m fully_shard.tune``."""

from .cli import main

main()
