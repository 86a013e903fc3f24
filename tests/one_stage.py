"""A preset as one stage: its own sections without ``stages``, for the tests of the
single-stage build (a program's build is tests/test_build_program.py's). A preset that
states no program is returned as it is."""

from __future__ import annotations

import factory
from factory.schemas.blueprint import Blueprint

__all__ = ["one_stage"]


def one_stage(name: str) -> Blueprint:
    return factory.load_blueprint(name).model_copy(update={"stages": None})
