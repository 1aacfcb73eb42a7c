"""``python -m capopt``: the command line (`capopt.cli`)."""

import sys

from .cli import main

sys.exit(main())
