"""``python -m kvgen``: the ``kvgen`` command line."""

import sys

from kvgen.cli import main

sys.exit(main())
