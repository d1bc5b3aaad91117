"""Which step can be saved, and by whom: pure functions of the ranks' reported states.

Rule (runtime contract 5): a rank can serve step t iff it is alive, answered, and reported
"finished updating at t, not updating now". DP position i holds optimizer shard i % replica.
The newest t at which every shard of every DP group has such a rank is saved; otherwise
nothing is, and the reason names the shard without a clean replica. No clock, no I/O: the
controller passes in what it collected and gets back a decision plus a human-readable reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from mindio_ttp.control.wire.ranksets import describe


@dataclass(frozen=True)
class RankState:
    alive: bool  # connected and answered the collect
    step: Optional[int]  # last step whose update finished (None: no update yet)
    updating: bool  # inside its update window when locked
    note: str = ""  # why not alive, for messages ("dead", "hung", "no answer")

    def clean_at(self) -> Optional[int]:
        """The step this rank can serve, or None."""
        if not self.alive or self.updating or self.step is None or self.step < 1:
            return None
        return self.step


@dataclass(frozen=True)
class Layout:
    """DP groups (global ranks in DP order) and the number of distinct shards per group."""

    groups: Tuple[Tuple[int, ...], ...]
    replica: int

    @classmethod
    def build(cls, groups: Iterable[Sequence[int]], replica: int) -> Layout:
        uniq = sorted({tuple(g) for g in groups})
        seen: Set[int] = set()
        for g in uniq:
            if not g:
                raise ValueError("empty DP group")
            if replica < 1 or replica > len(g):
                raise ValueError(f"replica={replica} must be in 1..{len(g)} for DP group "
                                 f"{describe(g)}")
            clash = seen.intersection(g)
            if clash or len(set(g)) != len(g):
                raise ValueError(f"rank(s) {describe(sorted(clash) or g)} appear in more than one "
                                 f"DP group (or twice in {describe(g)}): DP groups must "
                                 "partition ranks")
            seen.update(g)
        return cls(tuple(uniq), replica)

    def shards(self, group: Sequence[int]) -> List[List[int]]:
        """Holders of each shard of one group: shard s -> ranks at positions s, s+replica, ..."""
        return [list(group[s::self.replica]) for s in range(self.replica)]

    @property
    def ranks(self) -> Set[int]:
        return {r for g in self.groups for r in g}


Claim = Tuple[Tuple[int, ...], Sequence[int]]  # a DP group as registered, and who registered it


def agreed_layout(claims: Iterable[Claim], replica: int) -> Tuple[Layout, Dict[int, str]]:
    """The layout from the DP groups the members agree on, and the ranks whose claim is
    dropped, with why (issue 24).

    Every rank registers its own DP group; a key holder may register any group (rank 3 as
    [3, 2, 1, 0]), and a layout built from every claim was inconsistent: nothing was saved
    though every shard had an honest clean holder. Claims that give every rank the same shard
    (its position mod `replica`) are one group, whatever their order. Groups are taken by
    support, the most first (ties: the larger group, then the lowest ranks), each unless it
    shares a rank with one taken already; a rank whose group is not taken disagrees with what
    its members say, and its claim is dropped like a step report beyond the agreed step: the
    flow does not use its state. One liar is outvoted by the rest of its group; in a group of
    two it cannot tell the other member's shard apart from its own unless it changes who is in
    the group, which the other groups then refute. O(sum of the claimed groups' sizes)."""
    classes: Dict[Tuple[Tuple[int, ...], ...], Tuple[Tuple[int, ...], List[int]]] = {}
    for group, who in claims:
        if not who:
            continue
        key = tuple(tuple(sorted(group[s::replica])) for s in range(replica))
        entry = classes.get(key)
        if entry is None:
            classes[key] = (tuple(group), list(who))
        else:
            if min(who) < min(entry[1]):  # the lowest supporter's order represents it
                entry = classes[key] = (tuple(group), entry[1])
            entry[1].extend(who)
    order = sorted(classes.values(),
                   key=lambda c: (-len(c[1]), -len(c[0]), sorted(c[0])))
    owner: Dict[int, Tuple[int, ...]] = {}
    taken: List[Tuple[int, ...]] = []
    dropped: Dict[int, str] = {}
    for group, who in order:
        clash = next((r for r in group if r in owner), None)
        if clash is None:
            taken.append(group)
            owner.update((r, group) for r in group)
            continue
        theirs = owner[clash]
        for r in who:
            dropped[r] = (f"registered DP group {describe(group)}, which its members do not "
                          f"confirm (rank {clash} is in DP group {describe(theirs)}): a faulty "
                          "rank, its state is not used")
    return Layout.build(taken, replica), dropped


def _describe(rank: int, st: Optional[RankState]) -> str:
    if st is None:
        return f"rank {rank} unknown"
    if not st.alive:
        return f"rank {rank} {st.note or 'dead'}"
    if st.updating:
        return f"rank {rank} updating after step {st.step}"
    if st.step is None or st.step < 1:
        return f"rank {rank} has no finished update"
    return f"rank {rank} clean at step {st.step}"


def choose_step(layout: Layout, states: Mapping[int, RankState],
                world_size: Optional[int] = None) -> Tuple[Optional[int], str]:
    """The newest step every shard of every DP group can serve, with the reason for the choice.

    `world_size`, when given, makes ranks outside every known DP group an error: their
    group's layout is unknown so its shards cannot be checked.
    """
    if not layout.groups:
        return None, "no DP group is known: no processor registered its layout"
    if world_size is not None:
        missing = sorted(set(range(world_size)) - layout.ranks)
        if missing:
            head = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            return None, (f"rank(s) {head} belong to no known DP group (their whole group is "
                          "gone): their optimizer shards cannot be saved")
    common: Optional[Set[int]] = None
    per_shard: List[Tuple[Tuple[int, ...], int, List[int], Set[int]]] = []
    for group in layout.groups:
        for s, holders in enumerate(layout.shards(group)):
            steps = {t for r in holders if r in states
                     for t in [states[r].clean_at()] if t is not None}
            per_shard.append((group, s, holders, steps))
            if not steps:
                why = "; ".join(_describe(r, states.get(r)) for r in holders)
                return None, (f"no consistent step: DP group {describe(group)} shard {s} has no "
                              f"clean replica ({why})")
            common = steps if common is None else common & steps
    assert common is not None
    if not common:
        # every shard has clean ranks, but at no common step: name the first shard that differs
        newest = max(max(st) for *_, st in per_shard)
        for group, s, holders, steps in per_shard:
            if newest not in steps:
                why = "; ".join(_describe(r, states.get(r)) for r in holders)
                return None, (f"no consistent step: DP group {describe(group)} shard {s} has no "
                              f"clean replica at step {newest} ({why}), and no older step is "
                              "clean on every shard")
        return None, "no consistent step: shards are clean at disjoint steps"  # pragma: no cover
    step = max(common)
    return step, (f"step {step}: every shard of {len(layout.groups)} DP group(s) has a clean "
                  "replica")


def savers_for(layout: Layout, states: Mapping[int, RankState], step: int) -> List[int]:
    """One clean rank per shard per group at `step` (the lowest DP position), sorted."""
    chosen: List[int] = []
    for group in layout.groups:
        for s, holders in enumerate(layout.shards(group)):
            for r in holders:
                st = states.get(r)
                if st is not None and st.clean_at() == step:
                    chosen.append(r)
                    break
            else:
                raise ValueError(f"DP group {describe(group)} shard {s} has no clean rank at "
                                 f"{step}")
    return sorted(chosen)


def replacement_savers(layout: Layout, states: Mapping[int, RankState], step: int,
                       savers: Sequence[int], failed: Set[int],
                       alive: Set[int]) -> Optional[List[int]]:
    """The savers of a new attempt at `step` after the ranks in `failed` failed their save (or
    missed its deadline): each shard keeps its saver unless that one failed; a failed saver's
    shard goes to another holder clean at `step` that has not failed; with none, to the same
    saver again if it is still alive (its failure may have been another's: a rank waiting for a
    dead writer's flag fails too). None when some shard has nobody left, or when nothing would
    change (the same ranks again: the same failure)."""
    chosen: List[int] = []
    for group in layout.groups:
        for holders in layout.shards(group):
            keep = [r for r in holders if r in savers and r not in failed]
            spare = [r for r in holders if r not in failed and r in alive
                     and r in states and states[r].clean_at() == step]
            again = [r for r in holders if r in savers and r in alive]
            pick = keep or spare or again
            if not pick:
                return None
            chosen.append(pick[0])
    chosen.sort()
    return None if chosen == sorted(savers) else chosen


def states_from(reports: Mapping[int, Tuple[Optional[int], bool]], known: Iterable[int],
                notes: Optional[Dict[int, str]] = None) -> Dict[int, RankState]:
    """RankState for every known rank from collected (step, updating) reports."""
    notes = notes or {}
    out: Dict[int, RankState] = {}
    for r in known:
        if r in reports:
            step, updating = reports[r]
            out[r] = RankState(True, step, updating)
        else:
            out[r] = RankState(False, None, False, notes.get(r, "did not answer"))
    return out
