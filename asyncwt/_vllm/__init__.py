"""The vLLM integration: the plugin and asyncwt's engines behind vLLM's factories."""
