"""``python -m autoplan ARGS`` runs the command line, like the ``autoplan`` script."""

import sys

from autoplan.tools.cli import main

sys.exit(main())
