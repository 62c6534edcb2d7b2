"""Benchmarks and simulations: they drive the programs' real code and report ratios against baselines."""
