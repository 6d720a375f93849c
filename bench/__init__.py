"""llmgw's benchmarks: `just bench` runs them, prints figures and writes BENCHMARKS.md."""
