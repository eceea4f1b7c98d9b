#!/usr/bin/env python
"""Run the cluster bench: `python benchmarks/cluster.py [--quick] [--out DIR]` (as root).

A thin wrapper around `asyncwt bench --cluster`; see `--help` for every option.
"""

import sys

from asyncwt._bench.cluster import main

if __name__ == "__main__":
    sys.exit(main())
