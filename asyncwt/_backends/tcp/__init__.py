"""The `"tcp"` backend: every bucket streams over each worker's own connection."""
