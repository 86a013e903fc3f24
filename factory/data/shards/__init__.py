"""Shards: the files a build publishes, and the one reader and writer of them.

The webdataset tar format (its field table, the writer and the one tar reader
that the trainer's loader, ``factory data verify``, the Energon index and the
Ray executor all use), ``manifest.json``, Energon's metadata, index and task
encoder, and Megatron's indexed dataset.
"""
