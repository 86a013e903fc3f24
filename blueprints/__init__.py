"""Shipped blueprint presets (YAML), installed as package data of ``factory.blueprints``."""
