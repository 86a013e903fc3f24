"""The data factory: recipes in, curated, deterministic, resumable webdataset shards out.

Stages, in order: read (``readers``) -> format (``formatting``) -> filter
(``filters``) -> dedup (``dedup``) -> decontaminate (``decontam``) -> tokenize
(``tokenize``) -> mix (``mixing``) -> pack (``packing``) -> write (``shards``,
``energon``, ``megatron_index``, ``manifest``). ``pipeline`` runs them.
"""
