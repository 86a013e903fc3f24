"""Executors: where the stages' calls run, a local process pool or Ray tasks.

Both run the same stage functions and write the same bytes.
"""
