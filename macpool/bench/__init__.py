"""Load generation and benchmarks."""
