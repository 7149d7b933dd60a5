"""The graph IR (graph.py), its op registry (ops.py), the torch frontend and the interpreter."""
