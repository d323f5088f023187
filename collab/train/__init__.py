"""A trainer peer: the loop and what it owns (the optimizer it builds, the batch plan it keeps, precision, the
NaN guard, checkpoints, and the volunteer's progress line)."""
