"""Exports for the engines users scale out on: Hugging Face checkpoints (and, later, Megatron)."""
