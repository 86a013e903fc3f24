"""Shipped data recipes (YAML) and the sample corpus, installed as ``factory.data_recipes``."""
