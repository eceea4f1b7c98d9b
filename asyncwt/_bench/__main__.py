"""`python -m asyncwt._bench`: run the benchmark (see `asyncwt._bench._cli`)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
