"""`python -m artlike ...`: the same as the `artlike` console script (`python -m artlike serve`)."""

import sys

from ._cli import main

sys.exit(main())
