"""`python -m patcher` is `ttp-patch`."""

import sys

from .cli import main

sys.exit(main())
