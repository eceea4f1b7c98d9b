#!/usr/bin/env python
"""Run asyncwt's benchmark: `python benchmarks/bench.py [--quick] [--out DIR]`.

A thin wrapper around `asyncwt bench` (also `python -m asyncwt._bench`); see
`--help` for every option.
"""

import sys

from asyncwt._bench import main

if __name__ == "__main__":
    sys.exit(main())
