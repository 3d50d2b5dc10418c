"""Benchmarks printing ratios against a baseline measured in the same run (README: Tests and
benchmarks), each run from the checkout's root as `.venv/bin/python -m bench.<name>`."""
