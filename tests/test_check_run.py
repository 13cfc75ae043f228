"""Tier (a): scripts/check_run.py on run directories written by hand: a clean run holds every
invariant; each one broken by a one-record change is named, with exit status 1; each hole the
checker once had (groups by copy, drops by copy, the tail at the real end, numbering across a
resume, promise 3, stalls) is a run directory that must fail. Pure Python, no run.

Run: bash run.sh test tests/test_check_run.py      (< 5 s)
"""
import copy
import json
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from scripts import check_run, launch
from scripts.rundir import read_samples, timeline

GROUP_SIZE = 4
BATCH = 8  # two groups per step
MAX_LAG = 2
STEPS = 12
CONFIG = {"actor": {"schedule": "pipeline", "max_lag": MAX_LAG, "G_steps": 1,
                    "group_size": GROUP_SIZE},
          "trainer": {"batch_size": BATCH, "max_steps": STEPS},
          "sync": {"timeout_s": 60.0}, "run": {"hang_timeout_s": 30.0, "restart_s": 120.0}}


class Run:
    """A run as the roles write it: each trainer rank's samples records and the ledger's journal,
    kept consistent by construction. Step s (of epoch e) trains tickets made by `grant`; one ticket
    a group; every group id granted once, in order."""

    def __init__(self, ranks=1):
        self.ranks, self.records, self.journal = ranks, [], []
        self.next_ticket, self.next_group, self.epoch, self.time = 1, 0, 0, 1000.0
        self.note("start")
        self.note("hello", role="verifier", verifier=1)
        self.note("hello", role="actor", inc=1)
        self.order = 0

    def note(self, event, **fields):
        self.time += 0.1
        self.journal.append({"event": event, "time": self.time, **fields})

    def hello_trainer(self, step=0, redo=()):
        self.epoch += 1
        self.note("hello", role="trainer", epoch=self.epoch, step=step, redo=list(redo),
                  next=self.next_group)

    def grant(self, group=None):
        """A ticket issued, its samples pushed and forwarded -> (ticket, group)."""
        k, self.next_ticket = self.next_ticket, self.next_ticket + 1
        g = self.next_group if group is None else group
        self.next_group = max(self.next_group, g + 1)
        self.note("issued", ticket=k, group=g, inc=1, version=0, epoch=self.epoch)
        return k, g

    def forward(self, k):
        self.note("forwarded", tickets=[[k, self.order]], verifier=1)
        self.order += 1

    def step(self, step, pairs, lag=1):
        """Optimizer step `step` trains the tickets `pairs` [(ticket, group)], dealt to the ranks
        sample by sample; each sample's first 3 tokens `lag` versions behind, its last 2 on-policy."""
        for k, _ in pairs:
            self.forward(k)
        samples = [(k, g, i) for k, g in pairs for i in range(GROUP_SIZE)]
        for rank in range(self.ranks):
            mine = samples[rank::self.ranks]
            self.records.append({
                "step": step, "trainer_version": step - 1, "epoch": self.epoch, "rank": rank,
                "tickets": [k for k, _, _ in mine], "group_ids": [g for _, g, _ in mine],
                "sample_idx": [i for _, _, i in mine],
                "version_runs": [[[max(step - 1 - lag, 0), 3], [step - 1, 2]] for _ in mine]})
        self.note("trained", tickets=[k for k, _ in pairs], version=step, epoch=self.epoch)
        self.time += 1.0

    def steps(self, first=1, last=STEPS):
        for s in range(first, last + 1):
            self.step(s, [self.grant(), self.grant()])
        return self


def clean(ranks=1):
    run = Run(ranks)
    run.hello_trainer()
    return run.steps()


def write_run(path, run, config=CONFIG, done_at=None, step_times=None):
    """A run directory: config.yaml, each rank's samples file, ledger.jsonl, metrics_trainer.jsonl
    (a record per step at step_times, by default 1 s apart, then its `done` at done_at, by default
    the last step recorded)."""
    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    for r in run.records:
        name = f"samples_trainer.rank{r['rank']}.jsonl" if r["rank"] else "samples_trainer.jsonl"
        with open(path / name, "a") as f:
            f.write(json.dumps(r) + "\n")
    (path / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in run.journal))
    last = max((r["step"] for r in run.records), default=0)
    times = step_times or [1000.0 + s for s in range(1, last + 1)]
    metrics = [{"step": s, "time": t, "trainer/loss": 0.0} for s, t in zip(range(1, last + 1), times)]
    metrics.append({"step": done_at or last, "time": times[-1] if times else 0, "trainer/done": 1})
    (path / "metrics_trainer.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return path


def violated(run_dir) -> set:
    return {name for name, ok, _ in check_run.check(run_dir) if not ok}


def details(run_dir) -> dict:
    return {name: detail for name, _, detail in check_run.check(run_dir)}


def cli(run_dir):
    return subprocess.run([sys.executable, "scripts/check_run.py", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


# --- a clean run, and what the lines say ---------------------------------------------------------

def test_a_clean_run_holds_every_invariant(tmp_path):
    run = clean()
    run.grant()  # a ticket in flight at the end
    path = write_run(tmp_path / "run", run)
    with open(path / "samples_trainer.jsonl", "a") as f:
        f.write('{"step": 13, "trainer_ver')  # a writer killed mid-line: skipped
    r = cli(path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "check_run: lag: ok (480 tokens, lag 0..1, bound 2 (actor.max_lag))",
        "check_run: steps: ok (steps 1..12 on 1 rank(s), finished)",
        "check_run: groups: ok (24 tickets, 96 samples, group_size 4)",
        "check_run: tickets: ok (25 issued: 24 trained, 0 dropped, 0 given_back, 1 open (in flight "
        "at the end))",
        "check_run: ids: ok (ids 0..23: 24 trained, 0 dropped, 0 in flight at the end)",
        "check_run: stalls: ok (longest 1.0 s between steps, bound 210 s (sync.timeout_s + "
        "run.hang_timeout_s + run.restart_s))"]


def test_not_a_run_directory_exits_2(tmp_path):
    r = cli(tmp_path)
    assert r.returncode == 2 and "no config.yaml" in r.stderr, r.stderr
    assert check_run.clause(tmp_path) == ""


# --- each invariant broken by one change ---------------------------------------------------------

def set_lag(run, i, lag):
    """Record i's first sample: one token `lag` versions behind its trainer version."""
    run.records[i]["version_runs"][0] = [[run.records[i]["trainer_version"] - lag, 1]]


def move_sample(record, k, to):
    """Sample k of `record` trained in the step of record `to` instead."""
    for key in ("tickets", "group_ids", "sample_idx", "version_runs"):
        to[key].append(record[key].pop(k))


def drop_sample(record, k):
    for key in ("tickets", "group_ids", "sample_idx", "version_runs"):
        record[key].pop(k)


def untrain(run, k):
    """Ticket k neither in the samples records nor trained in the journal: given back instead, in
    its step, and its id never granted again though later grants came."""
    for r in run.records:
        for i in reversed([i for i, x in enumerate(r["tickets"]) if x == k]):
            drop_sample(r, i)
    for i, e in enumerate(run.journal):
        if e["event"] == "trained" and k in e["tickets"]:
            e["tickets"].remove(k)
            run.journal.insert(i + 1, {"event": "given_back", "tickets": [k], "why": "test",
                                       "time": e["time"]})
            return


def two_copies(run):
    """Group 4's samples 2, 3 taken from another copy (a ticket issued for it again)."""
    k, g = run.grant(group=4)
    r = run.records[2]
    for i in (2, 3):
        r["tickets"][i] = k


BROKEN = {
    "lag above max_lag": (lambda run: set_lag(run, 5, MAX_LAG + 1), {"lag"},
                          "step 6 rank 0 ticket 11 sample 0: lag 3 (1 token)"),
    "negative lag": (lambda run: set_lag(run, 5, -1), {"lag"}, "lag -1 (1 token)"),
    # step 3's record lost: its tickets trained by the journal, in no record
    "a step missing": (lambda run: run.records.pop(2), {"steps", "tickets", "ids"},
                       "step 3 missing on rank 0"),
    "a step twice": (lambda run: run.records.insert(3, copy.deepcopy(run.records[2])),
                     {"steps", "groups"}, "step 3 twice on rank 0"),
    "a sample twice": (lambda run: run.records[2]["sample_idx"].__setitem__(1, 0), {"groups"},
                       "ticket 5 (group 4): sample_idx [0, 0, 2, 3] (want 0..3 once each)"),
    "a group in part": (lambda run: drop_sample(run.records[2], 1), {"groups"},
                        "ticket 5 (group 4): sample_idx [0, 2, 3] (want 0..3 once each)"),
    "a group over two steps": (lambda run: move_sample(run.records[2], 0, run.records[3]),
                               {"groups"}, "ticket 5: trained in steps [3, 4] (want one)"),
    # the hole: samples 0..3 of group 4 from two copies, [5, 5, 25, 25], passed as one group
    "a group of two copies": (two_copies, {"groups", "tickets"},
                              "ticket 5 (group 4): sample_idx [0, 1] (want 0..3 once each)"),
    "an id given back and never granted again": (
        lambda run: untrain(run, 6), {"tickets"}, "got id 6 while id 5 waited to be granted again"),
    "the last step's record lost": (lambda run: run.records.pop(), {"steps", "tickets"},
                                    "the run finished at step 12, its samples records end at "
                                    "step 11"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_each_broken_invariant_is_named_and_exits_1(tmp_path, case):
    change, names, item = BROKEN[case]
    run = clean()
    change(run)
    path = write_run(tmp_path / "run", run, done_at=STEPS)
    assert violated(path) == names, check_run.check(path)
    r = cli(path)
    assert r.returncode == 1, r.stdout
    lines = [line for line in r.stdout.splitlines() if ": VIOLATED (" in line]
    order = ("lag", "steps", "groups", "tickets", "ids", "stalls")
    assert [line.split(": ")[1] for line in lines] == [n for n in order if n in names]
    assert item in r.stdout, r.stdout


# --- the holes: judged by copy, from the ledger's own records -------------------------------------

def test_a_dropped_copy_is_no_gap_and_a_copy_dropped_and_trained_in_one_epoch_is(tmp_path):
    run = clean()
    k, g = run.grant()
    run.note("dropped", ticket=k, group=g, why="zero_adv")
    run.step(STEPS + 1, [run.grant(), run.grant()])
    assert violated(write_run(tmp_path / "dropped", run)) == set()
    assert "1 dropped" in details(tmp_path / "dropped")["ids"]
    # id 7's copy (ticket 8) trained, and another copy of it dropped in the same epoch
    run = clean()
    k, g = run.grant(group=7)
    run.note("dropped", ticket=k, group=g, why="zero_adv")
    path = write_run(tmp_path / "both", run)
    assert violated(path) == {"tickets", "ids"}
    assert "id 7 dropped (ticket 25) and trained in epoch 1" in details(path)["ids"]


def test_a_ticket_closed_twice_or_never_issued_is_a_violation(tmp_path):
    run = clean()
    run.note("given_back", tickets=[3], why="test")  # already trained
    run.note("trained", tickets=[999], version=12, epoch=1)
    path = write_run(tmp_path / "run", run)
    assert violated(path) == {"tickets"}
    assert "ticket 3 given_back after trained" in details(path)["tickets"]
    assert "ticket 999 trained but never issued" in details(path)["tickets"]


def test_a_trained_ticket_the_journal_does_not_know_is_a_violation(tmp_path):
    """Promise 3 from both records: the trainer's and the ledger's must agree."""
    run = clean()
    run.journal = [e for e in run.journal if not (e["event"] == "trained" and 4 in e["tickets"])]
    path = write_run(tmp_path / "run", run)
    assert "ticket 3 trained (samples records) but not in the journal" in details(path)["tickets"]


def test_a_mid_run_give_back_far_below_the_end_is_in_flight_only_until_a_grant(tmp_path):
    """The hole: every incarnation's last given-up line read as "in flight at the end". Now: an id
    given back waits only until the next grant, which must take it (smallest first)."""
    run = Run()
    run.hello_trainer()
    run.steps(last=2)
    k, g = run.grant()  # id 4, given back, then new ids granted: it was skipped
    run.note("given_back", tickets=[k], why="actor incarnation 1 lost")
    run.step(3, [run.grant(group=5), run.grant(group=6)])
    path = write_run(tmp_path / "skipped", run)
    assert violated(path) == {"tickets"}
    assert "ticket 6 got id 5 while id 4 waited to be granted again" in details(path)["tickets"]
    # the same give-back at the real end (no grant after it): in flight, counted
    run = Run()
    run.hello_trainer()
    run.steps(last=3)
    k, g = run.grant()
    run.note("given_back", tickets=[k], why="actor incarnation 1 lost")
    path = write_run(tmp_path / "end", run)
    assert violated(path) == set()


def test_numbering_holds_across_a_resume_on_a_new_ledger(tmp_path):
    """The hole: cut and incarnation numbers restarted at 1 on a new store. A resumed ledger numbers
    tickets on from its journal's largest; one that numbered from 1 again is a violation."""
    run = clean()
    run.note("start")
    run.note("hello", role="actor", inc=1)  # an incarnation number reused
    run.next_ticket = 3  # a ticket number reused
    run.grant()
    path = write_run(tmp_path / "run", run)
    assert violated(path) == {"tickets"}
    assert {"ticket 3 issued twice", "actor incarnation 1 said hello 2 times"} <= set(
        details(path)["tickets"].split(": ", 1)[1].split("; "))


def test_a_stall_over_the_bound_is_a_violation_but_not_across_a_resume(tmp_path):
    run = clean()
    times = [1000.0 + s for s in range(1, 7)] + [1300.0 + s for s in range(7, 13)]
    path = write_run(tmp_path / "stall", run, step_times=times)
    assert violated(path) == {"stalls"}
    assert details(path)["stalls"] == "1: 301.0 s without a step after 5 s"
    run = clean()
    run.journal.insert(-10, {"event": "start", "time": 1100.0})  # the run resumed: a new start
    assert violated(write_run(tmp_path / "resumed", run, step_times=times)) == set()


# --- a resumed run: the timeline that stays ------------------------------------------------------

def resumed(regranted=True, listed=True):
    """Epoch 1 trains steps 1..8 and dies; epoch 2 resumes from the checkpoint at step 4 (ids 0..7
    done) and trains steps 5..12: ids 8..15 (trained in epoch 1's steps 5..8, superseded), listed
    to grant again at its hello when `listed`, granted again first when `regranted`, else new
    ids."""
    run = Run()
    run.hello_trainer()
    run.steps(last=8)
    redo = list(range(8, 16))
    run.hello_trainer(step=4, redo=redo if listed else [])
    for s in range(5, 13):
        first = redo.pop(0) if regranted and redo else None
        second = redo.pop(0) if regranted and redo else None
        run.step(s, [run.grant(first), run.grant(second)])
    return run


def test_a_resumed_run_counts_only_the_steps_that_stay(tmp_path):
    run = resumed()
    assert [r["step"] for r in timeline(run.records)] == list(range(1, STEPS + 1))
    assert [r["epoch"] for r in timeline(run.records)] == [1] * 4 + [2] * 8
    path = write_run(tmp_path / "run", run)
    assert violated(path) == set(), check_run.check(path)
    assert len(read_samples(path)) == 16


def test_ids_trained_only_in_redone_steps_are_a_gap(tmp_path):
    """The restarted trainer's ledger grants new ids and never epoch 1's 8..15, trained only in the
    steps it redid: listed to grant again and skipped (the ledger's books), or forgotten (the
    trainer's records)."""
    path = write_run(tmp_path / "skipped", resumed(regranted=False))
    assert violated(path) == {"tickets"}
    assert "ticket 17 got id 16 while id 8 waited" in details(path)["tickets"]
    path = write_run(tmp_path / "forgotten", resumed(regranted=False, listed=False))
    assert violated(path) == {"ids"}
    assert details(path)["ids"].startswith("8: id 8 neither trained nor dropped")


def test_a_run_resumed_on_more_ranks_wants_each_step_on_its_own_epochs_ranks(tmp_path):
    run = resumed()
    for r in list(run.records):
        if r["epoch"] == 2:
            half = {key: r[key][1::2] for key in ("tickets", "group_ids", "sample_idx",
                                                  "version_runs")}
            for key in half:
                r[key] = r[key][0::2]
            run.records.append({**r, **half, "rank": 1})
    path = write_run(tmp_path / "run", run)
    assert violated(path) == set(), check_run.check(path)
    lost = [r for r in run.records if (r["step"], r["rank"], r["epoch"]) != (6, 1, 2)]
    run.records = lost
    path = write_run(tmp_path / "lost", run)
    assert details(path)["steps"] == "1: step 6 missing on rank 1"


# --- two ranks' files merged ---------------------------------------------------------------------

def test_two_ranks_merge_and_a_rank_missing_a_step_is_named(tmp_path):
    run = clean(ranks=2)
    path = write_run(tmp_path / "two", run)
    assert (path / "samples_trainer.rank1.jsonl").exists()
    assert violated(path) == set(), check_run.check(path)
    assert "steps 1..12 on 2 rank(s)" in details(path)["steps"]
    run.records = [r for r in run.records if (r["step"], r["rank"]) != (3, 1)]
    path = write_run(tmp_path / "lost", run)
    assert violated(path) == {"steps", "groups"}  # rank 1's half of step 3's groups went with it
    assert details(path)["steps"] == "1: step 3 missing on rank 1"


# --- run.sh's closing summary --------------------------------------------------------------------

def test_the_summary_says_the_verdict_in_one_clause(tmp_path):
    ok = write_run(tmp_path / "ok", clean())
    assert launch.summary(str(ok)).endswith(" | invariants: ok")
    run = clean()
    set_lag(run, 5, MAX_LAG + 1)
    drop_sample(run.records[2], 1)
    bad = write_run(tmp_path / "bad", run)
    assert launch.summary(str(bad)).endswith(" | invariants: VIOLATED (lag, groups)")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert launch.summary(str(empty)) == "[run.sh] summary: 0 steps"
