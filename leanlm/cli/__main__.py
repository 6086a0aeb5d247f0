"""`python -m leanlm.cli` is the `leanlm` command."""

import sys

from leanlm.cli.main import main

sys.exit(main())
