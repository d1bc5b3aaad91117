"""The three keys of the tiers, all derived from the job key (TTP_AUTH_KEY).

* the job key: ranks, the controller and the standby controllers (as before the tiers);
* the hop key: node agents and relays hold only this one; every hop's handshake and frames
  between tiers are made with it (and with per-connection session keys derived from it);
* the order key: the controller seals every order and verdict with it once, end to end
  (envelope.py); ranks verify. A node agent or relay holds no key that makes or alters one.

HKDF-SHA256 with a fixed salt and one label each: knowing the hop key tells nothing of the job
key or of the order key.
"""

from __future__ import annotations

from mindio_ttp.control.wire.session import hkdf_sha256

_SALT = b"mindio-ttp tiers v1"


def hop_key(job_key: bytes) -> bytes:
    return hkdf_sha256(_SALT, job_key, b"hop: agents and relays")


def order_key(job_key: bytes) -> bytes:
    return hkdf_sha256(_SALT, job_key, b"orders: controller to ranks, end to end")
