"""The runtime's log set-up, for every process it runs in: a rank, the controller process, a node
agent. Below both the API face and the control plane, so neither imports the other for it."""

from __future__ import annotations

import logging
import os

from mindio_ttp.config import ENV_LOG_LEVEL, ENV_LOG_PATH
from mindio_ttp.config import value as config_value

log = logging.getLogger("mindio_ttp")


def setup_logging(rank: int, label: str = "") -> None:
    """One handler of ours on the "mindio_ttp" logger, at TTP_LOG_LEVEL (the settings table's
    check): stderr, or ttp-<who>.log in TTP_LOG_PATH. `label` names a process that is not a rank
    (the node agent); a rank's lines say its rank."""
    who = label or f"rank {rank}"
    log.setLevel(config_value(os.environ, ENV_LOG_LEVEL))
    for h in list(log.handlers):
        if getattr(h, "_ttp", False):
            log.removeHandler(h)
            h.close()
    path = os.environ.get(ENV_LOG_PATH)
    if path:
        os.makedirs(path, exist_ok=True)
        name = f"ttp-{who.replace(' ', '')}.log" if label else f"ttp-rank{rank}.log"
        handler: logging.Handler = logging.FileHandler(os.path.join(path, name))
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [ttp {who}] %(levelname)s %(name)s: %(message)s"))
    handler._ttp = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.propagate = False
