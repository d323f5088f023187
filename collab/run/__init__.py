"""A run as its organizer defines it: the signed manifest, and how peers share it."""
