"""Test-only: in a ttp-patch started by the patcher's tests, take the fixture repository's
commit as the pin and stretch the write phase (testkit/patcher_pin.py says how and why)."""

import os

from testkit.patcher_pin import install_from_env

install_from_env(os.environ)
