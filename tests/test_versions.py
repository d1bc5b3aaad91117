"""`--version` on the three installed commands: what a user pastes into a bug report."""

from __future__ import annotations

import subprocess

import pytest

import mindio_ttp


@pytest.mark.parametrize("command", ["ttp-patch", "ttprun", "ttp-demo"])
def test_version_names_the_command_and_the_package_version(command: str) -> None:
    done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{command} {mindio_ttp.__version__}"
