"""What peers say to each other through the DHT: who a peer is (its key), the signed records it publishes,
how another peer's records are read as untrusted input, and what this peer refused and from whom."""
