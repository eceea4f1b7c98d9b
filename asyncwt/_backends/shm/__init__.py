"""The `"shm"` backend: one host, direct reads of the trainer's memory or a shared ring."""
