"""The two in-place rewrites (edits 2.2 and 3.2) as matcher-driven transformers.

Kept in their own module and imported only when a rewrite runs: `libcst.matchers` takes
~150 ms to import, which `status`/`verify` (detection only) never need to pay.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m


class QualifyLoadCheckpoint(m.MatcherDecoratableTransformer):
    """`load_checkpoint(...)` -> `mega.load_checkpoint(...)`, arguments and spacing kept."""

    @m.leave(m.Call(func=m.Name("load_checkpoint")))
    def qualify(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        return updated_node.with_changes(
            func=cst.Attribute(value=cst.Name("mega"), attr=cst.Name("load_checkpoint"))
        )


class SwapOptimizerClass(m.MatcherDecoratableTransformer):
    """`DistributedOptimizer` -> `ReplicatedOptimizer`; the whitespace nodes (the backslash
    continuation of `opt_ty = ... \\`) are untouched because only the Name changes."""

    @m.leave(m.Name("DistributedOptimizer"))
    def swap(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        return updated_node.with_changes(value="ReplicatedOptimizer")


class TimeoutFromRuntime(m.MatcherDecoratableTransformer):
    """`timeout=timedelta(minutes=10)` -> `timeout=mega.process_group_timeout(timedelta(...))`:
    Megatron's value stays visible as the floor; the argument's layout is kept."""

    @m.leave(m.Arg(keyword=m.Name("timeout"), value=m.Call(func=m.Name("timedelta"))))
    def wrap(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        call = cst.Call(
            func=cst.Attribute(value=cst.Name("mega"), attr=cst.Name("process_group_timeout")),
            args=[cst.Arg(value=updated_node.value)],
        )
        return updated_node.with_changes(value=call)
