"""`python -m leanlm`: the same entry point as the `leanlm` console script."""

import sys

from leanlm.cli import main

sys.exit(main())
