"""Client-side benchmarking: workloads, per-stream measurements, modes, plots (see benchmark.py)."""
