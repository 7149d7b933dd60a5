"""Kernel templates: a Jinja2 CUDA source (`<name>.cu.j2`) and a Python spec next to it."""
