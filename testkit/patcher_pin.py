"""What the patcher's tests inject into ttp-patch, in this process or in the ones they start.

ttp-patch checks a checkout against Megatron-LM 285068c (patcher.pin.pinned()), which a small
fixture repository cannot contain, and its write phase takes milliseconds, too short for a test
to stop it at a chosen file. The product reads no switch for either; the tests replace
``patcher.pin.pinned`` and stretch ``patcher.fileio._apply`` (one file of the write phase):

* in the test process, with :func:`pin_to` / :func:`stretch_writes` (through pytest's
  monkeypatch, so they are undone after the test);
* in a ``ttp-patch`` the test starts, through :func:`child_env`: the ``sitecustomize`` of
  ``testkit/hooks/patcher_hook`` on its PYTHONPATH does the same right after import, from
  the two variables below (read by that hook only, never by ttp-patch).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional

from testkit.hooks import PATCHER_HOOK_DIR, pythonpath

PIN_ENV = "TTP_TESTKIT_PATCHER_PIN"  # JSON: {"commit": sha, "blobs": {path: blob id}}
PAUSE_ENV = "TTP_TESTKIT_PATCHER_PAUSE"  # seconds before each file of the write phase


def fixture_pin(root: Path, commit: str):
    """A Pin for `commit` of the repository at `root`: its target files' blob ids."""
    from patcher.edits import TARGET_FILES
    from patcher.pin import Pin

    out = subprocess.run(["git", "-C", str(root), "ls-tree", commit, "--", *TARGET_FILES],
                         check=True, capture_output=True, text=True).stdout
    blobs = {line.split("\t", 1)[1]: line.split()[2] for line in out.splitlines()}
    return Pin(commit, blobs)


def pin_to(monkeypatch, root: Path, commit: str) -> None:
    """Make ttp-patch in this process, and in those started with child_env(), take `commit` of
    the repository at `root` as the pinned one."""
    pin = fixture_pin(root, commit)
    monkeypatch.setattr("patcher.pin.pinned", lambda: pin)
    monkeypatch.setenv(PIN_ENV, json.dumps({"commit": pin.commit, "blobs": pin.blobs}))
    monkeypatch.setenv("PYTHONPATH", pythonpath(PATCHER_HOOK_DIR))


def unpin(monkeypatch) -> None:
    """Back to the product's pin (285068c), here and in child processes."""
    from patcher import pin

    monkeypatch.setattr("patcher.pin.pinned", lambda: pin.PIN)
    monkeypatch.delenv(PIN_ENV, raising=False)


def paused(apply: Callable, seconds: float) -> Callable:
    def slow_apply(*args, **kwargs):
        time.sleep(seconds)
        return apply(*args, **kwargs)

    slow_apply.__wrapped__ = apply  # type: ignore[attr-defined]
    return slow_apply


def stretch_writes(seconds: float) -> None:
    """In this process (e.g. a forked child): sleep before each file of the write phase."""
    from patcher import fileio

    fileio._apply = paused(fileio._apply, seconds)


def child_env(pause: Optional[float] = None, env: Optional[Mapping[str, str]] = None
              ) -> Dict[str, str]:
    """The environment for a ttp-patch child: the hook on PYTHONPATH, the pin (when pin_to set
    one) and, given `pause`, the stretched write phase."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = pythonpath(PATCHER_HOOK_DIR, env=out)
    if pause is not None:
        out[PAUSE_ENV] = str(pause)
    return out


def install_from_env(env: Mapping[str, str]) -> None:
    """The hook's half: apply PIN_ENV / PAUSE_ENV to patcher's modules once they are imported."""
    from testkit.import_hooks import after_import

    raw_pin = env.get(PIN_ENV)
    if raw_pin:
        doc = json.loads(raw_pin)

        def set_pin(module) -> None:
            pin = module.Pin(doc["commit"], dict(doc["blobs"]))
            module.pinned = lambda: pin

        after_import("patcher.pin", set_pin)
    raw_pause = env.get(PAUSE_ENV)
    if raw_pause:
        seconds = float(raw_pause)

        def stretch(module) -> None:
            module._apply = paused(module._apply, seconds)

        after_import("patcher.fileio", stretch)
