"""Backends: nvcc (compile-only, resource reports) and PyCUDA (run on the GPU)."""
