"""Regenerates patches/285068c/{npu,cuda,cpu}.patch from the codemods.

    python -m patcher.regenerate MEGATRON_DIR [--out patches/285068c]

The diffs come from the HEAD blobs of MEGATRON_DIR (its HEAD must hold the pinned targets; its
work tree may be patched or not), so they are exactly what `ttp-patch apply` writes with the
default port. Each is parsed back with unidiff before it is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from .diffs import render, summarize
from .errors import PatchError, WrongCommit
from .fileio import Change, write_all
from .options import Device, Options
from .pin import differing
from .tree import Tree

DEFAULT_OUT = Path("patches") / "285068c"


def regenerate(megatron_dir: str, out: Path) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    changes = []
    with Tree.open(megatron_dir) as tree:
        other = differing(tree.pin, tree.checkout.head_blob_ids())
        if other:  # patches/285068c/ must be 285068c's diffs, not a fork's
            raise WrongCommit(
                f"{megatron_dir}: HEAD's {', '.join(other)} differ from {tree.pin.commit[:7]}'s",
                f"git -C {megatron_dir} checkout {tree.pin.commit}",
            )
        for device in Device:
            text = render(tree.diffs(Options.build(device.value)))
            summarize(text)  # refuse to write a diff that does not parse back
            changes.append(Change(out / f"{device.value}.patch", text.encode("utf-8")))
    write_all(changes)
    return [c.path for c in changes]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m patcher.regenerate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("megatron_dir", metavar="MEGATRON_DIR")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    try:
        written = regenerate(args.megatron_dir, args.out)
    except PatchError as exc:
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    for path in written:
        files = summarize(path.read_text())
        stat = ", ".join(f"{f.path} +{f.added}/-{f.removed}" for f in files)
        print(f"wrote {path}: {stat}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
