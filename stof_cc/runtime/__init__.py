"""Runtime: what runs compiled kernels on torch tensors."""
