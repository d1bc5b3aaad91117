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


class StoreFromRuntime(m.MatcherDecoratableTransformer):
    """`init_process_group(..., timeout=...)` -> `init_process_group(..., timeout=...,
    store=mega.process_group_store())`: the new argument on a line of its own, laid out like
    the one before it."""

    @m.leave(m.Call(func=m.Attribute(value=m.Attribute(value=m.Name("torch"),
                                                        attr=m.Name("distributed")),
                                     attr=m.Name("init_process_group"))))
    def add_store(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        args = list(updated_node.args)
        comma = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) \
            else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        store = cst.Arg(keyword=cst.Name("store"), equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
            value=cst.Call(func=cst.Attribute(value=cst.Name("mega"),
                                              attr=cst.Name("process_group_store"))))
        args[-1] = args[-1].with_changes(comma=comma)
        return updated_node.with_changes(args=[*args, store])
