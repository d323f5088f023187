"""The swarm seen from one peer: its DHT node (joining, healing a split) and the run's state read from every
peer's records."""
