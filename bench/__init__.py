"""GPU benchmarks and checks (bench/README.md)."""
