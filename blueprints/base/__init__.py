"""Fragments the presets compose with ``extends:``."""
