"""``python -m accordion.cli`` runs the command line, as ``python -m accordion`` does."""

import sys

from . import main

sys.exit(main())
