"""Tier (a): scripts/check_run.py on run directories written by hand: a clean run holds every
invariant; each one broken by a one-record change is named, with exit status 1; a resumed run's
redone steps, two ranks' files and the groups still in flight at the end are read as a run writes
them. Pure Python, no run.

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
STEPS = 12  # ids 0..23; the tail: (MAX_LAG + 2) * BATCH // GROUP_SIZE = 8 ids, 16..23
CONFIG = {"actor": {"schedule": "pipeline", "max_lag": MAX_LAG, "G_steps": 1,
                    "group_size": GROUP_SIZE},
          "trainer": {"batch_size": BATCH, "max_steps": STEPS}}


def step_records(step, group_ids, ranks=1, epoch=1, lag=1):
    """One optimizer step's samples records, one per rank: its groups whole, dealt to the ranks
    sample by sample (each group split across them); each sample's first 3 tokens `lag` versions
    behind, its last 2 on-policy."""
    samples = [(g, k) for g in group_ids for k in range(GROUP_SIZE)]
    out = []
    for rank in range(ranks):
        mine = samples[rank::ranks]
        out.append({"step": step, "trainer_version": step - 1, "epoch": epoch, "cut": 1,
                    "rank": rank, "group_ids": [g for g, _ in mine],
                    "sample_idx": [k for _, k in mine], "incs": [1] * len(mine),
                    "version_runs": [[[max(step - 1 - lag, 0), 3], [step - 1, 2]]
                                     for _ in mine]})
    return out


def clean(steps=STEPS, ranks=1, first=1, epoch=1, first_id=None):
    """Steps first..steps, step s training groups 2s-2 and 2s-1 (or from first_id on)."""
    records = []
    for s in range(first, steps + 1):
        g = 2 * (s - 1) if first_id is None else first_id + 2 * (s - first)
        records += step_records(s, [g, g + 1], ranks, epoch)
    return records


def write_run(path, records, config=CONFIG, dropped=(), given_up=(), done_at=None, given_up_at_end=()):
    """A run directory: config.yaml, each rank's samples file (records in the order given),
    groups_dropped.jsonl, metrics_actor.jsonl, metrics_trainer.jsonl (its `done` record at step
    done_at, by default the last step recorded)."""
    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    for r in records:
        rank = r.get("rank", 0)
        name = f"samples_trainer.rank{rank}.jsonl" if rank else "samples_trainer.jsonl"
        with open(path / name, "a") as f:
            f.write(json.dumps(r) + "\n")
    if dropped:  # ids, or (id, the incarnation that dropped it)
        dropped = [d if isinstance(d, tuple) else (d, 1) for d in dropped]
        (path / "groups_dropped.jsonl").write_text("".join(
            json.dumps({"group_id": g, "inc": inc, "cut": 1, "size": GROUP_SIZE, "reason": "zero_adv",
                        "time": 0.0}) + "\n" for g, inc in dropped))
    # given up mid-run (a cut, an exclusion), then the incarnation's last line (given_up_at_end)
    (path / "metrics_actor.jsonl").write_text(
        json.dumps({"step": 0, "actor/inc": 1, "actor/groups_given_up": list(given_up)}) + "\n"
        + json.dumps({"step": 1, "actor/inc": 1, "actor/groups_given_up": list(given_up_at_end)}) + "\n")
    last = max((r["step"] for r in records), default=0)
    metrics = [{"step": s, "trainer/loss": 0.0} for s in range(1, last + 1)]
    metrics.append({"step": done_at or last, "trainer/done": 1})
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
    run = write_run(tmp_path / "run", clean())
    with open(run / "samples_trainer.jsonl", "a") as f:
        f.write('{"step": 13, "trainer_ver')  # a writer killed mid-line: skipped
    r = cli(run)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "check_run: lag: ok (480 tokens, lag 0..1, bound 2 (actor.max_lag))",
        "check_run: steps: ok (steps 1..12 on 1 rank(s), finished)",
        "check_run: groups: ok (24 groups, 96 samples, group_size 4)",
        "check_run: ids: ok (ids 0..23: 24 trained, 0 dropped, 0 in flight at the end (the last 8 "
        "ids))"]


def test_not_a_run_directory_exits_2(tmp_path):
    r = cli(tmp_path)
    assert r.returncode == 2 and "no config.yaml" in r.stderr, r.stderr
    assert check_run.clause(tmp_path) == ""


# --- each invariant broken by one change ---------------------------------------------------------

def set_lag(records, i, lag):
    """Record i's first sample: one token `lag` versions behind its trainer version."""
    records[i]["version_runs"][0] = [[records[i]["trainer_version"] - lag, 1]]


def drop_sample(record, k):
    for key in ("group_ids", "sample_idx", "incs", "version_runs"):
        record[key].pop(k)


def move_sample(record, k, to):
    """Sample k of `record` trained in the step of record `to` instead."""
    for key in ("group_ids", "sample_idx", "incs", "version_runs"):
        to[key].append(record[key].pop(k))


def drop_group(record, g):
    for k in reversed([k for k, x in enumerate(record["group_ids"]) if x == g]):
        drop_sample(record, k)


BROKEN = {
    # a token one version older than max_lag allows
    "lag above max_lag": (lambda rs: set_lag(rs, 5, MAX_LAG + 1), {"lag"},
                          "step 6 rank 0 group 10 sample 0: lag 3 (1 token)"),
    # a token sampled by a version newer than the one trained
    "negative lag": (lambda rs: set_lag(rs, 5, -1), {"lag"}, "lag -1 (1 token)"),
    # step 3 lost, and its groups 4 and 5 with it (below the tail)
    "a step missing": (lambda rs: rs.pop(2), {"steps", "ids"}, "step 3 missing on rank 0"),
    # step 3 written twice in one epoch: its groups trained twice too
    "a step twice": (lambda rs: rs.insert(3, copy.deepcopy(rs[2])), {"steps", "groups"},
                     "step 3 twice on rank 0"),
    "a sample twice": (lambda rs: rs[2]["sample_idx"].__setitem__(1, 0), {"groups"},
                       "group 4: sample_idx [0, 0, 2, 3] (want 0..3 once each)"),
    "a group in part": (lambda rs: drop_sample(rs[2], 1), {"groups"},
                        "group 4: sample_idx [0, 2, 3] (want 0..3 once each)"),
    "a group over two steps": (lambda rs: move_sample(rs[2], 0, rs[3]), {"groups"},
                               "group 4: trained in steps 3, 4 (want one)"),
    "an id skipped below the tail": (lambda rs: drop_group(rs[2], 5), {"ids"},
                                     "id 5 neither trained nor dropped"),
    # finished at step 12 by its metrics, the last step's samples record lost (its groups are
    # above the largest trained id: no gap)
    "the last step's record lost": (lambda rs: rs.pop(), {"steps"},
                                    "the run finished at step 12, its samples records end at "
                                    "step 11"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_each_broken_invariant_is_named_and_exits_1(tmp_path, case):
    change, names, item = BROKEN[case]
    records = clean()
    change(records)
    run = write_run(tmp_path / "run", records, done_at=STEPS)
    assert violated(run) == names
    r = cli(run)
    assert r.returncode == 1, r.stdout
    lines = [line for line in r.stdout.splitlines() if ": VIOLATED (" in line]
    assert [line.split(": ")[1] for line in lines] == [n for n in ("lag", "steps", "groups", "ids")
                                                       if n in names]
    assert item in r.stdout, r.stdout


def test_a_dropped_group_is_no_gap_and_a_dropped_group_trained_is_a_violation(tmp_path):
    records = clean()
    drop_group(records[2], 5)
    assert violated(write_run(tmp_path / "dropped", records, dropped=[5])) == set()
    assert "1 dropped" in details(tmp_path / "dropped")["ids"]
    both = write_run(tmp_path / "both", clean(), dropped=[7])
    assert violated(both) == {"ids"}
    assert details(both)["ids"] == "1: group 7 dropped (zero_adv) and trained"
    # incarnation 2's copy dropped, then (2 lost) generated again by incarnation 1 and trained: its fate
    assert violated(write_run(tmp_path / "again", clean(), dropped=[(7, 2)])) == set()


def test_a_group_an_actor_gave_up_and_never_generated_again_is_a_gap_said_so(tmp_path):
    """A cut generates the ids given up at it again (elastic.Ledger.start_cut)."""
    records = clean()
    drop_group(records[2], 5)
    run = write_run(tmp_path / "run", records, given_up=[5])
    assert details(run)["ids"] == "1: id 5 neither trained nor dropped (given up by an actor)"


def test_a_group_an_actor_gave_up_at_the_end_of_a_finished_run_was_in_flight(tmp_path):
    """The actors give up what is in flight when the trainer says "done": ids below the tail too (a group
    generated again late), counted, not a gap; in a run that did not finish, a gap."""
    records = clean()
    drop_group(records[2], 5)
    run = write_run(tmp_path / "run", records, given_up_at_end=[5])
    assert violated(run) == set() and "1 in flight at the end" in details(run)["ids"]
    metrics = tmp_path / "run" / "metrics_trainer.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:-1]))
    assert violated(run) == {"ids"}


# --- the tail still in flight at the end ---------------------------------------------------------

def test_untrained_ids_in_the_tail_are_counted_and_below_it_are_not(tmp_path):
    """The tail is the 8 ids below the largest trained one (23): 16..23."""
    records = clean()
    drop_group(records[8], 17)  # step 9: groups 16, 17
    drop_group(records[9], 18)  # step 10: groups 18, 19
    run = write_run(tmp_path / "tail", records)
    assert violated(run) == set()
    assert "2 in flight at the end (the last 8 ids)" in details(run)["ids"]
    records = clean()
    drop_group(records[7], 15)  # the largest id outside the tail
    assert violated(write_run(tmp_path / "below", records)) == {"ids"}


def test_conventional_bounds_lag_by_g_steps_and_its_tail_by_two_rl_steps(tmp_path):
    config = copy.deepcopy(CONFIG)
    config["actor"].update(schedule="conventional", G_steps=2, max_lag=3)
    assert violated(write_run(tmp_path / "ok", clean(), config)) == set()
    # an RL step of G_steps=2 trains versions v and v+1 on samples of v: lag 2 is one too many
    records = clean()
    set_lag(records, 5, 2)
    run = write_run(tmp_path / "lag", records, config)
    assert violated(run) == {"lag"}
    assert "bound 1 (actor.G_steps - 1)" in details(tmp_path / "ok")["lag"]
    # the tail: 2 * G_steps * B // group_size = 8 ids, as pipeline's here
    assert "(the last 8 ids)" in details(tmp_path / "ok")["ids"]


# --- a resumed run: the timeline that stays ------------------------------------------------------

def resumed(first_id=None, with_epochs=True):
    """Epoch 1 writes steps 1..8 and dies; epoch 2 restarts from the checkpoint at step 4 and
    writes steps 5..12 (epoch 1's steps 5..8 superseded)."""
    records = clean(steps=8, epoch=1) + clean(first=5, epoch=2, first_id=first_id)
    if not with_epochs:
        for r in records:
            del r["epoch"], r["rank"], r["cut"], r["sample_idx"]
    return records


def test_a_resumed_run_counts_only_the_steps_that_stay(tmp_path):
    records = resumed()
    assert [r["step"] for r in timeline(records)] == list(range(1, STEPS + 1))
    assert [r["epoch"] for r in timeline(records)] == [1] * 4 + [2] * 8
    run = write_run(tmp_path / "run", records)
    assert violated(run) == set(), check_run.check(run)
    # all records read as one timeline would train steps 5..8 and groups 8..15 twice
    assert len(read_samples(run)) == 16


def test_records_without_epochs_start_one_where_the_step_goes_back(tmp_path):
    run = write_run(tmp_path / "run", resumed(with_epochs=False))
    assert [r["epoch"] for r in read_samples(run)] == [0] * 8 + [1] * 8
    assert violated(run) == set(), check_run.check(run)


def test_ids_trained_only_in_redone_steps_are_a_gap_said_so(tmp_path):
    """The restarted trainer trains new ids (16.. on) and never epoch 1's 8..15, trained only in
    the steps it redid (its cut should have generated them again)."""
    run = write_run(tmp_path / "run", resumed(first_id=16))
    assert violated(run) == {"ids"}
    assert details(run)["ids"].startswith(
        "8: id 8 neither trained nor dropped (trained only in steps a restarted trainer redid)")


def test_a_run_resumed_on_more_ranks_wants_each_step_on_its_own_epochs_ranks(tmp_path):
    """Epoch 1 on one rank (steps 1..8), epoch 2 from step 5 on two: steps 1..4 want rank 0 only,
    steps 5..12 both."""
    records = clean(steps=8, epoch=1) + clean(first=5, epoch=2, ranks=2)
    run = write_run(tmp_path / "run", records)
    assert violated(run) == set(), check_run.check(run)
    lost = [r for r in records if (r["step"], r["rank"], r["epoch"]) != (6, 1, 2)]
    run = write_run(tmp_path / "lost", lost)
    assert details(run)["steps"] == "1: step 6 missing on rank 1"


# --- two ranks' files merged ---------------------------------------------------------------------

def test_two_ranks_merge_and_a_rank_missing_a_step_is_named(tmp_path):
    records = clean(ranks=2)
    run = write_run(tmp_path / "two", records)
    assert (run / "samples_trainer.rank1.jsonl").exists()
    assert violated(run) == set(), check_run.check(run)
    assert "steps 1..12 on 2 rank(s)" in details(run)["steps"]
    lost = [r for r in records if (r["step"], r["rank"]) != (3, 1)]
    run = write_run(tmp_path / "lost", lost)
    assert violated(run) == {"steps", "groups"}  # rank 1's half of groups 4 and 5 went with it
    assert details(run)["steps"] == "1: step 3 missing on rank 1"


# --- run.sh's closing summary --------------------------------------------------------------------

def test_the_summary_says_the_verdict_in_one_clause(tmp_path):
    ok = write_run(tmp_path / "ok", clean())
    assert launch.summary(str(ok)).endswith(" | invariants: ok")
    records = clean()
    set_lag(records, 5, MAX_LAG + 1)
    drop_sample(records[2], 1)
    bad = write_run(tmp_path / "bad", records)
    assert launch.summary(str(bad)).endswith(" | invariants: VIOLATED (lag, groups)")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert launch.summary(str(empty)) == "[run.sh] summary: 0 steps"
