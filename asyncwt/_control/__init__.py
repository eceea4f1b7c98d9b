"""The control plane: vLLM's four weight-sync calls as a client protocol, over HTTP or in process."""
