"""The `asyncwt` command line: `worker`, `demo`, and starting a worker in a child process."""
