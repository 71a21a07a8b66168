"""Datasets and records: open, read, pack, write and validate flat-tokens splits."""
