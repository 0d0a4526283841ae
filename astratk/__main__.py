"""`python -m astratk ...` is the `astratk` command (how a run starts its trainer processes)."""

import sys

from astratk.cli import main

sys.exit(main())
