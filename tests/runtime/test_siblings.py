"""launch/siblings.py: the launcher that listed itself first says so once the second appears."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from mindio_ttp.launch.siblings import Siblings

LINE = "other ttprun of this job on this host"


def test_the_first_launcher_says_it_once_the_second_is_listed(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "registry"
    folder.mkdir(mode=0o700)
    first = Siblings(folder, "job1", tmp_path / "run0")
    caplog.set_level(logging.WARNING, logger="ttprun")
    first.publish([0, 1])
    first.notice(every_s=0.0)
    assert LINE not in caplog.text  # alone so far
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (folder / f"job1-{other.pid}.json").write_text(
            json.dumps({"pid": other.pid, "run_dir": str(tmp_path / "run1"), "ranks": [2, 3]}))
        (folder / "job2-1.json").write_text(  # another job's launcher is not a sibling
            json.dumps({"pid": other.pid, "run_dir": "x", "ranks": [9]}))
        first.notice(every_s=3600.0)  # looked a moment ago: not yet
        assert LINE not in caplog.text
        first._looked = 0.0
        first.notice(every_s=3600.0)
        assert caplog.text.count(LINE) == 1, caplog.text
        assert f"pid {other.pid}, ranks [2, 3]" in caplog.text
        assert first.owner(3)["pid"] == other.pid and first.owner(9) is None
        first._looked = 0.0
        first.notice(every_s=0.0)
        assert caplog.text.count(LINE) == 1  # said once
    finally:
        other.kill()
        other.wait(10)
    assert first.others() == []  # a dead launcher's entry is no sibling
