"""Helpers for tests and the demo only: oracles, comparisons, the recall metric, known warnings.

The harness they share with the benchmarks (megatron-core on CPU, tiny models) is
`hyscale_bench`.
"""
