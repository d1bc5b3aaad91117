"""``python -m mindio_ttp.compat``: which fixes this machine's torch and numpy need, as JSON."""

from __future__ import annotations

import json

import numpy as np
import torch

from . import applied

print(json.dumps({"torch": torch.__version__, "numpy": np.__version__, "applied": applied()},
                 indent=2))
