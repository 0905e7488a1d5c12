"""What the benchmarks share: workload traces, result tables and summaries,
pictures, progress bars and command-line values."""
