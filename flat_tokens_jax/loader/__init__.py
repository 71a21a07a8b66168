"""Batches of a run: ``LoaderConfig``, ``Loader``, read-ahead, resume and
phases.
"""
