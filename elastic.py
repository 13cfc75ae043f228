"""How a run survives a role's death: membership and the ledger of samples, reached from the roles'
loops through a few named calls. Nothing here is the paper's algorithm; it keeps the algorithm's
promises while roles die and come back:

  every trained token has 0 <= lag <= actor.max_lag; every group is trained whole and once, or
  given back; nothing is lost without being given back; one death stalls no one for longer than
  it takes to notice it (run.heartbeat_timeout_s) and to start the role again.

The run's TCPStore (weights_sync.serve_store) holds the ledger. One writer per key (a counter may
have several adders, a list of ids several appenders); docs/DESIGN.md, "The fault layer", gives
the invariants and the order of the writes that keeps each.

  key                          value                                   written by
  actor/incarnations           counter: actor starts and returns       actors (`register`)
  alive/<inc>                  a heartbeat, rewritten every log_every  actor <inc> (`beat`)
  groups/next                  "cut next by": the next new group id    actors (`take_group_id`);
                                                                       trainer, a cut (`fence`)
  redo/<cut>                   "id,id,...": ids to generate again      trainer rank 0 (`Ledger`)
                               first (below the cut's fence never
                               trained nor dropped; a lost
                               incarnation's never trained)
  redo/<cut>/count             counter: ids in redo/<cut>              trainer rank 0 (`Ledger`)
  redo/<cut>/taken             "n by id": ids of redo/<cut> taken,     actors (`take_group_id`)
                               the last by `by`, id `id`
  ids/<cut>/<inc>              "id,id,...": the ids it took (an id     actor <inc>, and the next
                               may come twice)                         taker (`take_group_id`)
  budget/<cut>/started         "total inc:n inc:n ...": samples         actors (`reserve`); the
                               started in the cut, and each            trainer creates it ("0")
                               incarnation's share of them
  budget/<cut>                 "t consumed returned" (below)           trainer rank 0 (`Ledger`)
  dropped/<inc>/<cut>          counter: samples given back on the way  verifier (`drop`), trainer
                                                                       rank 0 (lost on the way)
  groups/dropped               "id,id,...": groups dropped for good    verifier, trainer rank 0
                                                                       (`drop`)
  forwarded/<cut>/<inc>/<id>   the verifier has forwarded or dropped   verifier (`forwarded`)
                               inc's group: it may leave u_min
  oldest/<inc>                 "cut version": the oldest start         actor <inc>; the trainer
                               version it has in flight                for a new one (`Membership`)
  group/count, group/<g>       the weight groups formed: members,      trainer rank 0 (`Membership`)
                               cut, epoch, version, incarnations lost
  trainer/epoch                counter: trainer starts                 trainer rank 0 (`new_epoch`)
  verifier/incarnations        counter                                 the verifier

The budget of a cut is published by one writer, trainer rank 0, as three numbers: its version t,
the samples of the cut it has trained (consumed), and the samples given back (returned): every
member's drops, plus, for an incarnation no longer a member, everything it started that was not
trained. From then on no sample of that incarnation is trained (the trainer filters each batch by
the membership it published with, or a newer one), so nothing is given back twice.
"""
import asyncio
import json
import os
import sys
import threading
import time

import torch.distributed as dist

import weights_sync as ws

# a role's exit status when the run's store went away: run.sh then stops the node's roles
STORE_LOST = 3


def store_lost(role: str, error) -> int:
    """One line naming the store, for a role that lost it -> the exit status run.sh reads."""
    print(f"[{role}] lost the run's store (sync.host:sync.port: weights_sync.py, which run.sh "
          f"starts on node 0): {error}", file=sys.stderr, flush=True)
    return STORE_LOST


def check_store(store):
    """Raise DistNetworkError if the run's store went away (a role that touches it rarely)."""
    store.check(["verifier/incarnations"])


async def unless_store_lost(store, awaitable):
    """Await `awaitable`, checking every second that the run's store is there: a connect to a store
    that went away waits out its whole timeout (sync.timeout_s), and so would this role."""
    task = asyncio.ensure_future(awaitable)
    while not (await asyncio.wait({task}, timeout=1.0))[0]:
        try:
            check_store(store)
        except Exception:
            task.cancel()
            raise
    return task.result()

# --- actor side -----------------------------------------------------------------------------------

class PeerTimeout(RuntimeError):
    """No weight group took this actor in for run.peer_timeout_s: the trainer did not show up."""


def register(actor):
    """A new incarnation of this actor in the store (actor/incarnations): the trainer takes it into
    the next weight group once it beats (alive/<inc>, `beat`)."""
    st = actor.st
    st.inc = int(actor.store.add("actor/incarnations", 1))
    st.weight_group = actor.joining_weight_group = None
    actor.was_member, actor.waiting_since = False, time.time()
    actor.gap, actor.gap_checked = None, 0.0  # (watchdog)
    beat(actor)
    print(f"[actor] process {actor.proc}: incarnation {st.inc}, waiting for a weight group",
          flush=True)


def beat(actor):
    """The heartbeat: the trainer counts an incarnation lost when it stops changing for
    run.heartbeat_timeout_s (the actor's log rewrites it every run.log_every)."""
    text = f"{time.time():.1f} process {actor.proc} on {os.uname().nodename}"
    actor.store.set(f"alive/{actor.st.inc}", text)


def watchdog(actor):
    """Raise PeerTimeout when no weight group has taken this incarnation in (or sent it weights)
    for run.peer_timeout_s. Once a second: an announcement number counted while a later one is,
    and still without its key a second later, had its trainer die between counting and setting
    it (weights_sync.announce): filled with "skip", or the announcements would wait for ever."""
    cfg, now = actor.cfg, time.time()
    if now - actor.gap_checked >= 1.0:
        actor.gap_checked = now
        key = f"announce/{actor.announcements.next}"
        counted = int(actor.store.add("announced", 0)) > actor.announcements.next
        missing = counted and not actor.store.check([key])
        if missing and actor.gap == key:
            actor.store.compare_set(key, "", "skip")
        actor.gap = key if missing else None
    if actor.st.weight_group is not None:
        actor.waiting_since = time.time()
    elif time.time() - actor.waiting_since > cfg.run.peer_timeout_s:
        raise PeerTimeout(f"no weight group took incarnation {actor.st.inc} in (or sent it "
                          f"weights) for {cfg.run.peer_timeout_s:.0f} s (run.peer_timeout_s): is "
                          f"trainer.py running? (the store: {cfg.sync.host}:{cfg.sync.port})")


async def regroup(actor, g: int):
    """Weight group g was formed (Membership.form): join it if a member, else, if it was in one or
    was counted lost (silent too long, or slow to meet), come back as a new incarnation. At a cut,
    or with a new trainer, everything in flight is given up and the budget starts afresh; this
    incarnation generates again once the group's first weights are in."""
    cfg, st = actor.cfg, actor.st
    info = json.loads(actor.store.get(f"group/{g}"))
    members = {int(inc): first for inc, first in info["members"].items()}
    if st.inc not in members:
        # (its receive may have failed since, leaving it paused)
        if actor.was_member or st.inc in info["lost"]:
            await actor.drop_all()
            register(actor)
        return
    if info["cut"] != st.cut or info["epoch"] != st.epoch:
        await actor.drop_all()
        st.cut, st.cut_version, st.epoch = info["cut"], info["version"], info["epoch"]
        st.redo, st.redo_taken, st.budget_ready = None, 0, False
    st.share = cfg.trainer.batch_size // len(members)
    st.others = sorted(set(members) - {st.inc})
    st.weight_group = actor.joining_weight_group = actor.published = None
    world = 1 + len(members) * cfg.actor.engines * cfg.actor.tp
    try:
        await actor.join(g, members[st.inc], world)
    except Exception as e:  # noqa: BLE001 - another member did not meet: the next group comes
        print(f"[actor] weight group {g}: not formed ({e}); waiting for the next", flush=True)
        return
    actor.joining_weight_group, actor.was_member = g, True


def started(value: bytes) -> tuple:
    """budget/<cut>/started -> (samples started in the cut, {incarnation: its share})."""
    total, *shares = value.decode().split()
    return int(total), {int(i): int(n) for i, n in (s.split(":") for s in shares)}


def reserve(store, st, group_size: int, admit) -> bool:
    """Count one more group of this incarnation in the run's budget if `admit(st)` allows it with
    every admission before it counted, any actor's: one compare-and-set of the run's count and
    this incarnation's share together (budget/<cut>/started), so that a death can neither lose
    budget nor give back (the trainer, for a lost incarnation: its share) what was not counted."""
    key = f"budget/{st.cut}/started"
    now = store.get(key)
    while True:
        total, shares = started(now)
        st.started = total
        if not admit(st):
            return False
        shares[st.inc] = shares.get(st.inc, 0) + group_size
        mine = " ".join([str(total + group_size), *(f"{i}:{n}" for i, n in sorted(shares.items()))])
        now = store.compare_set(key, now, mine)
        if now.decode() == mine:
            st.started = total + group_size
            return True


def read_budget(store, st) -> bool:
    """The run's budget as its writers last published it: samples started (all actors); the
    trainer's version, samples consumed and returned (budget/<cut>); the oldest version any other
    member has in flight (oldest/<inc>; one of an earlier cut counts as this cut's first). False
    while the trainer has yet to publish this cut's budget and list of ids to do again: nothing
    may start before."""
    if not store.check([f"budget/{st.cut}", f"redo/{st.cut}"]):
        return False
    budget, now, *oldest = store.multi_get([f"budget/{st.cut}", f"budget/{st.cut}/started",
                                            *(f"oldest/{i}" for i in st.others)])
    st.started = started(now)[0]
    t, consumed, returned = map(int, budget.split())
    st.trainer_version, st.consumed, st.returned = t, consumed, returned
    values = [v.decode().split() for v in oldest]
    st.others_oldest = min((int(v) if int(c) == st.cut else st.cut_version for c, v in values),
                           default=None)
    return True


def publish_oldest(store, st, oldest: int):
    """Tell the other members the oldest version this incarnation has in flight."""
    store.set(f"oldest/{st.inc}", f"{st.cut} {oldest}")


def take_group_id(store, st):
    """The next group id of this cut -> int, or None when the cut is over (a newer one fenced the
    counter: this incarnation's accounting is stale until it hears of the new group). First the
    trainer's ids to do again (redo/<cut>), each taken by one actor, then a new id from the run's
    counter: no id twice in a cut, none skipped. Recorded (ids/<cut>/<inc>): the trainer generates
    them again if this incarnation is lost. A take's value names its taker and id, and the next
    taker records that take before its own (`_record_previous`): a death between a take and its
    record loses nothing (the last take is in the value itself, `taken_by`)."""
    gid = _take_redo(store, st)
    while gid is None:
        # compare-and-set: the fence at a cut and every actor's take are one sequence of values
        now = store.get("groups/next").decode()
        cut, next_id, by = _take(now)
        if cut != st.cut:
            return None
        _record_previous(store, st, by, next_id - 1)
        mine = f"{cut} {next_id + 1} {st.inc}"
        if store.compare_set("groups/next", now, mine).decode() == mine:
            gid = next_id
    store.append(f"ids/{st.cut}/{st.inc}", f"{gid},")
    return gid


def _record_previous(store, st, by: str, gid: int):
    """The take before this one was incarnation `by`'s, of id gid: recorded for it (it may have
    died before its own record; the trainer reads each id once however often recorded)."""
    if by.isdigit() and int(by) != st.inc:
        store.append(f"ids/{st.cut}/{by}", f"{gid},")


def _take(value: str) -> tuple:
    """groups/next -> (cut, the next new id, who took the one before: an incarnation or "fence")."""
    cut, next_id, by = value.split()
    return int(cut), int(next_id), by


def taken_by(store, cut: int, inc: int) -> set:
    """Every id incarnation inc took in the cut: recorded, and its last take, which may not be."""
    ids = set(_ids(store.get(f"ids/{cut}/{inc}"))) if store.check([f"ids/{cut}/{inc}"]) else set()
    if store.check(["groups/next", f"redo/{cut}/taken"]):  # (both set at the cut)
        now_cut, next_id, by = _take(store.get("groups/next").decode())
        if now_cut == cut and by == str(inc):
            ids.add(next_id - 1)
        _, by, *last = store.get(f"redo/{cut}/taken").decode().split()
        if last and by == str(inc):
            ids.add(int(last[0]))
    return ids


def _take_redo(store, st):
    """The next id of redo/<cut> no actor has taken (compare-and-set on redo/<cut>/taken, "k by
    id": k taken, the last by incarnation `by`, id `id`; the list may grow), or None."""
    key = f"redo/{st.cut}/taken"
    while True:
        listed = int(store.add(f"redo/{st.cut}/count", 0))
        if listed <= st.redo_taken:  # (the count taken only grows: none left)
            return None
        now = store.get(key).decode()
        k, by, *last = now.split()
        k = st.redo_taken = int(k)
        if k >= listed:
            return None
        if last:
            _record_previous(store, st, by, int(last[0]))
        if k >= len(st.redo or []):
            st.redo = _ids(store.get(f"redo/{st.cut}"))
        mine = f"{k + 1} {st.inc} {st.redo[k]}"
        if store.compare_set(key, now, mine).decode() == mine:
            return st.redo[k]


def _ids(value: bytes) -> list:
    return [int(g) for g in value.decode().split(",") if g]


def forwarded_groups(store, st, ids: list) -> list:
    """Of these pushed groups, the ones the verifier has forwarded or dropped (a group holds u_min
    until then: the verifier may complete groups out of order, and the trainer consumes them in
    the order it forwards them)."""
    done = [g for g in ids if store.check([f"forwarded/{st.cut}/{st.inc}/{g}"])]
    for g in done:
        store.delete_key(f"forwarded/{st.cut}/{st.inc}/{g}")
    return done


# --- verifier side --------------------------------------------------------------------------------

def register_verifier(store) -> int:
    """This verifier's incarnation: the trainer cuts when it changes (the groups the previous one
    held are gone)."""
    return int(store.add("verifier/incarnations", 1))


def forwarded(store, inc: int, cut: int, group_id: int):
    """Incarnation inc's group is in the verifier's outbox (or dropped): inc may let it leave u_min.
    Per incarnation: a lost one's copy of a group says nothing of the copy generated again."""
    store.set(f"forwarded/{cut}/{inc}/{group_id}", "1")


def drop(store, inc: int, cut: int, group_id: int, size: int, forward: bool = True):
    """A training group that will never be trained: its samples go back to the budget of the
    incarnation that started them, its id is never generated again; `forward`: the verifier's
    drop also lets it leave u_min (the trainer's comes after the verifier forwarded it)."""
    store.add(f"dropped/{inc}/{cut}", size)
    store.append("groups/dropped", f"{group_id},")
    if forward:
        forwarded(store, inc, cut, group_id)

# --- trainer side ---------------------------------------------------------------------------------

def new_epoch(store, resumed_epoch: int) -> int:
    """This trainer's start (trainer/epoch): above every earlier one, the checkpoint's it resumed
    from included (a whole run resumed on a new store counts from 1 again) -> the epoch."""
    epoch = int(store.add("trainer/epoch", 1))
    if epoch <= resumed_epoch:
        epoch = int(store.add("trainer/epoch", resumed_epoch + 1 - epoch))
    return epoch


def fence(store, cut: int, floor: int = 0) -> int:
    """Trainer rank 0 (WeightServer), at a cut: from now on only incarnations of `cut` take new
    group ids -> the fence (every id below it was handed out before the cut). `floor`: one past
    the largest id the trainer has trained (a run resumed on a new store starts there)."""
    while True:
        now = store.get("groups/next").decode() if store.check(["groups/next"]) else ""
        next_id = max(floor, int(now.split()[1]) if now else 0)
        mine = f"{cut} {next_id} fence"
        if store.compare_set("groups/next", now, mine).decode() == mine:
            return next_id


def dropped_ids(store) -> set:
    """Groups the verifier dropped for good (zero advantage, malformed)."""
    return set(_ids(store.get("groups/dropped"))) if store.check(["groups/dropped"]) else set()


def group_table(pending: list, highest: dict, size: int) -> list:
    """This rank's part of the groups it holds, for `whole_groups` (one list of ints, gathered from
    every rank): the number of groups; per group [verifier, first, inc, group_id, samples here,
    block] (`first`: the verifier's order of the group's first sample; `block`: its seq // size);
    then per verifier incarnation [verifier, the highest order received] (`highest`)."""
    groups = {}
    for s in pending:
        first = int(s["order"]) - int(s["seq"]) % size  # a group's seqs and orders are consecutive
        g = groups.setdefault((int(s["inc"]), int(s["group_id"])),
                              [int(s["verifier"]), first, 0, int(s["seq"]) // size])
        g[2] += 1
    flat = [len(groups)]
    for (inc, gid), (verifier, first, n, block) in groups.items():
        flat += [verifier, first, inc, gid, n, block]
    for verifier, top in highest.items():
        flat += [verifier, top]
    return flat


def whole_groups(tables: list, size: int) -> tuple:
    """Every rank alike, from every rank's `group_table`: which groups the ranks hold whole, and
    which never will be. -> (whole: [(inc, group_id)] in the order the verifier sent them; lost:
    [(inc, group_id)]; held: (inc, group_id) -> [verifier, first, samples, block]; watermark:
    verifier -> the lowest over the ranks of the highest order received).

    A group is trained whole, in one step, or not at all, so a sample lost on the way (a rank's
    connection dropped, a malformed message) cannot leave the rest of its group trained, and
    neither can a trainer's death between steps. A verifier numbers the samples it sends
    (`order`), a group's consecutively, and a ZMQ pipe is first in, first out: once every rank has
    received a sample that verifier sent after a group's last, what has not arrived of the group
    never will."""
    held, tops = {}, []
    for flat in tables:
        n, rest = flat[0], flat[1 + 6 * flat[0]:]
        for k in range(n):
            verifier, first, inc, gid, count, block = flat[1 + 6 * k:7 + 6 * k]
            held.setdefault((inc, gid), [verifier, first, 0, block])[2] += count
        tops.append(dict(zip(rest[0::2], rest[1::2])))
    watermark = {v: min(t.get(v, -1) for t in tops) for v in set().union(*tops)}
    whole = [key for _, key in sorted((g[:2], key) for key, g in held.items() if g[2] == size)]
    lost = [key for key, (v, first, n, _) in held.items()
            if n < size and first + size - 1 <= watermark.get(v, -1)]
    return whole, lost, held, watermark


class Ledger:
    """Trainer rank 0's books of the current cut, and the one writer of its budget.

    `consumed`: per incarnation, samples of the cut trained. `seen`, `judged`: per stream
    (verifier incarnation, actor incarnation), the blocks of its seqs that some rank held, and the
    first block not yet judged (a group's samples are one block of group_size consecutive seqs of
    its stream: the verifier numbers each actor incarnation's samples of a cut, `seq`).
    `recut`: a group was lost whole, its id unknown here: the next weight group is a cut, which
    generates it again."""

    def __init__(self, store, run_dir, state):
        self.store, self.run_dir, self.state = store, run_dir, state
        self.cut, self.published, self.last, self.recut = None, None, 0.0, False
        self.consumed, self.seen, self.judged = {}, {}, {}
        # lost incarnations of the cut -> the ids they took that were looked at (redo)
        self.lost = {}

    def start_cut(self, cut: int, ids_below: int):
        """A new cut: the books start afresh; the ids
        below the fence that were neither trained nor dropped are listed to do again
        (redo/<cut>), then the budget goes out."""
        self.cut, self.consumed, self.seen, self.judged, self.lost = cut, {}, {}, {}, {}
        state = self.state
        self.store.set(f"budget/{cut}/started", "0")
        self.store.set(f"redo/{cut}/taken", "0 trainer")
        self.store.set(f"redo/{cut}", "")  # the actors wait for it (read_budget)
        self.redo(range(state.trained_below, ids_below), f"cut {cut}")

    def redo(self, ids, why: str):
        """List the ids of `ids` that were neither trained nor dropped, to generate again first."""
        if not ids:
            return
        state, dropped = self.state, dropped_ids(self.store)
        ids = [g for g in ids if g >= state.trained_below and g not in state.trained_ids
               and g not in dropped]
        self.store.append(f"redo/{self.cut}", "".join(f"{g}," for g in ids))
        self.store.add(f"redo/{self.cut}/count", len(ids))
        if ids:
            print(f"[trainer] {why}: {len(ids)} group ids to generate again first", flush=True)

    def follow(self, group, version: int, force: bool = True):
        """The books follow the weight group's cut (a new one starts them afresh), then publish
        the budget for this version (`publish`)."""
        if group.cut is None:
            return
        if group.cut != self.cut:
            self.start_cut(group.cut, group.ids_below)
            force = True
        group.recut, self.recut = group.recut or self.recut, False  # (a lost whole group: `held`)
        self.publish(version, set(group.members), force, set(group.cut_members))

    def settle(self, incs: list):
        """Once a step, with the incarnation of every sample of the step (all ranks): count them
        consumed."""
        for inc in incs:
            self.consumed[inc] = self.consumed.get(inc, 0) + 1

    def held(self, held: dict, watermark: dict, lost: list, size: int):
        """Rank 0, whenever the ranks' groups are counted (`whole_groups`): the `lost` groups (a
        sample of theirs never arrives) are dropped whole, recorded as the verifier records its
        drops. A block of a stream that no rank held, below one whose first sample every rank has
        passed, was a group lost whole: its samples are given back, and a cut generates its id
        again (`recut`)."""
        for inc, gid in lost:
            record = {"group_id": gid, "inc": inc, "cut": self.cut, "size": size,
                      "reason": "lost on the way", "time": time.time()}
            with open(self.run_dir / "groups_dropped.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            drop(self.store, inc, self.cut, gid, size, forward=False)
            print(f"[trainer] group {gid} of actor incarnation {inc}: a sample never arrived; "
                  "dropped and given back", flush=True)
        for (inc, _), (v, _, _, block) in held.items():
            if block >= self.judged.get((v, inc), 0):
                self.seen.setdefault((v, inc), set()).add(block)
        for (inc, _), (v, first, _, block) in held.items():
            seen, below, gone = self.seen.get((v, inc), set()), self.judged.get((v, inc), 0), 0
            if first > watermark.get(v, -1) or block <= below:
                continue
            for b in range(below, block):  # every sample sent before this group is here or lost
                gone += b not in seen
                seen.discard(b)
            self.judged[v, inc] = block
            if gone:
                self.store.add(f"dropped/{inc}/{self.cut}", gone * size)
                self.recut = True
                print(f"[trainer] {gone} groups of actor incarnation {inc} never arrived: given "
                      "back; a cut generates their ids again", flush=True)

    def publish(self, version: int, members, force: bool = True, in_cut=None):
        """budget/<cut> = "t consumed returned" for this version and membership; not `force`d, at
        most every 0.2 s and only when something changed (the trainer calls it while it waits,
        so drops and lost incarnations reach the actors without a step). `in_cut`: every
        incarnation that was a member in this cut (None: every one registered)."""
        if not force and time.monotonic() - self.last < 0.2:
            return
        self.last = time.monotonic()
        store, cut = self.store, self.cut
        returned = 0
        if in_cut is None:
            in_cut = range(1, int(store.add("actor/incarnations", 0)) + 1)
        lost = sorted(set(in_cut) - set(members))
        shares = started(store.get(f"budget/{cut}/started"))[1] if lost else {}
        for inc in members:
            returned += int(store.add(f"dropped/{inc}/{cut}", 0))
        for inc in lost:  # (or not yet in a group: it started nothing)
            share = shares.get(inc, 0)
            returned += share - self.consumed.get(inc, 0)
            if share:
                # its groups are never trained now: listed to generate again, each id it took once
                ids = taken_by(store, cut, inc) - self.lost.setdefault(inc, set())
                self.redo(sorted(ids), f"actor incarnation {inc} lost")
                self.lost[inc] |= ids
        value = f"{version} {sum(self.consumed.values())} {returned}"
        if force or value != self.published:
            store.set(f"budget/{cut}", value)
            self.published = value


class Membership:
    """Trainer rank 0: which actor incarnations the weight group holds, and when it is formed anew
    (weights_sync.WeightServer asks `due`, then `form`s it and broadcasts).

    An actor incarnation registers (actor/incarnations) and beats (alive/<inc>, rewritten every
    run.log_every); one whose beat has not changed for run.heartbeat_timeout_s (on this host's
    clock), or that does not meet in a new group's rendezvous within it, is lost, for good: it
    comes back as a new incarnation. gloo and NCCL groups are fixed at creation, so a change forms
    a new group g (store prefix weights/<g>) of rank 0 and the live members' workers: group/<g>
    holds its members (incarnation -> first rank), the latest cut, the trainer's epoch and
    version, and the incarnations counted lost; "group <g>" is announced before its versions. The
    old group is given up, which fails a receive still waiting on it at once.
    Cuts: this trainer's first group, the first after the verifier restarted, and the first after
    a group was lost whole on the way (`recut`, Ledger.held) is a cut: the actors give up what
    they have in flight and start their accounting afresh, and the trainer never trains a sample
    of a group started before it (a restarted trainer's versions may come from a timeline it
    never had; a restarted verifier lost what it held; the lost group's id is generated again).
    `members` and `cut` change before the group is announced."""

    def __init__(self, cfg, epoch: int, on_cut=lambda store, g: 0):
        self.cfg, self.epoch = cfg, epoch
        # at a cut, before the group is announced: on_cut(store, g) -> the first group id of the
        # new cut (`fence`)
        self.on_cut, self.ids_below = on_cut, 0
        # its own connection: the rendezvous blocks on it
        self.store = ws.create_store(cfg.sync.host, cfg.sync.port, False, cfg.run.peer_timeout_s)
        # the current group: its number, process group, members (incarnation -> first rank)
        self.g, self.pg, self.members, self.cut = 0, None, {}, None
        self.cut_members = set()
        self.beats, self.lost = {}, set()  # inc -> (last beat value, when it changed here)
        self.verifier = None  # the verifier incarnation at the last cut
        self.recut = False  # a cut is owed (Ledger.recut)
        # the watcher's latest look: live incarnations (None: not yet), the verifier's incarnation
        self.live, self.verifier_now = None, None
        self.wake, self.closed = threading.Event(), False
        threading.Thread(target=self._watch, daemon=True).start()

    def due(self, broken: bool) -> bool:
        """Must a new group be formed (a member lost or joined, the verifier restarted, or the
        last broadcast failed)? No actor before and none now: nothing to form (a restarted
        trainer's first look comes before it has seen any beat change)."""
        if self.live is None:  # the watcher's first look is yet to come
            return False
        restarted = self.verifier_now != self.verifier or self.recut
        changed = broken or set(self.live) != set(self.members) or restarted
        return changed and bool(self.live or self.members)

    def form(self, version: int):
        """A new group of rank 0 and the live incarnations' workers, announced -> its process
        group (None: no member). Members that do not meet in it within run.heartbeat_timeout_s
        are lost (the next one is formed without them)."""
        live, store, cfg = list(self.live), self.store, self.cfg
        cut = self.cut is None or self.verifier_now != self.verifier or self.recut
        # a cut announced stays the cut if its group fails
        self.verifier, self.recut = self.verifier_now, False
        old, self.pg = self.pg, None
        ws.abandon(old)  # a broadcast still waiting on the old group fails now
        per = cfg.actor.engines * cfg.actor.tp  # weight ranks of an actor
        g = int(store.add("group/count", 1))
        members = {inc: 1 + k * per for k, inc in enumerate(sorted(live))}
        # a cut fences the run's group ids; a new member (every member at a cut) starts no group
        # older than the weights it is about to get
        if cut:
            self.ids_below = self.on_cut(store, g)
        for inc in members if cut else set(members) - set(self.members):
            store.set(f"oldest/{inc}", f"{g if cut else self.cut} {version}")
        self.g, self.members = g, members
        # every incarnation in a group of this cut (the only ones that may start its samples)
        self.cut_members = set(members) | (set() if cut else self.cut_members)
        self.cut = g if cut else self.cut
        info = {"members": members, "cut": self.cut, "epoch": self.epoch, "version": version,
                "lost": sorted(self.lost)}
        store.set(f"group/{g}", json.dumps(info))
        ws.announce(store, f"group {g}")
        if not members:
            return None
        try:
            self.pg = ws.init_group(store, 0, 1 + len(members) * per, "auto", cfg.sync.timeout_s,
                                    f"weights/{g}", cfg.run.heartbeat_timeout_s,
                                    lambda: bool(set(members) & self.lost))
        except dist.DistStoreError:
            met = [store.check([f"weights/{g}/joined/{r}" for r in range(first, first + per)])
                   for first in members.values()]
            for inc in [inc for inc, ok in zip(members, met) if not ok]:
                print(f"[trainer] actor incarnation {inc} lost: not in weight group {g} within "
                      f"{cfg.run.heartbeat_timeout_s:.0f} s (run.heartbeat_timeout_s)", flush=True)
                self.lost.add(inc)
            raise
        return self.pg

    def _watch(self):
        """Every 0.5 s (a thread and a store connection of its own): which incarnations are alive
        (`live`), and the verifier's incarnation. A member that is lost has its group given up at
        once: a broadcast waiting on a dead or unreachable host fails now, not after
        sync.timeout_s (NCCL's answer to a lost member too: abort the communicator)."""
        store = ws.create_store(self.store.host, self.store.port, False,
                                self.cfg.run.peer_timeout_s)
        while not self.closed:
            try:
                self.live = self._live(store)
                self.verifier_now = int(store.add("verifier/incarnations", 0))
            except Exception as e:  # noqa: BLE001 - the store unreachable for a moment: next turn
                print(f"[trainer] the store: {type(e).__name__}: {e}", flush=True)
            if self.live is not None and set(self.members) - set(self.live):
                ws.abandon(self.pg)
            if set(self.live or ()) != set(self.members) or self.verifier_now != self.verifier:
                self.wake.set()
            time.sleep(0.5)

    def _live(self, store) -> list:
        """Registered actor incarnations whose beat changed within run.heartbeat_timeout_s, as this
        trainer watched it (on its own clock: the actors' clocks may differ). A beat seen once
        proves nothing (a dead incarnation's last one stays in the store): it must change."""
        now, limit = time.monotonic(), self.cfg.run.heartbeat_timeout_s
        count = int(store.add("actor/incarnations", 0))
        incs = [i for i in range(1, count + 1) if i not in self.lost]
        beating = [i for i in incs if store.check([f"alive/{i}"])]
        values = store.multi_get([f"alive/{i}" for i in beating]) if beating else []
        for inc, value in zip(beating, values):
            if inc not in self.beats:
                self.beats[inc] = (value, None)  # first seen: not yet known to be alive
            elif self.beats[inc][0] != value:
                self.beats[inc] = (value, now)
        beating = [i for i in beating if self.beats[i][1] is not None]
        gone = {i for i in beating if now - self.beats[i][1] > limit}
        for inc in gone & set(self.members):
            print(f"[trainer] actor incarnation {inc} lost: no heartbeat for {limit:.0f} s "
                  "(run.heartbeat_timeout_s)", flush=True)
        self.lost |= gone
        return [i for i in beating if i not in gone]
