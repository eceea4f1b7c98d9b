"""The core: parameter metadata, weight sources, the plan, settings, errors and the small pieces everything else uses (depends on nothing above it)."""
