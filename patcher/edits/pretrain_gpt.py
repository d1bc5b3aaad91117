"""pretrain_gpt.py: ttp-patch's edit 0 (the compatibility layer) and the guide's edit 1 (the
accelerator adaptor), both imports right after `import torch`, in that order."""

from __future__ import annotations

from typing import Optional

import libcst as cst

from ..options import Device, Options
from .base import Assessment, Edit, FileIndex, Op, State, parse_statements, source_key

FILE = "pretrain_gpt.py"
COMPAT_IMPORT = "import mindio_ttp.compat"


def _torch_import(index: FileIndex):
    """The one module-level `import torch`, or the reason there is not exactly one."""
    sites = index.find(None, source_key("import torch"))
    if len(sites) != 1:
        return None, f"anchor {'not found' if not sites else f'found {len(sites)} times'} " \
            "at module level"
    return sites[0], ""


class InsertCompatImport(Edit):
    """`import mindio_ttp.compat` right after `import torch`, whatever the device.

    Megatron 285068c fails at import on torch >= 2.0 (`torch._six`), and on any torch >= 2.6
    cannot read its own checkpoints (`weights_only`): the layer fixes what the installed torch
    needs. It precedes the adaptor import, because `megatron_npu` and the CPU adaptor import
    Megatron modules while they patch them.
    """

    id = "pretrain/compat-import"
    number = "0"
    file = FILE
    scope = None
    anchor = "import torch"
    summary = "import mindio_ttp.compat right after `import torch` (every device)"

    def assess(self, module: cst.Module, index: FileIndex, opts: Options) -> Assessment:
        site, why = _torch_import(index)
        if site is None:
            return Assessment(State.DRIFTED, why)
        followers = site.block.body[site.index + 1 :]
        key = source_key(COMPAT_IMPORT)
        if followers and index.key(followers[0]) == key:
            return Assessment(State.APPLIED)
        if index.find(None, key):
            return Assessment(State.DRIFTED, f"{COMPAT_IMPORT} is not right after `import torch`")
        stmts = parse_statements(COMPAT_IMPORT, module)
        return Assessment(State.MISSING, ops=[Op(site.block, site.index, after=stmts)])


class InsertAdaptorImport(Edit):
    """`import megatron_npu` (npu) or our CPU adaptor (cpu) right after `import torch` (and the
    compatibility import of edit 0, when that is there).

    It must precede every megatron import: the adaptor patches torch and Megatron functions
    before Megatron binds them. CUDA needs no adaptor, so for cuda the edit is "no adaptor
    import there". Detection without a known device reads the device back from the file.
    """

    id = "pretrain/adaptor-import"
    number = "1"
    file = FILE
    scope = None
    anchor = "import torch"
    summary = "device adaptor import right after `import torch` (npu: megatron_npu)"

    def assess(self, module: cst.Module, index: FileIndex, opts: Options) -> Assessment:
        site, why = _torch_import(index)
        if site is None:
            return Assessment(State.DRIFTED, why)
        shown = self._device_after(site.block.body[site.index + 1 :], index)
        elsewhere = [
            dev
            for dev in Device
            if dev.adaptor_import and index.find(None, source_key(dev.adaptor_import))
        ]
        if len(elsewhere) > (1 if shown else 0):
            names = ", ".join(d.adaptor_import or "" for d in elsewhere)
            return Assessment(State.DRIFTED, f"adaptor imports not right after torch: {names}")
        if opts.device is None:
            if shown is None:
                return Assessment(State.MISSING, "no adaptor import (cuda needs none)")
            return Assessment(State.APPLIED, f"device {shown.value}", inferred={"device": shown})
        if shown == opts.device:
            return Assessment(State.APPLIED, f"device {shown.value}")
        if opts.device is Device.CUDA and shown is None:
            return Assessment(State.APPLIED, "device cuda: no adaptor import")
        if shown is not None:
            return Assessment(
                State.DRIFTED, f"patched for --device {shown.value}, not {opts.device.value}"
            )
        stmts = parse_statements(opts.device.adaptor_import or "", module)
        return Assessment(State.MISSING, ops=[Op(site.block, site.index, after=stmts)])

    @staticmethod
    def _device_after(followers, index: FileIndex) -> Optional[Device]:
        if followers and index.key(followers[0]) == source_key(COMPAT_IMPORT):
            followers = followers[1:]
        if not followers:
            return None
        key = index.key(followers[0])
        for dev in Device:
            if dev.adaptor_import and key == source_key(dev.adaptor_import):
                return dev
        return None


EDITS = [InsertCompatImport(), InsertAdaptorImport()]
