"""`python -m astratk ...` is the `astratk` command (how a run starts its trainer processes)."""

import sys

from astratk.cli import main

if __name__ == "__main__":  # a local cluster's worker processes re-import the main module: they must not run the CLI
    sys.exit(main())
