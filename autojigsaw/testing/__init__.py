"""Test harnesses: the local rank pool that tests, the demo and the benchmarks run on."""
