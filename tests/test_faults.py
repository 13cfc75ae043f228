"""The fault layer (elastic.py) where a run cannot force the timing: a verifier completing groups out of
order, a death between two store writes, a lost actor's group ids, two trainer ranks with different views,
an id counter fenced at a cut. Real TCPStores, real ZMQ, real gloo; no engine.

Run: bash run.sh test tests/test_faults.py      (~30 s)
"""
import asyncio
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import pytest
import torch.distributed as dist
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import actor  # noqa: E402
import common  # noqa: E402
import elastic  # noqa: E402
import trainer  # noqa: E402
import verifier  # noqa: E402
import weights_sync as ws  # noqa: E402
from conftest import forkserver, free_port  # noqa: E402


def new_store():
    return ws.create_store("127.0.0.1", 0, True, 30)


def actor_state(store, inc, cut, **kw):
    """An actor incarnation's state, as the loop holds it once it is in a group of cut `cut`."""
    return actor.ActorState(inc=inc, weight_group=cut, cut=cut, **kw)


# --- a group holds u_min until the verifier forwards it ------------------------------------------------

def test_a_slow_group_holds_u_min_until_the_verifier_forwards_it(tmp_path):
    """verifier.workers > 1: the verifier may complete a group admitted later (version 4) before one pushed
    earlier (version 3). Until the verifier has forwarded the slow one, it stays the actor's oldest group in
    flight (u_min = 3): with it dropped when its last sample was pushed (u_min = 4), the actor admitted a
    batch more, all trained before the slow group, whose version-3 tokens then went past max_lag."""
    store = new_store()
    cfg = common.load_config([f"run.dir={tmp_path}", "trainer.batch_size=8", "actor.group_size=4",
                              "actor.max_lag=0"])
    store.set("budget/1", "3 0 0")
    store.set("redo/1/taken", "0 trainer")
    st = actor_state(store, 1, 1, version=4)
    owner = SimpleNamespace(store=store, st=st)
    # pushed, both: group 7 started at version 3, group 8 at version 4
    st.groups = {7: actor.Group(version=3, left=0, engine=0), 8: actor.Group(version=4, left=0, engine=0)}
    vs = verifier.State(cfg, store)
    for gid in (8, 7):  # the verifier's workers finish group 8 first
        key = (False, gid, 1, 1)
        scored = {i: ({"group_id": gid, "sample_idx": i, "group_size": 4, "reward": float(i % 2), "inc": 1,
                       "cut": 1}, {}) for i in range(4)}
        vs.open[key] = {"size": 4, "t0": 0.0, "stream": (1, 1), "seen": set(range(4)), "scored": scored}
        verifier.complete(vs, key)
        actor.Actor.refresh_budget(owner)
        if gid == 8:
            assert 7 in st.groups and actor.oldest(st) == 3
    assert st.groups == {} and actor.oldest(st) == 4


def test_a_lost_incarnations_forwarded_group_does_not_release_its_copy_made_again():
    """Incarnation 1's group 7 was forwarded and never trained (1 was lost): 7 is generated again, by
    incarnation 2. Its copy holds 2's u_min until the verifier forwards that copy: with the verifier's mark
    per group id only, 1's mark let it go at once (before the verifier had it), and groups admitted after it
    could be trained first, past max_lag."""
    store = new_store()
    store.set("budget/1", "3 0 0")
    store.set("budget/1/started", "0")
    store.set("redo/1", "7,")
    store.add("redo/1/count", 1)
    store.set("redo/1/taken", "1 2")
    elastic.forwarded(store, 1, 1, 7)  # 1's copy, in the verifier's outbox when 1 was lost
    st = actor_state(store, 2, 1, version=4)
    owner = SimpleNamespace(store=store, st=st)
    st.groups = {7: actor.Group(version=3, left=0, engine=0)}  # 2's copy, pushed
    actor.Actor.refresh_budget(owner)
    assert 7 in st.groups and actor.oldest(st) == 3
    elastic.forwarded(store, 2, 1, 7)  # the verifier forwards 2's copy
    actor.Actor.refresh_budget(owner)
    assert st.groups == {}


# --- group ids: fenced at a cut, listed again -------------------------------------------------------

def test_group_ids_are_fenced_at_a_cut_and_the_untrained_ones_listed_again():
    """A trainer killed after a checkpoint: the actors of the old cut go on taking ids until they hear of
    the new group. The new trainer's fence stops them (compare-and-set: a take of a stale cut gets None),
    and every id below the fence that was not trained is generated again first: none is skipped (before,
    the list held the ids up to the checkpoint's last trained one only, and the ones taken after it were
    never trained)."""
    store = new_store()
    elastic.fence(store, 1)
    old = actor_state(store, 1, 1, redo=[])
    store.set("redo/1/taken", "0 trainer")
    taken = [elastic.take_group_id(store, old) for _ in range(6)]
    assert taken == [0, 1, 2, 3, 4, 5]
    state = SimpleNamespace(trained_below=0, trained_ids={0, 1, 3})  # the checkpoint: 0, 1, 3 trained
    books = elastic.Ledger(store, None, state)
    books.start_cut(2, elastic.fence(store, 2, floor=4))
    assert elastic.take_group_id(store, old) is None  # the old cut's actor is fenced out
    new = actor_state(store, 2, 2)
    got = [elastic.take_group_id(store, new) for _ in range(4)]
    assert got == [2, 4, 5, 6], got  # 2, 4, 5 again first, then new ids


def test_a_lost_incarnations_ids_are_generated_again_each_once():
    """An actor killed with groups in flight (not a cut): the books give its samples back and list the
    ids it took that were not trained; two live actors take each of them once (compare-and-set on a list
    that grows), and an id a lost actor had taken from that list is listed again."""
    store = new_store()
    elastic.fence(store, 1)
    state = SimpleNamespace(trained_below=0, trained_ids=set())
    books = elastic.Ledger(store, None, state)
    books.start_cut(1, 0)
    store.add("actor/incarnations", 3)
    a, b, c = (actor_state(store, inc, 1) for inc in (1, 2, 3))
    for st in (a, a, a, b):  # a takes 0, 1, 2; b takes 3; a started 12 samples
        elastic.take_group_id(store, st)
    store.set("budget/1/started", "12 1:12")
    state.trained_ids |= {1}
    books.consumed = {1: 4}
    books.publish(5, {1, 2, 3})
    assert store.get("budget/1") == b"5 4 0"
    books.publish(5, {2, 3})  # incarnation 1 lost: 8 samples back, ids 0 and 2 again
    assert store.get("budget/1") == b"5 4 8" and store.get("redo/1") == b"0,2,"
    assert elastic.take_group_id(store, b) == 0 and elastic.take_group_id(store, c) == 2
    assert elastic.take_group_id(store, b) == 4  # the list is done: a new id
    store.set("budget/1/started", "16 1:12 3:4")
    books.publish(5, {2})  # incarnation 3 lost with id 2, which it had taken from the list
    assert store.get("redo/1") == b"0,2,2,"
    assert elastic.take_group_id(store, b) == 2
    books.publish(5, {2})
    assert store.get("redo/1") == b"0,2,2,"  # nothing listed twice for one loss


class KilledAt:
    """The store as one actor sees it, the actor killed (SystemExit) at its first write to a key starting
    with `prefix`, before the write."""

    def __init__(self, store, prefix):
        self.store, self.prefix = store, prefix

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def maybe_killed(key, *args):
            if name in ("set", "append", "add", "compare_set") and key.startswith(self.prefix):
                raise SystemExit(f"killed before {name} {key}")
            return call(key, *args)
        return maybe_killed


@pytest.mark.parametrize("then", ["another takes", "nobody takes"])
def test_an_id_taken_by_an_actor_killed_before_recording_it_is_generated_again(then):
    """An actor killed between taking a group id (compare-and-set on groups/next, or on redo/<cut>/taken)
    and recording it (ids/<cut>/<inc>): before, the books never listed that id again and it was skipped
    until the next cut. The value of a take names its taker and id, and the next taker records the take
    before its own: the books find every id the lost incarnation took."""
    store = new_store()
    elastic.fence(store, 1)
    state = SimpleNamespace(trained_below=0, trained_ids=set())
    books = elastic.Ledger(store, None, state)
    books.start_cut(1, 0)
    books.redo([7], "a lost incarnation of before")
    store.add("actor/incarnations", 2)
    a, b = actor_state(store, 1, 1), actor_state(store, 2, 1)
    with pytest.raises(SystemExit):
        elastic.take_group_id(KilledAt(store, "ids/"), a)  # takes 7 from the list, killed before its record
    assert not store.check(["ids/1/1"])
    if then == "another takes":
        assert elastic.take_group_id(store, b) == 0  # a new id: the list is done
    store.set("budget/1/started", "8 1:8")
    books.publish(3, {2})  # incarnation 1 lost: 7 again
    assert elastic._ids(store.get("redo/1")) == [7, 7]
    assert elastic.take_group_id(store, b) == 7
    # the same for a new id: incarnation 2 takes 1 (or 0), killed before its record; then lost, with all
    # it took and never trained
    c = actor_state(store, 3, 1)
    with pytest.raises(SystemExit):
        elastic.take_group_id(KilledAt(store, "ids/"), b)
    if then == "another takes":
        assert elastic.take_group_id(store, c) == 2
    store.set("budget/1/started", "16 1:8 2:8")
    books.publish(3, {3})
    again = [0, 1, 7] if then == "another takes" else [0, 7]
    assert elastic._ids(store.get("redo/1"))[2:] == again


def test_an_admission_counts_the_run_and_its_share_in_one_write_checked_against_every_other():
    """elastic.reserve: the run's started samples and each incarnation's share are one value, changed by
    compare-and-set from the value the admission checked. Before, two counters: an actor killed between
    them left the run's count a group above its incarnations' shares, budget the trainer never gave back
    (at max_lag=0 no step could fill again until a cut). Killed during its check now, it counted nothing;
    an admission whose checked value changed meanwhile (another actor's) checks again with it counted."""
    store = new_store()
    store.set("budget/1/started", "0")
    st, other = actor_state(store, 1, 1), actor_state(store, 2, 1)

    def killed_while_checking(s):
        raise SystemExit("killed")
    with pytest.raises(SystemExit):
        elastic.reserve(store, st, 4, killed_while_checking)
    assert store.get("budget/1/started") == b"0"
    seen = []

    def another_admits_first(s):  # the other actor's admission lands between this one's read and write
        seen.append(s.started)
        if len(seen) == 1:
            assert elastic.reserve(store, other, 4, lambda s: True)
        return s.started + 4 <= 8
    assert elastic.reserve(store, st, 4, another_admits_first)
    assert seen == [0, 4] and store.get("budget/1/started") == b"8 1:4 2:4"
    assert not elastic.reserve(store, other, 4, lambda s: s.started + 4 <= 8)
    assert elastic.started(store.get("budget/1/started")) == (8, {1: 4, 2: 4})


# --- announcements and group keys whose writer died ------------------------------------------------------

def test_an_announcement_whose_trainer_died_before_setting_it_is_skipped():
    """weights_sync.announce counts `announced`, then sets announce/<n>: a trainer that dies between the two
    leaves n without a key, and the actor's thread waiting on it (before: for 365 days, with its group still
    set, so no timeout fired). The actor's watchdog sees a later number counted and n's key still missing a
    second later: it fills n with "skip" (compare-and-set), which the thread passes over; a writer that finds
    its number filled takes the next."""
    store = new_store()
    loop = asyncio.new_event_loop()
    cfg = common.load_config([f"sync.port={store.port}"])
    owner = SimpleNamespace(cfg=cfg, store=store, st=actor.ActorState(weight_group=1), gap=None, gap_checked=0.0,
                            announcements=actor.Announcements(cfg, 1, loop, asyncio.Event()))
    store.add("announced", 1)  # n = 1 counted, its writer died
    ws.announce(store, "group 7")  # the next trainer's announcement: n = 2
    deadline = time.time() + 10
    while not owner.announcements.pending and time.time() < deadline:
        elastic.watchdog(owner)
        loop.run_until_complete(asyncio.sleep(0.05))
    assert owner.announcements.pending == ["group 7"] and store.get("announce/1") == b"skip"
    store.add("announced", 1)  # n = 3 counted, about to be set: a watchdog fills it first
    store.compare_set("announce/3", "", "skip")
    ws.announce(store, "5")
    assert store.get("announce/4") == b"5"


def test_a_later_group_is_seen_when_the_one_before_has_no_key():
    """The vLLM worker's watcher gives its group up once a later one is formed: group/count counted then
    group/<g> set, so a trainer that died between the two leaves a number without a key; the next trainer's
    group (a later number, with its key) counts."""
    store = new_store()
    store.add("group/count", 2)
    store.set("group/1", "{}")  # group 2 counted, never set
    assert not ws.later_group(store, 1)
    store.add("group/count", 1)
    store.set("group/3", "{}")
    assert ws.later_group(store, 1)


# --- two trainer ranks filter by rank 0's view -----------------------------------------------------------

SHARE = 2


def _sample(i, inc, cut, order):
    header = {"group_id": 100 * cut + i // 2, "sample_idx": i % 2, "group_size": 2, "task": "arithmetic",
              "answer": "3", "finish_reason": "stop", "t_start": 0.0, "t_end": 1.0, "inc": inc, "cut": cut,
              "eval": False, "reward": 1.0, "status": "correct", "advantage": 0.5, "seq": i,
              "verifier": 1, "order": order}
    arrays = {"prompt_ids": np.array([1, 2], np.int32), "completion_ids": np.array([3, 4], np.int32),
              "logprobs": np.full(2, -1.0, np.float32), "versions": np.zeros(2, np.int32)}
    return common.encode(header, arrays)


def _rank(rank, world, port, tmp, store_port, samples_port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    cfg = common.load_config([f"run.dir={tmp}", f"sync.port={store_port}", f"ports.samples={samples_port}",
                              "actor.group_size=2", "trainer.nproc=2", f"trainer.batch_size={2 * SHARE}"])
    store = ws.create_store("127.0.0.1", store_port, False, 60)
    state = trainer.TrainState(model=None, fsdp=SimpleNamespace(device=torch.device("cpu")))
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.connect(common.zmq_addr("127.0.0.1", samples_port))
    store.set(f"test/connected/{rank}", "1")
    # rank 1's own (stale) view would take the old cut's backlog and the lost incarnation: it is not asked
    view = (lambda: ({1}, 2)) if rank == 0 else (lambda: ({1, 9}, 1))
    batch, _ = trainer.take_batch(sock, [], 2 * SHARE, 2 * SHARE, state, cfg, "addr", 64, view,
                                  lambda: None)
    store.set(f"test/batch/{rank}", ",".join(f"{s['inc']}:{s['cut']}" for s in batch))
    store.set(f"test/discarded/{rank}", str(state.discarded))
    sock.close(linger=0)
    dist.destroy_process_group()


def test_every_trainer_rank_filters_its_batch_by_rank_0s_view(tmp_path):
    """With trainer.nproc > 1, ranks other than 0 read the membership through a view cached for a second:
    after a restart they saw the dead trainer's group and trained the verifier's backlog of the old cut
    (negative lags, ids trained twice). Every rank now filters each batch by rank 0's view, all-gathered
    when the batch is formed."""
    store = new_store()
    samples_port = free_port()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(common.zmq_addr("127.0.0.1", samples_port))
    ctx = forkserver()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path), store.port, samples_port))
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.time() + 60
    while not store.check(["test/connected/0", "test/connected/1"]) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # both pipes up: ZeroMQ deals to both
    # an old cut's backlog and a lost incarnation's samples first, then the current cut's
    frames = [_sample(i, 1, 1, i) for i in range(4)] + [_sample(i, 9, 2, 4 + i) for i in range(4)]
    frames += [_sample(i, 1, 2, 8 + i) for i in range(8)]
    for f in frames:
        while time.time() < deadline:
            try:
                push.send_multipart(f, zmq.NOBLOCK)
                break
            except zmq.Again:
                time.sleep(0.05)
    for p in procs:
        p.join(timeout=60)
    push.close()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for r in range(2):
        batch = store.get(f"test/batch/{r}").decode().split(",")
        assert batch == ["1:2"] * SHARE, (r, batch)
        assert int(store.get(f"test/discarded/{r}")) == 4


# --- a death during a regroup ------------------------------------------------------------------------------

def test_a_weight_group_whose_member_dies_after_meeting_ends_when_it_is_counted_lost():
    """A member that met in the store (weights/<g>/joined/<rank>) and died before the group was built: gloo's
    construction waits for it up to sync.timeout_s (300 s by default, 1,200 in the GPU recipe). It now ends as
    soon as `given_up()` turns true (Membership: the member counted lost, a heartbeat timeout later)."""
    store = new_store()
    store.set("weights/7/joined/1", "1")  # rank 1 met, then died
    t0 = time.time()
    with pytest.raises(RuntimeError, match="a member was lost meanwhile"):
        ws.init_group(store, 0, 2, "gloo", timeout_s=8, name="weights/7", join_timeout_s=5,
                      given_up=lambda: time.time() > t0 + 1.0)
    assert time.time() - t0 < 5
    time.sleep(max(0.0, t0 + 9 - time.time()))  # the construction left behind times out: nothing hangs on


def test_an_incarnation_counted_lost_before_its_first_group_registers_again():
    """An actor counted lost before it ever met in a group (too slow to meet: the group went on without it)
    was never a member: it used to wait for a group that would never take it, until run.peer_timeout_s, and
    run.sh then restarted a role nobody killed. Group info lists the incarnations counted lost."""
    store = new_store()
    store.add("actor/incarnations", 3)
    store.set("group/5", '{"members": {"4": 1}, "cut": 5, "epoch": 1, "version": 0, "lost": [3]}')
    dropped = []

    async def drop_all():
        dropped.append(True)
    owner = SimpleNamespace(cfg=common.load_config([]), store=store, proc=0, was_member=False,
                            st=actor.ActorState(inc=3), drop_all=drop_all, joining_weight_group=None)
    asyncio.new_event_loop().run_until_complete(elastic.regroup(owner, 5))
    assert dropped and owner.st.inc == 4  # a new incarnation


def test_a_wait_ends_when_the_store_goes_away():
    """An actor that starts while the run's store dies: its engines' workers connect to the store, a connect
    that waits out sync.timeout_s (300 s, then retries), and the actor with it (in a soak, an actor started
    30 s before the run ended was still there 8 minutes after). elastic.unless_store_lost checks the store
    every second meanwhile: the wait ends with DistNetworkError, which the actor turns into status 3."""
    import subprocess
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                               f"s = d.TCPStore('127.0.0.1', {port}, 1, True); time.sleep(600)"])
    try:
        store = ws.create_store("127.0.0.1", port, False, 30)

        async def wait_while_the_store_dies():
            asyncio.get_running_loop().call_later(1.0, server.kill)
            await elastic.unless_store_lost(store, asyncio.sleep(120))
        t0 = time.time()
        with pytest.raises(dist.DistNetworkError):
            asyncio.run(wait_while_the_store_dies())
        assert time.time() - t0 < 10
        assert asyncio.run(elastic.unless_store_lost(ws.create_store("127.0.0.1", 0, True, 30),
                                                     asyncio.sleep(0.1, "done"))) == "done"
    finally:
        server.kill()


# --- a group lost whole: a cut generates its id again ------------------------------------------------------

def test_a_group_lost_whole_makes_the_next_weight_group_a_cut(tmp_path):
    """No sample of a group reached any trainer rank: the trainer gives its samples back but does not know its
    id (elastic.Ledger.held). The books owe a cut, and the next group the Membership forms is one: its redo list
    holds every id below the fence that was neither trained nor dropped, that one included."""
    store = new_store()
    cfg = common.load_config([f"run.dir={tmp_path}", f"sync.port={store.port}"])
    group = elastic.Membership(cfg, epoch=1, on_cut=lambda s, g: elastic.fence(s, g, 0))
    deadline = time.time() + 10
    while group.live is None and time.time() < deadline:  # the watcher's first look
        time.sleep(0.05)
    books = elastic.Ledger(store, tmp_path, SimpleNamespace(trained_below=0, trained_ids=set()))
    group.form(0)
    first = group.cut
    books.follow(group, 0)
    group.form(0)
    assert group.cut == first  # a new group, not a cut
    # the verifier sent group 9 (seqs 0, 1, orders 0, 1), then group 10 (seqs 2, 3); only 10 arrived
    tables = [elastic.group_table([{"inc": 1, "group_id": 10, "sample_idx": i, "seq": 2 + i, "verifier": 1,
                                    "order": 2 + i} for i in range(2)], {1: 3}, 2)]
    whole, lost, held, watermark = elastic.whole_groups(tables, 2)
    books.held(held, watermark, lost, 2)
    assert int(store.add(f"dropped/1/{first}", 0)) == 2
    books.follow(group, 1)
    assert group.recut
    group.form(1)
    assert group.cut != first and not group.recut
    group.closed = True
