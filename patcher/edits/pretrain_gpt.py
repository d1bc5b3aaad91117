"""Edit 1 of the guide: the accelerator adaptor import in pretrain_gpt.py."""

from __future__ import annotations

from typing import Optional

import libcst as cst

from ..options import Device, Options
from .base import Assessment, Edit, FileIndex, Op, State, parse_statements, source_key

FILE = "pretrain_gpt.py"


class InsertAdaptorImport(Edit):
    """`import megatron_npu` (npu) or our CPU adaptor (cpu) right after `import torch`.

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
        sites = index.find(None, source_key(self.anchor))
        if len(sites) != 1:
            how = "not found" if not sites else f"found {len(sites)} times"
            return Assessment(State.DRIFTED, f"anchor {how} at module level")
        site = sites[0]
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
        if not followers:
            return None
        key = index.key(followers[0])
        for dev in Device:
            if dev.adaptor_import and key == source_key(dev.adaptor_import):
                return dev
        return None


EDITS = [InsertAdaptorImport()]
