"""Kernels the model and the executor call: batch-invariant GEMMs and attention tiles, the native
CPU library (`csrc/`, built ahead of time by `python -m runtime.ops.cpu_ops`), and the Triton
kernels (`kernels/`)."""
