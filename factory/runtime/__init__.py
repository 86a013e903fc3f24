"""The training runtime: one trainer for one process or many.

``trainer`` is the one :class:`~factory.runtime.trainer.Trainer` (with ``fit``).
Everything besides the step is a callback (``callbacks``): the stability
``monitors``, ``metrics.jsonl`` (``metrics``), the experiment trackers of
``training.loggers`` (``loggers``), the progress ``display`` and the periodic
checkpoints (``checkpoint``, with ``run_state``). ``step`` runs one step's
forward and backward (``pipeline_schedule`` through a pipeline schedule),
``ranks`` answers what the trainer asks of the other processes, ``placement``
lays a compiled model out on them, ``optimizer``, ``gradients`` and ``schedule``
make the update, and ``batches`` and ``loader`` read the micro-batches from the
built shards. The training job (``factory.jobs.train``) drives it.

Nothing here is imported by ``import factory``: the trainer and the modules it
runs need torch, and the torch-free commands must stay torch-free.
``callbacks``, ``monitors``, ``metrics``, ``loggers``, ``schedule`` and
``checkpoint_errors`` are torch-free themselves.
"""
