"""`ttp-demo`: a 4-rank CPU job that loses a rank, writes a dying checkpoint and resumes from it.

The toy job by default; ``ttp-demo --megatron DIR`` runs the same story on a patched copy of a
real Megatron-LM 285068c checkout (`mindio_ttp.demo.megatron`).

`main` lives in `mindio_ttp.demo.cli`; it is imported lazily so that `mindio_ttp.demo.model` and
`mindio_ttp.demo.checkpoint` stay importable without pulling in the launcher.
"""

from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mindio_ttp.demo.cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
