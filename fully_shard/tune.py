"""``python -m fully_shard.tune``: the wrap-granularity tuner, which lives in ``fully_shard/tools/tune/``."""

from fully_shard.tools.tune import *  # noqa: F403  (the names of the old module, for its importers)
from fully_shard.tools.tune import main

if __name__ == "__main__":
    main()
