"""Published word-problem benchmarks as built-in tasks (being written)."""

BENCHMARK_TASKS: tuple = ()
