"""`python -m runbooks.cli`: the same as the `cudamedic` command."""

import sys

from runbooks.cli import main

if __name__ == "__main__":  # imported (a test walking every module), it runs nothing
    sys.exit(main())
