"""The worker: the engine with deferred apply, the applier, the round state machine and the HTTP server."""
