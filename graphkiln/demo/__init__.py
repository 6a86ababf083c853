"""``graphkiln demo``: the embedded default, end to end with no network."""
