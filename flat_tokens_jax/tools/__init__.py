"""What the ``flat-tokens`` command shows: ``show`` and ``phaseshow``."""
