"""Whole jobs as library calls: ``factory.build`` and ``factory.train``.

Each job is one typed function that validates its request, does the work and
returns a typed result; none prints. Long work reports to an optional
``progress(stage, done, total)`` callback (:class:`factory.progress.RichProgress`
draws it with rich), so the CLI, a notebook or a distributed launcher call
the same code. ``factory.data.build`` is the data job both of them run.

Nothing here imports torch at import time: ``factory.train`` imports it when
it runs.
"""
