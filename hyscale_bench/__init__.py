"""HyScale's benchmarks and the harness they share with the tests and the demo.

Shipped in the same wheel as `megatron_hyscale`, on top of it: nothing in `megatron_hyscale`'s
runtime imports it. `python -m hyscale_bench.layer` runs the layer benchmark; the scripts in
`scripts/` are thin command lines over it.
"""
