"""`python -m asyncwt ...`: the `asyncwt` command line."""

import sys

from ._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
