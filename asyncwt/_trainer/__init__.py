"""The trainer: the engine and its round protocol, the iterate → pack → send pipeline, device lanes, the blocking façade."""
