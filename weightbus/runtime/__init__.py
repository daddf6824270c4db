"""Layer 4b: how groups of workers are reached (local processes; Ray later)."""
