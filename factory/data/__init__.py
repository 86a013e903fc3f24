"""The data factory: recipes in, curated, deterministic, resumable webdataset shards out.

Organised by role: ``steps`` (what happens to one record or document: read,
format, filter, decontaminate, tokenize, hash), ``stages`` (passes over all
units and shards: curate, dedup, mix and pack, write), ``shards`` (the
published files: the tar format's one reader and writer, the manifest, Energon
and Megatron outputs) and ``executors`` (a local process pool or Ray tasks).
:func:`build` (``factory.data.build``, in ``build_job``) is the one job that
runs them::

    manifest = factory.data.build("nano", Path("data/nano"), workers=8, seq_len=8192)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from factory.lazy import lazy_dir, lazy_getattr

__all__ = ["LoadedRecipe", "build", "load_recipe"]

if TYPE_CHECKING:
    from factory.data.build_job import build
    from factory.data.loaded_recipe import LoadedRecipe, load_recipe

# Resolved on first use: the build imports numpy, and importing any module
# of this package (a worker's, say) runs this file first.
_LAZY = {
    "build": "factory.data.build_job",
    "LoadedRecipe": "factory.data.loaded_recipe",
    "load_recipe": "factory.data.loaded_recipe",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
__dir__ = lazy_dir(_LAZY, globals())
