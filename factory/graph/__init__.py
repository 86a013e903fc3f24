"""The graph: one module per layer type, assembled by ``factory.compile``."""
