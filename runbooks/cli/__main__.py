"""`python -m runbooks.cli`: the same as the `cudamedic` command."""

import sys

from runbooks.cli import main

sys.exit(main())
