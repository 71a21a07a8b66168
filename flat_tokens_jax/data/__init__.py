"""Datasets and records: ``open_dataset``/``FlatTokens``, packed, padded and bin
records, packing plans, the writer and validation.
"""
