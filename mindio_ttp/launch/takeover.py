"""A spare node takes over a lost node's ranks while the surviving nodes keep their workers.

torch elastic meets every change of membership the same way: each agent stops its workers and
a new rendezvous round starts them all again, a restart. For a job that recovers in memory that
throws away exactly what the recovery keeps (the survivors' processes, their state, their
device context), so here a change of membership is a *takeover*:

* A spare node is one more ``ttprun`` with the job's own arguments (c10d rendezvous). The round
  is full, so torch puts it on its redundancy list, where it waits without a deadline (its warm
  spares, ``--warm-spares``, import meanwhile).
* A lost node stops refreshing its keep-alive in the rendezvous. Once that is older than
  ``keep_alive_interval`` x ``keep_alive_max_attempt`` (``--rdzv-conf``; torch's defaults are
  5 s x 3) the next agent that syncs drops it, and the spare moves to the wait list.
* The recovery asks for the lost ranks' replacements: the controller's relay, a survivor on
  another node, hands the requests to its launcher (``launch/replace.py``), which finds they
  name ranks it does not run and keeps them for a takeover, signalling it with a signed key on
  the current round's store. Nothing else starts a takeover: torch's view of membership can
  be wrong (a keep-alive starved on a loaded node), the recovery's cannot.
* A surviving agent whose workers are healthy sees a node waiting and the signed key: instead
  of restarting its workers, it joins the next round with them running. Without the key it
  does neither, and the waiting node stays a spare.
* Right after the round completes, every agent in it publishes a member record on the round's
  store (whether its workers run, and if so its group rank, their global ranks, the world size,
  MASTER_ADDR/PORT, the restart count and the replacement requests it holds) and reads
  everyone's. All compute the same plan: survivors keep their group ranks; the group ranks
  nobody holds go to the newcomers in the order of their rank in the round; every rank a
  newcomer takes must have a request.
* A newcomer takes its group rank's place: the lost node's global ranks, the job's world size,
  the survivors' MASTER_ADDR/PORT and restart count, and each rank's request (what the
  recovery tells its replacement: ``TTP_RECOVERY_JOIN``, the recovery's store); it starts them
  as replacement workers (from warm spares when it has some), which join the recovery. The
  relay's launcher reports them started.
* Survivors move to the new round's store (for their exit barrier) and go back to watching.

torch's store has no authentication, and this plan decides which node runs which ranks and
where their replacements look for the controller. So each record is HMAC-signed with the job's
control-plane key over the round's fresh nonces (one per agent, written first; each agent
checks that its own is still there): a forged record or one replayed from an earlier round is
refused, and that round's takeover does not happen (the recovery then falls back to the dying
checkpoint). The key that starts a takeover is signed too, over the same round's nonces, and
names the lost ranks and the recovery that asks for them: a "takeover wanted" copied from an
earlier round (after one real takeover an outsider who could read the store copied it into
every later round, and every spare that arrived was spent on a takeover `plan` then refused,
issue 24) is refused, and so is one naming ranks that a node of the round still runs, or a
recovery already taken over. An outsider who can reach the store can still disturb a
rendezvous, as they always could: that denies service, it decides nothing.

Only a job whose nodes all run the same number of workers can be taken over (torch gives group
rank *g* the global ranks ``g*L .. g*L+L-1`` then); anything else is refused with the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from mindio_ttp.config import ENV_RECOVERY, RECOVERY_MODES
from mindio_ttp.launch.replace import AdoptedHandler, ReplacementRequest

logger = logging.getLogger("ttprun")

NONCE_KEY = "ttprun/takeover/nonce/{}"
WANTED_KEY = "ttprun/takeover/wanted"
MEMBER_KEY = "ttprun/takeover/member/{}"
MAC_CONTEXT = b"ttprun-takeover-v1"
MAX_RECORD = 64 * 1024 + 64  # a record names one node's ranks: a few KiB even at 1k workers
EXCHANGE_TIMEOUT = timedelta(seconds=60)


class TakeoverRefused(RuntimeError):
    """The members of a round disagree or cannot be verified: no takeover in this round."""


@dataclass(frozen=True)
class Member:
    """What one agent says about itself right after a round completed."""

    running: bool
    local_world_size: int
    group_rank: int = -1
    group_world_size: int = 0
    world_size: int = 0
    ranks: Sequence[int] = ()
    master_addr: str = ""
    master_port: int = 0
    restart_count: int = 0
    # replacement requests this agent holds for ranks of a lost node: {rank: env to add}
    requests: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Member:
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) != set(cls.__dataclass_fields__):
            raise ValueError("member record has the wrong fields")
        ints = ("local_world_size", "group_rank", "group_world_size", "world_size",
                "master_port", "restart_count")
        if not isinstance(raw["running"], bool) or not all(
                type(raw[k]) is int for k in ints):
            raise ValueError("member record has a field of the wrong type")
        if not (isinstance(raw["ranks"], list) and all(type(r) is int for r in raw["ranks"])
                and isinstance(raw["master_addr"], str)):
            raise ValueError("member record has a field of the wrong type")
        if raw["local_world_size"] < 1 or not 0 <= raw["master_port"] < 65536:
            raise ValueError("member record has an out-of-range field")
        requests = raw["requests"]
        if not (isinstance(requests, dict) and all(
                isinstance(k, str) and k.isdigit() and isinstance(v, dict)
                and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items())
                for k, v in requests.items())):
            raise ValueError("member record has malformed replacement requests")
        return cls(**{**raw, "ranks": tuple(raw["ranks"])})


@dataclass(frozen=True)
class Assignment:
    """The lost node's place, for the newcomer that takes it."""

    group_rank: int
    group_world_size: int
    world_size: int
    ranks: Sequence[int]
    master_addr: str
    master_port: int
    restart_count: int
    env: Mapping[int, Mapping[str, str]]  # each rank's request: what its replacement is told


def _mac(key: bytes, run_id: str, rank: int, nonces: Sequence[str], payload: str) -> str:
    message = b"|".join([MAC_CONTEXT, run_id.encode(), str(rank).encode(),
                         ",".join(nonces).encode(), payload.encode()])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def exchange(store, rank: int, world_size: int, run_id: str, key: bytes, me: Member,
             timeout: timedelta = EXCHANGE_TIMEOUT) -> Dict[int, Member]:
    """Publish ``me`` on the round's store and read every member's record, each verified."""
    return exchange_round(store, rank, world_size, run_id, key, me, timeout)[0]


def exchange_round(store, rank: int, world_size: int, run_id: str, key: bytes, me: Member,
                   timeout: timedelta = EXCHANGE_TIMEOUT) -> Tuple[Dict[int, Member], str]:
    """`exchange`, and the round's tag: a digest of its nonces, the same for every agent of
    the round and for no other round (what a "takeover wanted" is signed over)."""
    mine = secrets.token_hex(16)
    store.set(NONCE_KEY.format(rank), mine)
    nonce_keys = [NONCE_KEY.format(r) for r in range(world_size)]
    store.wait(nonce_keys, timeout)
    nonces = [store.get(k).decode("ascii", "replace") for k in nonce_keys]
    if nonces[rank] != mine:  # a set of nonces copied from an earlier round would verify
        raise TakeoverRefused(f"the nonce of rank {rank} in the round was overwritten: someone "
                              "else writes the round's keys")
    payload = me.to_json()
    store.set(MEMBER_KEY.format(rank), f"{payload}\n{_mac(key, run_id, rank, nonces, payload)}")
    member_keys = [MEMBER_KEY.format(r) for r in range(world_size)]
    store.wait(member_keys, timeout)
    members: Dict[int, Member] = {}
    for r, k in enumerate(member_keys):
        raw = store.get(k)
        if len(raw) > MAX_RECORD:
            raise TakeoverRefused(f"the member record of rank {r} in the round is too large")
        payload, _, mac = raw.decode("utf-8", "replace").rpartition("\n")
        if not hmac.compare_digest(mac, _mac(key, run_id, r, nonces, payload)):
            raise TakeoverRefused(
                f"the member record of rank {r} in the round does not carry this job's "
                "signature (another key, another round, or not written by an agent)")
        try:
            members[r] = Member.from_json(payload)
        except ValueError as exc:
            raise TakeoverRefused(f"the member record of rank {r} is malformed: {exc}") from None
    return members, hashlib.sha256(",".join(nonces).encode()).hexdigest()


def plan(members: Dict[int, Member]) -> Dict[int, Assignment]:
    """``{rank in the round: Assignment}`` for the newcomers; empty in a round with no
    survivor (a fresh start or a restart: torch assigns ranks as usual)."""
    survivors = {r: m for r, m in members.items() if m.running}
    if not survivors:
        return {}
    newcomers = sorted(r for r, m in members.items() if not m.running)
    first = survivors[min(survivors)]
    shape = (first.group_world_size, first.world_size, first.master_addr, first.master_port,
             first.restart_count, first.local_world_size)
    for r, m in survivors.items():
        if (m.group_world_size, m.world_size, m.master_addr, m.master_port, m.restart_count,
                m.local_world_size) != shape:
            raise TakeoverRefused(f"surviving nodes disagree on the job: rank {r} says {m}, "
                                  f"rank {min(survivors)} says {first}")
    width = first.local_world_size
    if any(m.local_world_size != width for m in members.values()):
        raise TakeoverRefused(
            "a takeover needs every node to run the same number of workers (--nproc-per-node); "
            + ", ".join(f"rank {r}: {m.local_world_size}" for r, m in sorted(members.items())))
    if first.world_size != first.group_world_size * width:
        raise TakeoverRefused(f"world size {first.world_size} is not {first.group_world_size} "
                              f"nodes x {width} workers")
    held = {}
    for r, m in survivors.items():
        if m.group_rank in held or not 0 <= m.group_rank < first.group_world_size:
            raise TakeoverRefused(f"group rank {m.group_rank} of rank {r} is out of range or "
                                  "held twice")
        if list(m.ranks) != list(range(m.group_rank * width, (m.group_rank + 1) * width)):
            raise TakeoverRefused(f"node of group rank {m.group_rank} runs ranks "
                                  f"{list(m.ranks)}, not a block of {width}")
        held[m.group_rank] = r
    missing = [g for g in range(first.group_world_size) if g not in held]
    if len(missing) != len(newcomers):
        raise TakeoverRefused(f"{len(missing)} lost node(s) (group ranks {missing}) but "
                              f"{len(newcomers)} newcomer(s) in the round")
    requests: Dict[int, Mapping[str, str]] = {}
    for m in survivors.values():
        requests.update({int(rank): env for rank, env in m.requests.items()})
    lost = [rank for g in missing for rank in range(g * width, (g + 1) * width)]
    unasked = [rank for rank in lost if rank not in requests]
    if unasked:
        raise TakeoverRefused(f"no replacement request for rank(s) {unasked}: the recovery did "
                              "not ask for them")
    plans = {}
    for r, g in zip(newcomers, missing):
        ranks = tuple(range(g * width, (g + 1) * width))
        plans[r] = Assignment(g, first.group_world_size, first.world_size, ranks,
                              first.master_addr, first.master_port, first.restart_count,
                              {rank: dict(requests[rank]) for rank in ranks})
    return plans


def member_of(worker_group, restart_count: int,
              requests: Mapping[int, Mapping[str, str]]) -> Member:
    """This agent's record: running (with its place in the job) only while its workers are
    healthy, i.e. when it joins a round to hand a lost node's ranks over."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    spec = worker_group.spec
    if worker_group.state != WorkerState.HEALTHY or not worker_group.workers:
        return Member(False, spec.local_world_size, restart_count=restart_count)
    return Member(True, spec.local_world_size, worker_group.group_rank,
                  worker_group.group_world_size, worker_group.workers[0].world_size,
                  tuple(w.global_rank for w in worker_group.workers),
                  str(worker_group.master_addr), int(worker_group.master_port), restart_count,
                  {str(rank): dict(env) for rank, env in requests.items()})


def _wanted_mac(key: bytes, run_id: str, round_tag: str, payload: str) -> str:
    return hmac.new(key, b"|".join([MAC_CONTEXT, b"wanted", run_id.encode(), round_tag.encode(),
                                    payload.encode()]), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Wanted:
    """What a "takeover wanted" says: the lost ranks, and the recovery (its attempt, the
    restart count, and its id: ids restart at 1 with each attempt) that asks for them."""

    attempt: int
    recovery: int
    ranks: Tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"attempt": self.attempt, "recovery": self.recovery,
                           "ranks": list(self.ranks)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Wanted:
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) != {"attempt", "recovery", "ranks"}:
            raise ValueError("a takeover-wanted record has the wrong fields")
        ranks = raw["ranks"]
        if not (type(raw["attempt"]) is int and type(raw["recovery"]) is int
                and isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks)):
            raise ValueError("a takeover-wanted record has a field of the wrong type")
        return cls(raw["attempt"], raw["recovery"], tuple(ranks))


def participants(handler) -> Optional[set]:
    """The round ranks still in the rendezvous (as of the handler's last sync: a lost node's
    keep-alive expired drops it); None when the handler does not say (torch internals)."""
    try:
        return set(handler._state_holder.state.participants.values())
    except AttributeError:
        return None


def is_spare(handler) -> bool:
    """This agent waits beside a complete round (torch's redundancy list when the round is
    full, its wait list when a member was dropped): a spare node. torch has no public call for
    it; False when the handler does not say."""
    try:
        state = handler._state_holder.state
        node = handler._this_node
        waiting = state.wait_list
    except AttributeError:
        return False
    # torch 2.1 has no redundancy list: a node that finds the round full is on no list there
    return state.complete and (node in getattr(state, "redundancy_list", ()) or node in waiting)


def spares_known(handler) -> Optional[bool]:
    """Whether any node waits beside the complete round (as of the handler's last sync);
    None when the handler does not say (torch internals)."""
    try:
        state = handler._state_holder.state
        return bool(state.redundancy_list or state.wait_list)
    except AttributeError:
        return None


def available() -> bool:
    """Whether the installed torch has what a takeover needs (launch/torch_private.py); when it
    has not, say so once: a lost node's ranks then go to the dying checkpoint."""
    from mindio_ttp.launch.torch_private import takeover_missing

    missing = takeover_missing()
    if missing:
        logger.warning("ttprun: no node takeover on this torch (it lacks %s): a spare node "
                       "cannot take a lost node's ranks; the recovery of such a loss falls "
                       "back to the dying checkpoint", "; ".join(missing))
    return not missing


def wanted(handler, env: Mapping[str, str]) -> bool:
    """Take over lost nodes (instead of restarting every node) when the rendezvous can admit a
    spare node (c10d and the other dynamic backends; not static) and the job recovers in
    memory (``TTP_RECOVERY``, in-memory by default; a job that restarts anyway gains nothing
    from it)."""
    mode = env.get(ENV_RECOVERY, "").strip().lower() or RECOVERY_MODES[0]
    return handler.get_backend() != "static" and mode == RECOVERY_MODES[0]


class NodeTakeover:
    """The rendezvous side of a takeover for one agent (see the module doc).

    It wraps the rendezvous handler's ``next_rendezvous``: after every round it exchanges
    member records (``me`` says what this agent runs) and keeps this agent's
    :class:`Assignment` when it is a newcomer that takes a lost node's place."""

    def __init__(self, handler, me: Callable[[Mapping[int, Mapping[str, str]]], Member],
                 key: bytes) -> None:
        self.handler = handler
        self._me = me
        self._key = key
        self.assignment: Optional[Assignment] = None
        # the highest restart count in the last round: a node new to a job that restarted
        # (started after a loss) must start its workers at the same attempt as the others, or
        # torch's env:// store prefix (/worker/attempt_N) differs and gloo reads stale keys
        self.restart_count = 0
        # requests this agent holds for ranks it does not run (a lost node's), by rank
        self.pending: Dict[int, ReplacementRequest] = {}
        self._fresh: List[ReplacementRequest] = []  # held, not yet announced on the store
        self.handed_over: Dict[int, Tuple[ReplacementRequest, int]] = {}  # -> group rank
        # the last round as this agent saw it: its tag (what "takeover wanted" is signed over),
        # the global ranks each of its members runs (by rank in the round), and ours
        self._round_tag: Optional[str] = None
        self._round_ranks: Dict[int, Tuple[int, ...]] = {}
        self._my_ranks: Tuple[int, ...] = ()
        self._served: set = set()  # (attempt, recovery) already taken over
        self._next = handler.next_rendezvous
        handler.next_rendezvous = self._next_rendezvous

    # -- the survivor's side ------------------------------------------------------------------
    def hold(self, request: ReplacementRequest) -> bool:
        """The replacement desk's ``foreign``: keep a request for a rank of another node."""
        self.pending[request.rank] = request
        self._fresh.append(request)
        return True

    def announce(self, store) -> List[ReplacementRequest]:
        """Say on the round's store (signed) that a takeover is wanted, so every survivor
        joins the next round, once per batch of new requests. Returns the new requests that no
        spare node can take (none waits beside the round): the recovery should not wait."""
        fresh, self._fresh = self._fresh, []
        if not fresh:
            return []
        if spares_known(self.handler) is False:
            for request in fresh:
                self.pending.pop(request.rank, None)
            logger.error("ttprun: the recovery asks for rank(s) %s of a lost node, and no spare "
                         "node waits in the rendezvous", sorted(r.rank for r in fresh))
            return fresh
        if self._round_tag is None:  # this round's records were refused: nobody could verify it
            for request in fresh:
                self.pending.pop(request.rank, None)
            logger.error("ttprun: the recovery asks for rank(s) %s of a lost node, and this "
                         "rendezvous round's member records were refused: no takeover in it",
                         sorted(r.rank for r in fresh))
            return fresh
        want = Wanted(self.restart_count, max(r.recovery_id for r in self.pending.values()),
                      tuple(sorted(self.pending)))
        payload = want.to_json()
        store.set(WANTED_KEY, f"{payload}\n"
                              f"{_wanted_mac(self._key, self._run_id, self._round_tag, payload)}")
        logger.warning("ttprun: the recovery asks for rank(s) %s of a lost node: a spare node "
                       "takes them over once the rendezvous has dropped the lost one",
                       sorted(r.rank for r in fresh))
        return []

    def should_join(self, store) -> bool:
        """A node waits and a takeover is wanted: by this agent, or by another of this round,
        signed on the store over this round's tag, for ranks that no node of the round still
        runs (torch's participants, when the handler says) and this node does not, by a
        recovery not taken over already."""
        if self.pending:
            return True
        if self._round_tag is None:
            return False
        try:
            if not store.check([WANTED_KEY]):
                return False
            payload, _, mac = store.get(WANTED_KEY)[:MAX_RECORD].decode(
                "utf-8", "replace").rpartition("\n")
        except Exception:  # noqa: BLE001 - a store that fails says no
            return False
        if not hmac.compare_digest(mac, _wanted_mac(self._key, self._run_id, self._round_tag,
                                                    payload)):
            self._refuse("it is not signed for this round (written in another, or without the "
                         "job's key)")
            return False
        try:
            want = Wanted.from_json(payload)
        except ValueError as exc:
            self._refuse(str(exc))
            return False
        if (want.attempt, want.recovery) in self._served:
            self._refuse(f"recovery {want.recovery} was taken over already")
            return False
        live = participants(self.handler)
        running = set(self._my_ranks)
        for rank in live if live is not None else ():
            running.update(self._round_ranks.get(rank, ()))
        if running.intersection(want.ranks):
            self._refuse(f"it names rank(s) {sorted(running.intersection(want.ranks))[:8]}, "
                         "which a node of this round still runs")
            return False
        return True

    def _refuse(self, why: str) -> None:
        logger.warning("ttprun: ignoring the takeover-wanted key on the rendezvous store: %s",
                       why)

    @property
    def _run_id(self) -> str:
        return self.handler.get_run_id()

    def _learn_round(self, members: Dict[int, Member], tag: str, me: Member) -> None:
        """What should_join checks a takeover-wanted key against: the round's tag, and which
        global ranks each member runs (a survivor says so; a node that runs nothing yet gets
        torch's block for its rank in the round, or the lost node's it takes over)."""
        self._round_tag = tag
        self._my_ranks = tuple(me.ranks) if me.running else ()
        self._round_ranks = {}
        for r, m in members.items():
            width = m.local_world_size
            self._round_ranks[r] = (tuple(m.ranks) if m.running
                                    else tuple(range(r * width, (r + 1) * width)))

    def join_with_running_workers(self):
        """The survivor's side: a new round with this node's workers left running."""
        return self.handler.next_rendezvous()

    def handed_over_requests(self) -> List[Tuple[ReplacementRequest, str]]:
        """The requests a newcomer took since the last call, with the answer for the relay."""
        done = [(request, f"started by the node that took over group rank {group_rank}")
                for request, group_rank in self.handed_over.values()]
        self.handed_over.clear()
        return done

    # -- every round ----------------------------------------------------------------------------
    def _next_rendezvous(self):
        info = self._next()
        me = self._me({rank: request.env for rank, request in self.pending.items()})
        self.assignment = None
        self._round_tag = None
        try:
            members, tag = exchange_round(info.store, info.rank, info.world_size,
                                          self.handler.get_run_id(), self._key, me)
            self.restart_count = max(m.restart_count for m in members.values())
            self._learn_round(members, tag, me)
            plans = plan(members)
        except TakeoverRefused as exc:
            logger.error("ttprun: no takeover in this rendezvous round: %s", exc)
            if not me.running:
                raise
            return info
        self.assignment = plans.get(info.rank)
        for r, a in plans.items():
            self._round_ranks[r] = tuple(a.ranks)
            self._served.update((a.restart_count, _recovery_of(env)) for env in a.env.values())
        if self.assignment is not None:
            a = self.assignment
            logger.warning("ttprun: this node takes over group rank %d of a lost node: ranks "
                           "%s of %d; the other nodes keep their workers", a.group_rank,
                           list(a.ranks), a.world_size)
        elif me.running:
            for plan_ in plans.values():
                for rank in plan_.ranks:
                    if rank in self.pending:
                        self.handed_over[rank] = (self.pending.pop(rank), plan_.group_rank)
            logger.warning("ttprun: node(s) joined for lost group rank(s) %s; this node keeps "
                           "its workers (group rank %d)",
                           sorted(p.group_rank for p in plans.values()), me.group_rank)
        return info


def _recovery_of(env: Mapping[str, str]) -> int:
    """The recovery id a replacement request's environment names (0 when it names none)."""
    from mindio_ttp.config import ENV_RECOVERY_JOIN

    try:
        return int(json.loads(env.get(ENV_RECOVERY_JOIN, "{}")).get("recovery_id", 0))
    except (ValueError, TypeError, AttributeError):
        return 0


def republish_bootstrap(handler) -> None:
    """torch's rank 0 of a round publishes its workers' store address in the round, and every
    agent without one waits for it inside next_rendezvous; but a rank 0 that already had one
    from an earlier round (a survivor, or a node restarting its workers) skips that, so a node
    new to the job (a spare, or one a scheduler started after a loss) would wait forever.
    Wrap the handler's next_rendezvous so such a rank 0 publishes it again."""
    try:
        from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
    except ImportError:  # torch 2.1: every round's rank 0 publishes MASTER_ADDR/PORT anew
        return

    next_rendezvous = handler.next_rendezvous

    def wrapped():
        info = next_rendezvous()
        bootstrap = getattr(info, "bootstrap_store_info", None)
        if info.rank == 0 and bootstrap is not None:
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, bootstrap.master_addr.encode())
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY,
                           str(bootstrap.master_port).encode())
        return info

    handler.next_rendezvous = wrapped


@contextlib.contextmanager
def replacement_workers(assignment: Assignment, pool) -> Iterator[None]:
    """While torch starts the newcomer's workers: each gets its rank's request added to its
    environment, and a warm spare when ``pool`` has one left."""
    from torch.distributed.elastic.multiprocessing import api

    original = getattr(api, "get_subprocess_handler", None)
    if original is None:
        raise TakeoverRefused("this torch has no get_subprocess_handler: a takeover cannot "
                              "give each replacement its own request")

    def start(entrypoint, args, env, stdout, stderr, local_rank_id, *more, **kwargs):
        env = {**env, **assignment.env[assignment.ranks[local_rank_id]]}
        full = {**os.environ, **env}
        proc = pool.start(local_rank_id, full, [entrypoint, *args], stdout, stderr)
        if proc is None:
            return original(entrypoint, args, env, stdout, stderr, local_rank_id, *more,
                            **kwargs)
        return AdoptedHandler(proc, local_rank_id)

    api.get_subprocess_handler = start
    try:
        yield
    finally:
        api.get_subprocess_handler = original


def workers_for(assignment: Assignment) -> List:
    """torch's Worker objects for the assigned ranks (one role, every node alike)."""
    from torch.distributed.elastic.agent.server.api import Worker

    workers = []
    for local_rank, global_rank in enumerate(assignment.ranks):
        workers.append(Worker(local_rank=local_rank, global_rank=global_rank,
                              role_rank=global_rank, world_size=assignment.world_size,
                              role_world_size=assignment.world_size))
    return workers
