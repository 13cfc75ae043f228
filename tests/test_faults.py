"""The fault layer (elastic.py) where a run cannot force the timing: the ledger's books driven request
by request (a hand-worked lag budget, an actor lost, a verifier restarted, a trainer restarted, a
ledger resumed), the trainer's whole groups in forwarding order (hand-made tables), the watchdog
killing a stopped process, and the ledger answering over its real ZMQ socket.

Run: bash run.sh test tests/test_faults.py      (~15 s)
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402
import elastic  # noqa: E402
import trainer  # noqa: E402
from conftest import budget_of, free_port  # noqa: E402

B, GS, LAG = 8, 2, 1  # 4 groups a step


def config(tmp_path, **over):
    values = {"run.dir": tmp_path, "trainer.batch_size": B, "actor.group_size": GS,
              "actor.max_lag": LAG, **over}
    return common.load_config([f"{k}={v}" for k, v in values.items()])


def ask(ledger, kind, **fields) -> dict:
    """One request, through the bytes the socket would carry."""
    reply = json.loads(json.dumps(ledger.handle(json.dumps({"op": kind, **fields}).encode())))
    assert "error" not in reply, reply
    return reply


def tickets(ledger, inc, version, want, epoch=1, pushed=(), drop=()) -> list:
    reply = ask(ledger, "tickets", inc=inc, epoch=epoch, version=version, want=want,
                pushed=list(pushed), drop=list(drop))
    return reply.get("tickets")


def started(tmp_path, **over):
    """A ledger with one verifier, one trainer (epoch 1 from step 0) and actors 1, 2."""
    ledger = elastic.Ledger(config(tmp_path, **over))
    ask(ledger, "verifier_hello")
    ask(ledger, "trainer_hello", epoch=0, step=0, done_below=0, done_above=[],
        budget=budget_of(ledger.cfg))
    for _ in range(2):
        ask(ledger, "actor_hello", pid=1, host="h")
    return ledger


def journal(tmp_path) -> list:
    return [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]


# --- the lag budget, by hand ---------------------------------------------------------------------

def test_the_lag_budget_hand_worked(tmp_path):
    """B = 8, group_size = 2, max_lag = 1, trainer at version 0: (u_min - t + max_lag + 1) * B = 16
    samples may be outstanding, 8 groups, whatever actor asks."""
    ledger = started(tmp_path)
    first = tickets(ledger, 1, version=0, want=5)
    second = tickets(ledger, 2, version=0, want=5)
    assert [len(first), len(second)] == [5, 3]
    assert [g for _, g in first + second] == list(range(8))
    assert tickets(ledger, 2, version=0, want=1) == []
    # an actor still on version -1 (u_min -1): nothing until the others' groups are forwarded
    # and trained; trained at version 1, forwarded: room again, for two steps' worth at u_min 1
    done = [k for k, _ in first + second]
    ask(ledger, "forward", verifier=1, forward=done, drop=[])
    ask(ledger, "report", epoch=1, version=1, trained=done[:4], lost=[])
    assert len(tickets(ledger, 1, version=1, want=10)) == 4  # 8 outstanding + 8 <= (1-1+2)*8


def test_a_group_not_yet_forwarded_holds_u_min_for_every_actor(tmp_path):
    """Actor 1's old group (version 0) is trained by version 1 at the latest: until the verifier
    forwards it, no actor may start more than the budget from version 0 allows."""
    ledger = started(tmp_path)
    old = tickets(ledger, 1, version=0, want=1)
    others = tickets(ledger, 2, version=0, want=7)
    ask(ledger, "forward", verifier=1, forward=[k for k, _ in others], drop=[])
    ask(ledger, "report", epoch=1, version=1, trained=[k for k, _ in others[:4]], lost=[])
    # trainer at 1, outstanding 8 samples (old + 3 forwarded): u_min 0 allows (0-1+2)*8 = 8
    assert tickets(ledger, 2, version=1, want=4) == []
    ask(ledger, "forward", verifier=1, forward=[k for k, _ in old], drop=[])
    assert len(tickets(ledger, 2, version=1, want=4)) == 4  # u_min 1: (1-1+2)*8 = 16


def test_conventional_grants_an_rl_step_with_its_weights_only(tmp_path):
    ledger = started(tmp_path, **{"actor.schedule": "conventional", "actor.G_steps": 2})
    assert len(tickets(ledger, 1, version=0, want=10)) == 8  # B * G_steps samples
    ask(ledger, "report", epoch=1, version=1, trained=[], lost=[])
    assert tickets(ledger, 1, version=0, want=10) == []


# --- an actor lost, a verifier restarted: what comes back, what is kept ---------------------------

def test_a_lost_actors_groups_come_back_first_and_its_forwarded_ones_stay(tmp_path):
    ledger = started(tmp_path)
    mine = tickets(ledger, 1, version=0, want=3)
    ask(ledger, "forward", verifier=1, forward=[mine[0][0]], drop=[])
    ask(ledger, "lost", inc=1, why="not in weight roster 2")
    assert ask(ledger, "tickets", inc=1, epoch=1, version=0, want=1, pushed=[], drop=[]) == \
        {"lost": True}
    # ids 1 and 2 granted again, smallest first, before any new id; the forwarded group stays
    assert [g for _, g in tickets(ledger, 2, version=0, want=3)] == [1, 2, 3]
    assert mine[0][0] in ledger.open
    given = [e for e in journal(tmp_path) if e["event"] == "given_back"]
    assert given[-1]["tickets"] == [mine[1][0], mine[2][0]]
    # the verifier's forward of a given-back copy is refused, and so is its drop
    reply = ask(ledger, "forward", verifier=1, forward=[mine[1][0]], drop=[[mine[2][0], "x"]])
    assert reply["accepted"] == []
    assert not [e for e in journal(tmp_path) if e["event"] == "dropped"]


def test_an_actor_silent_past_the_heartbeat_is_lost_but_not_for_the_ledgers_own_stall(tmp_path):
    ledger = started(tmp_path, **{"run.heartbeat_timeout_s": 1.0})
    tickets(ledger, 1, version=0, want=1)
    ledger.looked -= 5.0  # the ledger itself stood still 5 s: nobody's silence counts
    ledger.actors = {inc: seen - 5.0 for inc, seen in ledger.actors.items()}
    ledger.check_silence()
    assert set(ledger.actors) == {1, 2}
    for _ in range(12):  # the ledger looks every 0.1 s (its loop: every 0.2 s); actor 2 speaks
        time.sleep(0.1)
        tickets(ledger, 2, version=0, want=0)
        ledger.check_silence()
    assert set(ledger.actors) == {2}
    assert journal(tmp_path)[-1]["why"] == "actor incarnation 1 lost"


def test_a_verifier_restart_gives_back_what_it_held_and_keeps_what_is_generating(tmp_path):
    ledger = started(tmp_path)
    held, generating, late = (tickets(ledger, 1, version=0, want=1)[0] for _ in range(3))
    tickets(ledger, 1, version=0, want=0, pushed=[[held[0], 1]])
    assert ask(ledger, "verifier_hello")["verifier"] == 2
    assert held[0] not in ledger.open and generating[0] in ledger.open
    # pushed to verifier 1 before the actor heard of 2: given back when it says so
    tickets(ledger, 1, version=0, want=0, pushed=[[late[0], 1]])
    assert late[0] not in ledger.open
    # a group that reached verifier 2 anyway (ZMQ queued it) and was forwarded stays
    ask(ledger, "forward", verifier=2, forward=[generating[0]], drop=[])
    tickets(ledger, 1, version=0, want=0, pushed=[[generating[0], 1]])
    assert ledger.open[generating[0]].state == "forwarded"
    # the old incarnation forwards nothing
    assert ask(ledger, "forward", verifier=1, forward=[held[0]], drop=[])["accepted"] == []


def test_lost_on_the_way_comes_back_without_a_cut(tmp_path):
    ledger = started(tmp_path)
    granted = tickets(ledger, 1, version=0, want=3)
    reply = ask(ledger, "forward", verifier=1, forward=[k for k, _ in granted], drop=[])
    assert reply["accepted"] == [[granted[0][0], 0], [granted[1][0], 1], [granted[2][0], 2]]
    # order 1 lost on the way: given back, its id first again; the others untouched
    reply = ask(ledger, "report", epoch=1, version=0, trained=[], lost=[[1, 1]])
    assert reply["forwards"] == [[1, 3]]
    assert granted[1][0] not in ledger.open and granted[0][0] in ledger.open
    assert [g for _, g in tickets(ledger, 2, version=0, want=1)] == [granted[1][1]]



def test_giving_back_a_pushed_copy_leaves_the_verifiers_forwarded_ones_alone(tmp_path):
    """A pushed copy names its verifier and no order yet: giving it back (its actor lost) must not
    touch the copy that verifier forwarded first (order 0), which is trained, or lost, as usual."""
    ledger = started(tmp_path)
    first, second = tickets(ledger, 1, version=0, want=1)[0], tickets(ledger, 2, version=0, want=1)[0]
    ask(ledger, "forward", verifier=1, forward=[first[0]], drop=[])
    tickets(ledger, 2, version=0, want=0, pushed=[[second[0], 1]])
    ask(ledger, "lost", inc=2, why="the test")
    ask(ledger, "report", epoch=1, version=1, trained=[first[0]], lost=[])
    assert [e["tickets"] for e in journal(tmp_path) if e["event"] == "trained"] == [[first[0]]]
    assert ledger.open == {}

# --- a trainer restarted, a ledger resumed --------------------------------------------------------

def test_a_trainer_restart_gives_back_everything_open_and_grants_the_undone_ids_first(tmp_path):
    ledger = started(tmp_path)
    granted = tickets(ledger, 1, version=0, want=6)
    ask(ledger, "forward", verifier=1, forward=[k for k, _ in granted[:4]], drop=[])
    ask(ledger, "report", epoch=1, version=1, trained=[k for k, _ in granted[:4]], lost=[])
    # the checkpoint was at step 0: ids 0..3 trained since are not done; 4, 5 were in flight
    reply = ask(ledger, "trainer_hello", epoch=1, step=0, done_below=0, done_above=[],
                budget=budget_of(ledger.cfg))
    assert reply["epoch"] == 2 and not ledger.open
    assert tickets(ledger, 1, version=1, want=1, epoch=1) == []  # weights of epoch 1: none
    assert [g for _, g in tickets(ledger, 1, version=0, want=8, epoch=2)] == list(range(6)) + [6, 7]
    # a report of the old epoch changes nothing
    assert ask(ledger, "report", epoch=1, version=9, trained=[], lost=[])["dropped"] == []
    assert ledger.version == 0


def test_a_resumed_ledger_numbers_on_and_grants_the_checkpoints_gaps(tmp_path):
    ledger = started(tmp_path)
    tickets(ledger, 1, version=0, want=3)
    ledger.journal.close()
    resumed = elastic.Ledger(config(tmp_path))  # a new process on the same run directory
    ask(resumed, "verifier_hello")
    reply = ask(resumed, "trainer_hello", epoch=1, step=4, done_below=2, done_above=[3, 5],
                budget=budget_of(resumed.cfg))
    assert reply["epoch"] == 2
    assert ask(resumed, "actor_hello", pid=1, host="h")["inc"] == 3
    granted = tickets(resumed, 3, version=4, want=3, epoch=2)
    assert [g for _, g in granted] == [2, 4, 6] and granted[0][0] == 4


def test_a_malformed_request_is_refused_whole(tmp_path):
    ledger = started(tmp_path)
    for frame in (b"not json", b"[]", json.dumps({"op": "tickets", "inc": "1"}).encode(),
                  json.dumps({"op": "nope"}).encode()):
        assert "error" in ledger.handle(frame)
    assert not ledger.open


# --- the trainer's whole groups, in forwarding order ------------------------------------------------

def table(groups, passed, ends=()):
    """A rank's group_table: groups [(verifier, order, ticket, group id, samples here)]."""
    return [len(groups), *(x for g in groups for x in g), len(passed),
            *(x for item in passed.items() for x in item), *(x for item in ends for x in item)]


def test_whole_groups_are_taken_in_order_and_a_gap_waits_until_every_rank_passed_it():
    # rank 0 holds all of order 0 and half of 2; rank 1 the other half of 2; order 1 not seen
    ranks = [table([(1, 0, 10, 0, 2), (1, 2, 12, 2, 1)], {1: 3}),
             table([(1, 2, 12, 2, 1)], {1: 1})]
    assert trainer.whole_groups(ranks, 2, {}) == [(1, 0, (10, 0))]  # 1: rank 1 has not passed it
    ranks[1] = table([(1, 2, 12, 2, 1)], {1: 3})  # a tick: rank 1 passed orders 0..2
    assert trainer.whole_groups(ranks, 2, {}) == [(1, 0, (10, 0)), (1, 1, None), (1, 2, (12, 2))]
    assert trainer.whole_groups(ranks, 2, {1: 2}) == [(1, 2, (12, 2))]


def test_an_old_verifiers_groups_end_where_the_ledger_says_and_come_first():
    # verifier 1 forwarded orders 0..2 before it died; order 2 never arrived; verifier 2's order 0
    ranks = [table([(1, 0, 10, 0, 2), (2, 0, 20, 5, 2)], {1: 1, 2: 1}, ends=[(1, 3), (2, 1)]),
             table([], {2: 1})]
    assert trainer.whole_groups(ranks, 2, {}) == [(1, 0, (10, 0)), (1, 1, None), (1, 2, None),
                                                  (2, 0, (20, 5))]
    # rank 1 heard nothing of verifier 2 yet: verifier 1's last order is not known lost
    ranks[1] = table([], {1: 1})
    assert trainer.whole_groups(ranks, 2, {}) == [(1, 0, (10, 0))]


# --- the watchdog: a stopped process killed and named --------------------------------------------

def test_a_stopped_process_is_killed_and_named_by_its_nodes_watchdog(tmp_path):
    cfg = config(tmp_path, **{"sync.port": free_port(), "run.hang_timeout_s": 5.0})
    env = {**os.environ, "NODE_RANK": "7"}
    overrides = [f"sync.port={cfg.sync.port}", "run.hang_timeout_s=5.0"]
    watch = subprocess.Popen([sys.executable, "elastic.py", "watch", *overrides], cwd=REPO,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code = ("import sys, time; sys.path.insert(0, '.'); import common, elastic\n"
            f"p = elastic.Progress(common.load_config({overrides!r}), 'a role')\n"
            "while True:\n    p.made(); time.sleep(0.2)")
    try:
        deadline = time.time() + 60
        while not os.path.exists(elastic.watchdog_path(cfg)) and time.time() < deadline:
            time.sleep(0.1)
        role = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(8.0)
        assert role.poll() is None  # it makes progress: left alone
        role.send_signal(signal.SIGSTOP)
        assert role.wait(timeout=30) == -signal.SIGKILL
        line = "[watchdog] a role: no progress for 5 s (run.hang_timeout_s): killed"
        assert line in role.stderr.read()
    finally:
        watch.terminate()
        out = watch.communicate(timeout=30)[0]
    assert line in out, out


# --- the ledger over its socket: one process, its journal -----------------------------------------

def test_the_owner_process_answers_and_journals(tmp_path):
    cfg = config(tmp_path, **{"sync.port": free_port(), "ports.ledger": free_port()})
    overrides = [f"run.dir={tmp_path}", f"sync.port={cfg.sync.port}",
                 f"ports.ledger={cfg.ports.ledger}"]
    owner = subprocess.Popen([sys.executable, "elastic.py", *overrides], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        import weights_sync as ws
        store = ws.create_store("127.0.0.1", cfg.sync.port, False, 60)
        client = common.LedgerClient(cfg, store)
        assert client.request("actor_hello", pid=1, host="h") == {"inc": 1, "verifier": 0}
        with pytest.raises(RuntimeError, match="the ledger refused a request"):
            client.request("tickets", inc=1)
        assert client.request("members") == {"live": [1]}
    finally:
        owner.terminate()
        owner.wait(timeout=30)
    assert [e["event"] for e in journal(tmp_path)] == ["start", "hello"]
