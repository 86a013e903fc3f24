"""The data factory: recipes in, curated, deterministic, resumable webdataset shards out.

Stages, in order: read (``readers``) -> format (``formatting``) -> filter
(``filters``) -> dedup (``dedup``) -> decontaminate (``decontam``) -> tokenize
(``tokenize``) -> mix (``mixing``) -> pack (``packing``) -> write (``shards``,
``energon``, ``megatron_index``, ``manifest``). ``pipeline`` runs them, and
:func:`build` (``factory.data.build``) is the one job that does::

    manifest = factory.data.build("nano", Path("data/nano"), workers=8, seq_len=8192)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from factory.lazy import lazy_getattr

__all__ = ["LoadedRecipe", "build", "load_recipe"]

if TYPE_CHECKING:
    from factory.data.pipeline import build
    from factory.data.recipe_loading import LoadedRecipe, load_recipe

# Resolved on first use: the pipeline imports numpy, and importing any module
# of this package (a worker's, say) runs this file first.
_LAZY = {
    "build": "factory.data.pipeline",
    "LoadedRecipe": "factory.data.recipe_loading",
    "load_recipe": "factory.data.recipe_loading",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
