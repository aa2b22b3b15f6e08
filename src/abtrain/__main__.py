"""``python -m abtrain``: the ``abtrain`` command."""

import sys

from .cli import main

sys.exit(main())
