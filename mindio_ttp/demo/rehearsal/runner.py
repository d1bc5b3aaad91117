"""Run a Megatron entry script unmodified with the CPU adaptor installed first.

``python -m mindio_ttp.demo.rehearsal.runner /path/Megatron-LM/pretrain_gpt.py ARGS...``
(works under ``torchrun -m`` / ``ttprun -m``). This is what ``ttp-patch apply --device cpu``
achieves by an import line, for trees that are not patched: the baselines.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("usage: python -m mindio_ttp.demo.rehearsal.runner "
                         "MEGATRON_DIR/pretrain_gpt.py [megatron args...]")
    script = Path(argv[0]).resolve()
    if not script.is_file():
        raise SystemExit(f"no such entry script: {script}")
    import torch  # noqa: F401  (same order as the patched script: torch, then the adaptor)

    import mindio_ttp.cpu_adaptor  # noqa: F401

    sys.argv = [str(script), *argv[1:]]
    # `python pretrain_gpt.py` puts the script's folder first on sys.path; do the same.
    sys.path[0:0] = [str(script.parent)]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
