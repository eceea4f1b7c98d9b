"""Delta rounds: send only what changed since the workers' version, losslessly, checked."""
