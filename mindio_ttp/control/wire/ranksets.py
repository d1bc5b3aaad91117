"""Lists of ranks on the wire in O(1) bytes for the layouts jobs use: nested arithmetic runs.

A save order names every chosen rank and every rank's exit order repeats them, so sent as
plain lists the N/2 orders of one flow carry O(N) bytes each: O(N^2) per flow, about 50,000 x
350 KB at 100,000 ranks. But the lists a job produces are regular: a Megatron DP group is an
arithmetic progression (stride TP), and the chosen savers are the first DP positions of every
group, which is one block of consecutive ranks per pipeline stage (or a periodic pattern of
blocks). So a list travels as blocks `[start, step, count, outer_step, outer_count]`, each
standing for

    [start + i * outer_step + j * step for i in range(outer_count) for j in range(count)]

in that order (order matters: a DP group's order gives each rank its shard). A regular list
is one block; each rank that deviates from the pattern (a dead saver replaced by its partner)
adds at most a few. The encoding is greedy, exact for any list, and degrades to one block per
rank only for lists with no structure at all.

Every block is strictly increasing: `step` >= 1, and a repeat starts past the end of the run
before it (`outer_step` > (count - 1) * step). A descending stretch of a list (pairs placed
across hosts can order a DP group so) is sent as several blocks. `decode` refuses an inverted
block (negative or zero step: one block used to stand for a group as [3, 2, 1, 0]) and one that
overlaps itself, and anything that would expand past `MAX_RANKS` or outside `0..MAX_RANKS-1`,
before it expands, so a peer cannot make a receiver allocate more than a world's worth. That a
list names no rank twice (blocks overlapping each other) is the protocol's check.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

MAX_RANKS = 1 << 17  # above the largest world the API accepts (100,000)
Block = Tuple[int, int, int, int, int]  # start, step, count, outer_step, outer_count


def _runs(ranks: Sequence[int]) -> List[Tuple[int, int, int]]:
    """Maximal increasing arithmetic runs (start, step >= 1, count), greedily, in order."""
    runs: List[Tuple[int, int, int]] = []
    i, n = 0, len(ranks)
    while i < n:
        step = ranks[i + 1] - ranks[i] if i + 1 < n else 0
        if step < 1:  # the last rank, or the list goes down (or repeats) here
            runs.append((ranks[i], 1, 1))
            i += 1
            continue
        j = i + 1
        while j + 1 < n and ranks[j + 1] - ranks[j] == step:
            j += 1
        runs.append((ranks[i], step, j - i + 1))
        i = j + 1
    return runs


def encode(ranks: Sequence[int]) -> List[List[int]]:
    """The blocks of `ranks` (any ints, any order, repeats allowed), as JSON-ready lists."""
    blocks: List[List[int]] = []
    for start, step, count in _runs(list(ranks)):
        if blocks:
            b = blocks[-1]
            if b[1] == step and b[2] == count:
                # this run repeats the previous block's run at a fixed distance: one more period
                last = b[0] + (b[4] - 1) * b[3]
                gap = start - b[0] if b[4] == 1 else start - last
                # a new period at the same distance, past the end of the previous one
                if (b[4] == 1 or gap == b[3]) and gap > (count - 1) * step:
                    b[3] = gap
                    b[4] += 1
                    continue
        blocks.append([start, step, count, 0, 1])
    return blocks


def describe(ranks: Sequence[int], limit: int = 8) -> str:
    """A rank list for messages and logs, bounded: a reason travels in every rank's exit order,
    so a list of 50,000 savers in it would be an O(N) string N times over."""
    ranks = list(ranks)
    if len(ranks) <= limit:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:limit]))}, ... ({len(ranks)} ranks)]"


def valid_wire(value: Any, limit: int = MAX_RANKS) -> bool:
    """The shape and bounds of an encoded list, checked before anything is expanded: at most
    `limit` ranks, each in 0..limit-1 (so the expanded list needs no check of its own)."""
    if not isinstance(value, list):
        return False
    total = 0
    for b in value:
        if not (isinstance(b, list) and len(b) == 5 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in b)):
            return False
        start, step, count, ostep, ocount = b
        if count < 1 or ocount < 1 or step < 1 or ostep < 0:
            return False  # empty, or inverted
        if ocount > 1 and ostep <= (count - 1) * step:
            return False  # a period overlapping (or going back before) the one before it
        total += count * ocount
        if total > limit:
            return False
        last_inner, last_outer = (count - 1) * step, (ocount - 1) * ostep
        corners = (start, start + last_inner, start + last_outer, start + last_inner + last_outer)
        if min(corners) < 0 or max(corners) >= limit:
            return False
    return True


def decode(blocks: List[List[int]], limit: int = MAX_RANKS, unique: bool = False) -> List[int]:
    """The list `blocks` stands for; ValueError when it is not a valid encoding (or, with
    `unique`, when it names a rank twice: overlapping blocks, or one block twice).

    A registration storm decodes the same few lists (the job's DP groups) once per rank: the
    last `_CACHED` expansions are kept, so each is built once and copied (in C) after."""
    key = None
    if isinstance(blocks, list) and len(blocks) <= 8 and all(
            isinstance(b, list) and all(type(x) is int for x in b) for b in blocks):
        key = tuple(tuple(b) for b in blocks)  # exact ints only: a bool is refused below
    if key is not None:
        hit = _expanded.get((key, limit))
        if hit is not None:
            if unique and hit[1]:
                raise ValueError(f"a rank named twice in {str(blocks)[:80]}")
            return list(hit[0])
    if not valid_wire(blocks, limit):
        raise ValueError(f"not a rank list encoding (or more than {limit} ranks, or a rank "
                         f"outside 0..{limit - 1}): {str(blocks)[:80]}")
    out: List[int] = []
    for start, step, count, ostep, ocount in blocks:
        for i in range(ocount):
            base = start + i * ostep
            out.extend(range(base, base + count * step, step) if step else [base] * count)
    dup = (unique or key is not None) and len(set(out)) != len(out)
    if key is not None:
        if len(_expanded) >= _CACHED:
            _expanded.pop(next(iter(_expanded)))
        _expanded[(key, limit)] = (tuple(out), dup)
    if unique and dup:
        raise ValueError(f"a rank named twice in {str(blocks)[:80]}")
    return out


_CACHED = 256
_expanded: Dict[Tuple[Any, int], Tuple[Tuple[int, ...], bool]] = {}  # list, named a rank twice


def contains(blocks: Sequence[Sequence[int]], rank: int) -> bool:
    """Whether `rank` is in the list `blocks` stands for, without expanding it: O(blocks) for
    the blocks jobs use (one period each), O(periods) at worst. `blocks` must be valid."""
    for start, step, count, ostep, ocount in blocks:
        if ocount == 1 or ostep == 0:
            periods: Any = [start]
        elif count * abs(step) <= abs(ostep) and step >= 0 and ostep > 0:
            i = (rank - start) // ostep  # periods do not overlap: only one can hold it
            periods = [start + i * ostep] if 0 <= i < ocount else []
        else:
            periods = (start + i * ostep for i in range(ocount))
        for base in periods:
            d = rank - base
            if step == 0:
                if d == 0:
                    return True
            elif d % step == 0 and 0 <= d // step < count:
                return True
    return False


def all_but(world: int, excluded: Sequence[int] = ()) -> List[List[int]]:
    """The blocks of every rank of the world but `excluded` (a broadcast's destinations)."""
    out: List[List[int]] = []
    start = 0
    for r in sorted(set(excluded)) + [world]:
        if r > start:
            out.append([start, 1, r - start, 0, 1])
        start = r + 1
    return out
