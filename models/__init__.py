"""Models shared by the examples, tests and benchmarks (one place; not part of the installed package)."""
