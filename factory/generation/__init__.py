"""Text generation from a model: incremental decoding over the layers' caches
(``factory.nn.decoding``), greedy or sampled, with MTP self-speculation
(:mod:`factory.generation.speculative`). ``factory generate`` runs it."""

from factory.generation.decode import GenerationRefused, GenerationResult, generate

__all__ = ["GenerationRefused", "GenerationResult", "generate"]
