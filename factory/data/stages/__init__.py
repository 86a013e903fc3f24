"""Stages: the build's passes over whole units (input files) and shards.

Curate (``curate``: per input file, in parallel), dedup (``dedup``, sequential;
``dedup_shuffle``, the same decisions as a shuffle of keys), then mix, pack and
write (``mixing``, ``mixed_stream``, ``packing``, ``shard_plan``,
``write_shards``). ``run_stages`` runs them in that order over a build's
``stage_inputs``, every call through a ``runner`` that an executor
(``factory.data.executors``) supplies; ``unit_files`` is the intermediate file
format between them.
"""
