"""Benchmarks: autojigsaw next to PyTorch's and Megatron's tensor parallelism; run `python -m benchmarks.run_all`."""
