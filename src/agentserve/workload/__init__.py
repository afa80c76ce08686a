"""Agent workloads: sessions of turns with block hashes, read from traces or generated."""
