"""Planning: which backend and layout for a cluster, and what it should cost."""
