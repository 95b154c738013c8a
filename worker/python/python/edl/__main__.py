"""`python -m edl ...`: the `edl` command (see edl.cli)."""

import sys

from .cli import main

sys.exit(main())
