"""Converters from other data into flat-tokens stores."""
