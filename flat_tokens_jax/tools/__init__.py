"""What the ``flat-tokens`` command shows and previews of a run."""
