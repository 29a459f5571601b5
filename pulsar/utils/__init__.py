"""Small shared helpers (atomic file output)."""
