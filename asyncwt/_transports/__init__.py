"""The data plane: the transport interface, the authenticated link it runs on, and one module or package per backend."""
