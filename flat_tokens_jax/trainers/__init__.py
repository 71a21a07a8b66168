"""Trainer adapters: MaxText's, nanodo's and seqax's data entry points on a flat-tokens
loader (docs/guide/trainers.md). Nothing in the package imports them."""
