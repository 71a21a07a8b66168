"""Trainer adapters: each trainer's own data entry points, with its signatures and
config keys, on a flat-tokens loader (``flat_tokens_jax.trainers.maxtext``,
``.nanodo``, ``.seqax``; docs/guide/trainers.md). Nothing in the package imports them.
"""
