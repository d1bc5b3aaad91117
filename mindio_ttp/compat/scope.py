"""Who counts as "Megatron" when a patch only lies to Megatron.

Some patches change answers that other code relies on (``torch.load``'s default here; the CPU
adaptor's ``torch.cuda.is_available()`` and the string ``Tensor.type()`` returns). They look at
the module of the direct caller, so the launcher, the TTP runtime and the test suite in the same
process keep seeing stock torch. Megatron code is: modules named ``megatron`` / ``megatron.*``,
the glue ``mindio_ttp.megatron_ttp`` (it runs Megatron's own save/load code paths and mirrors
their calls), and entry scripts run as ``__main__`` from a Megatron tree root
(``pretrain_gpt.py``, recognised by a ``megatron/__init__.py`` beside the script).
"""

from __future__ import annotations

import functools
import os
import sys

#: Module-name prefixes whose calls get the CPU answers.
MEGATRON_MODULE_PREFIXES = ("megatron", "mindio_ttp.megatron_ttp")


@functools.lru_cache(maxsize=64)
def _is_megatron_entry_script(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    root = os.path.dirname(os.path.abspath(filename))
    return os.path.isfile(os.path.join(root, "megatron", "__init__.py"))


def module_is_megatron(name: str, filename: str = "") -> bool:
    """Whether code from module ``name`` (defined in ``filename``) is treated as Megatron."""
    if name == "__main__":
        return _is_megatron_entry_script(filename)
    return any(name == p or name.startswith(p + ".") for p in MEGATRON_MODULE_PREFIXES)


def called_from_megatron(depth: int = 2) -> bool:
    """Whether the frame ``depth`` levels above this call belongs to Megatron.

    depth=2 is the caller of the function that asks (the patched torch function's caller).
    """
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return False
    name = frame.f_globals.get("__name__") or ""
    return module_is_megatron(name, frame.f_code.co_filename)
