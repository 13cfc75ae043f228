"""How a run survives a role's death: membership and the ledger of samples, reached from the roles'
loops through a few named calls. Nothing here is the paper's algorithm; it keeps the algorithm's
promises while roles die and come back:

  every trained token has 0 <= lag <= actor.max_lag; every group is trained whole and once, or
  given back; nothing is lost without being given back; one death stalls no one for longer than
  it takes to notice it (run.heartbeat_timeout_s) and to start the role again.

The run's TCPStore (weights_sync.serve_store) holds the ledger. One writer per key (a counter may
have several adders); docs/DESIGN.md, "Elastic roles", gives the invariants and the order of the
writes that keeps each.

  key                          value                                   written by
  actor/incarnations           counter: actor starts and returns       actors (`register`)
  alive/<inc>                  a heartbeat, rewritten every log_every  actor <inc> (`beat`)
  groups/next                  "cut next by": the next new group id    actors (`take_group_id`);
                                                                       the trainer at a cut (`fence`)
  redo/<cut>                   "id,id,...": ids to generate again      trainer rank 0 (`Ledger`)
                               first (below the cut's fence never
                               trained nor dropped; a lost
                               incarnation's never trained)
  redo/<cut>/count             counter: ids in redo/<cut>              trainer rank 0 (`Ledger`)
  redo/<cut>/taken             "n by": ids of redo/<cut> taken         actors (`take_group_id`)
  ids/<cut>/<inc>              "id,id,...": the ids it took            actor <inc> (`take_group_id`)
  budget/<cut>/started         counter: samples started in the cut     actors (`reserve`)
  budget/<cut>/started/<inc>   one incarnation's share of it           actor <inc> (`reserve`)
  budget/<cut>                 "t consumed returned" (below)           trainer rank 0 (`Ledger`)
  dropped/<inc>/<cut>          counter: samples given back on the way  verifier (`drop`), trainer
                                                                       rank 0 (lost on the way)
  groups/dropped               "id,id,...": groups the verifier        verifier (`drop`)
                               dropped for good
  forwarded/<cut>/<id>         the verifier has forwarded or dropped   verifier (`forwarded`)
                               the group: it may leave u_min
  oldest/<inc>                 "cut version": the oldest start         actor <inc>; the trainer for a
                               version it has in flight                new member (WeightServer)
  verifier/incarnations        counter                                 verifier (`register_verifier`)

The budget of a cut is published by one writer, trainer rank 0, as three numbers: its version t,
the samples of the cut it has trained (consumed), and the samples given back (returned): every
member's drops, plus, for an incarnation no longer a member, everything it started that was not
trained. From then on no sample of that incarnation is trained (the trainer filters each batch by
the membership it published with, or a newer one), so nothing is given back twice.
"""
import sys
import time

# a role's exit status when the run's store went away: run.sh then stops the node's roles
STORE_LOST = 3


def store_lost(role: str, error) -> int:
    """One line naming the store, for a role that lost it -> the exit status run.sh reads."""
    print(f"[{role}] lost the run's store (sync.host:sync.port: weights_sync.py, which run.sh "
          f"starts on node 0): {error}", file=sys.stderr, flush=True)
    return STORE_LOST

# --- actor side -----------------------------------------------------------------------------------

def register(store) -> int:
    """A new actor incarnation: the trainer takes it into its next weight group once it beats."""
    return int(store.add("actor/incarnations", 1))


def beat(store, inc: int, text: str):
    """The heartbeat (the trainer counts an incarnation lost when it stops changing)."""
    store.set(f"alive/{inc}", f"{time.time():.1f} {text}")


def reserve(store, st, group_size: int, admit) -> bool:
    """Count one more group in the run's budget (budget/<cut>/started), then check `admit(st)` with
    every admission before it counted, any actor's; over budget: uncount it. Then this
    incarnation's own count, which the trainer gives back if it is lost: counted after the run's,
    so that a death in between can only lose budget (at most a group, until the next cut), never
    exceed it."""
    key = f"budget/{st.cut}/started"
    st.started = int(store.add(key, group_size)) - group_size
    if not admit(st):
        st.started = int(store.add(key, -group_size))
        return False
    st.started += group_size
    store.add(f"{key}/{st.inc}", group_size)
    return True


def read_budget(store, st) -> bool:
    """The run's budget as its writers last published it: samples started (all actors); the
    trainer's version, samples consumed and returned (budget/<cut>); the oldest version any other
    member has in flight (oldest/<inc>; one of an earlier cut counts as this cut's first). False
    while the trainer has yet to publish this cut's budget and list of ids to do again: nothing
    may start before."""
    if not store.check([f"budget/{st.cut}", f"redo/{st.cut}"]):
        return False
    st.started = int(store.add(f"budget/{st.cut}/started", 0))
    t, consumed, returned = map(int, store.get(f"budget/{st.cut}").split())
    st.trainer_version, st.consumed, st.returned = t, consumed, returned
    values = [v.decode().split() for v in store.multi_get([f"oldest/{i}" for i in st.others])]
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
    them again if this incarnation is lost."""
    gid = _take_redo(store, st)
    while gid is None:
        # compare-and-set: the fence at a cut and every actor's take are one sequence of values
        now = store.get("groups/next").decode()
        cut, next_id = map(int, now.split()[:2])
        if cut != st.cut:
            return None
        mine = f"{cut} {next_id + 1} {st.inc}"
        if store.compare_set("groups/next", now, mine).decode() == mine:
            gid = next_id
    store.append(f"ids/{st.cut}/{st.inc}", f"{gid},")
    return gid


def _take_redo(store, st):
    """The next id of redo/<cut> no actor has taken (compare-and-set on redo/<cut>/taken: the list
    may grow), or None."""
    key = f"redo/{st.cut}/taken"
    while True:
        listed = int(store.add(f"redo/{st.cut}/count", 0))
        now = store.get(key).decode()
        k = int(now.split()[0])
        if k >= listed:
            return None
        mine = f"{k + 1} {st.inc}"
        if store.compare_set(key, now, mine).decode() == mine:
            if k >= len(st.redo or []):
                st.redo = _ids(store.get(f"redo/{st.cut}"))
            return st.redo[k]


def _ids(value: bytes) -> list:
    return [int(g) for g in value.decode().split(",") if g]


def forwarded_groups(store, st, ids: list) -> list:
    """Of these pushed groups, the ones the verifier has forwarded or dropped (a group holds u_min
    until then: the verifier may complete groups out of order, and the trainer consumes them in
    the order it forwards them)."""
    done = [g for g in ids if store.check([f"forwarded/{st.cut}/{g}"])]
    for g in done:
        store.delete_key(f"forwarded/{st.cut}/{g}")
    return done


def excluded(info: dict, inc: int) -> bool:
    """Was this incarnation counted lost (it must come back as a new one)?"""
    return inc in info.get("lost", [])

# --- verifier side --------------------------------------------------------------------------------

def register_verifier(store) -> int:
    """This verifier's incarnation: the trainer cuts when it changes (the groups the previous one
    held are gone)."""
    return int(store.add("verifier/incarnations", 1))


def forwarded(store, cut: int, group_id: int):
    """The group is in the verifier's outbox (or dropped): its actor may let it leave u_min."""
    store.set(f"forwarded/{cut}/{group_id}", "1")


def drop(store, inc: int, cut: int, group_id: int, size: int):
    """A training group that will never be trained: its samples go back to the budget of the
    incarnation that started them, its id is never generated again."""
    store.add(f"dropped/{inc}/{cut}", size)
    store.append("groups/dropped", f"{group_id},")
    forwarded(store, cut, group_id)

# --- trainer side ---------------------------------------------------------------------------------

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


class Ledger:
    """Trainer rank 0's books of the current cut, and the one writer of its budget.

    `consumed`: per incarnation, samples of the cut trained. `received`, `highest`: the
    (incarnation, seq) pairs settled, to find samples the verifier sent that never arrived intact
    at any rank: the verifier numbers each incarnation's samples of a cut in send order (`seq`),
    a ZMQ pipe is first in, first out (a reconnected rank's new pipe carries newer seqs), so once
    every rank has received a sample numbered above s, sample s never arrives (its rank's
    connection dropped with it queued, or it came malformed). Judged from the first seq received:
    a restarted trainer, or a new cut, says nothing of what was sent before it."""

    def __init__(self, store, ranks: int, state):
        self.store, self.ranks, self.state = store, ranks, state
        self.cut, self.published, self.last = None, None, 0.0
        self.consumed, self.received, self.highest = {}, {}, {}
        # lost incarnations of the cut -> how many of the ids they took were looked at (redo)
        self.lost = {}

    def start_cut(self, cut: int, ids_below: int):
        """A new cut: the books start afresh; the ids below the fence that were neither trained
        nor dropped are listed to do again (redo/<cut>), then the budget goes out."""
        self.cut, self.consumed, self.received, self.highest, self.lost = cut, {}, {}, {}, {}
        state = self.state
        self.store.set(f"redo/{cut}/taken", "0 trainer")
        self.redo(range(state.trained_below, ids_below), f"cut {cut}")

    def redo(self, ids, why: str):
        """List the ids of `ids` that were neither trained nor dropped, to generate again first."""
        state, dropped = self.state, dropped_ids(self.store)
        ids = [g for g in ids if g >= state.trained_below and g not in state.trained
               and g not in dropped]
        self.store.append(f"redo/{self.cut}", "".join(f"{g}," for g in ids))
        self.store.add(f"redo/{self.cut}/count", len(ids))
        if ids:
            print(f"[trainer] {why}: {len(ids)} group ids to generate again first", flush=True)

    def settle(self, pairs: list):
        """Once a step, with every rank's (rank, incarnation, seq) of the step's samples of this
        cut: count them consumed; give back the ones that will never arrive."""
        for r, inc, seq in pairs:
            self.received.setdefault(inc, set()).add(seq)
            self.highest[r, inc] = max(self.highest.get((r, inc), -1), seq)
            self.consumed[inc] = self.consumed.get(inc, 0) + 1
        for inc, received in self.received.items():
            # every seq below it arrived or never will (-1 while a rank has none of inc's)
            watermark = min(self.highest.get((r, inc), -1) for r in range(self.ranks))
            lost = [s for s in range(min(received), watermark) if s not in received]
            self.received[inc] = {s for s in received if s >= watermark}
            if lost:
                self.store.add(f"dropped/{inc}/{self.cut}", len(lost))
                print(f"[trainer] lost {len(lost)} samples of actor incarnation {inc}: given "
                      "back", flush=True)

    def publish(self, version: int, members, force: bool = True):
        """budget/<cut> = "t consumed returned" for this version and membership; not `force`d, at
        most every 0.2 s and only when something changed (the trainer calls it while it waits,
        so drops and lost incarnations reach the actors without a step)."""
        if not force and time.monotonic() - self.last < 0.2:
            return
        self.last = time.monotonic()
        store, cut = self.store, self.cut
        returned = 0
        for inc in range(1, int(store.add("actor/incarnations", 0)) + 1):
            if inc in members:
                returned += int(store.add(f"dropped/{inc}/{cut}", 0))
                continue
            # lost (or not yet in a group: it started nothing)
            started = int(store.add(f"budget/{cut}/started/{inc}", 0))
            returned += started - self.consumed.get(inc, 0)
            if started and store.check([f"ids/{cut}/{inc}"]):
                # its groups are never trained now: listed to generate again, each id it took once
                ids = _ids(store.get(f"ids/{cut}/{inc}"))
                self.redo(ids[self.lost.get(inc, 0):], f"actor incarnation {inc} lost")
                self.lost[inc] = len(ids)
        value = f"{version} {sum(self.consumed.values())} {returned}"
        if force or value != self.published:
            store.set(f"budget/{cut}", value)
            self.published = value
