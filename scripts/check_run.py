"""Checks a run directory, finished, killed or resumed, against what every run must hold.

    .venv/bin/python scripts/check_run.py RUN_DIR

One line per invariant, `check_run: <name>: ok (<figures>)` or `check_run: <name>: VIOLATED
(<count>: <the first offending items>)`; exit status 1 on any violation, 2 when RUN_DIR holds no
config.yaml. Read from the timeline that stays (scripts/rundir.py: every trainer rank's samples
records, a restarted trainer's replacing the steps it redid):

  lag     every trained token has 0 <= lag <= bound, lag = the trainer's version - the version that
          sampled it; bound = actor.max_lag (pipeline), actor.G_steps - 1 (conventional: an RL
          step's samples train G_steps versions)
  steps   steps 1..N each once on every trainer rank of its epoch (N = the largest); a finished run
          (trainer/done in metrics_trainer.jsonl) ends at its last step
  groups  every trained group has actor.group_size samples, sample_idx 0..group_size-1 once each
          (where recorded; else the count), across ranks, all in one step
  ids     every group id below the largest trained one is trained or dropped by the verifier
          (groups_dropped.jsonl), no copy both (a dropped id may be generated again in a later
          cut, or by another incarnation once its dropper was lost): a cut generates the others
          again (elastic.Ledger).
          Untrained ids within K of the largest, or that an actor gave up at the run's end, are
          still in flight at the end and only counted:
          K = (max_lag + 2) * B / group_size (pipeline: the lag budget's groups and one step's
          more), 2 * G_steps * B / group_size (conventional: two RL steps' groups). A skipped id
          says where it went, when known: given up by an actor (metrics_actor.jsonl), or trained
          only in steps a restarted trainer redid.

Importable: check(run_dir) -> [(name, ok, detail)]; clause(run_dir), the verdict as
scripts/launch.py's summary prints it.
"""
import sys
from collections import Counter, defaultdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.rundir import (read_dropped, read_given_up, read_jsonl,  # noqa: E402
                            read_samples, timeline)

SHOWN = 5  # offending items listed on a VIOLATED line


def verdict(name: str, problems: list, ok_detail: str) -> tuple:
    """(name, ok, detail): the figures when nothing offends, else the count and the first few."""
    if not problems:
        return name, True, ok_detail
    shown = "; ".join(problems[:SHOWN])
    more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return name, False, f"{len(problems)}: {shown}{more}"


def where(r: dict, k: int) -> str:
    """Sample k of samples record r, as an item of a VIOLATED line."""
    idx = f" sample {r['sample_idx'][k]}" if r["sample_idx"] is not None else ""
    return f"step {r['step']} rank {r['rank']} group {r['group_ids'][k]}{idx}"


def check_lag(kept: list, actor: dict) -> tuple:
    conventional = actor["schedule"] == "conventional"
    bound = actor["G_steps"] - 1 if conventional else actor["max_lag"]
    source = "actor.G_steps - 1" if conventional else "actor.max_lag"
    tokens = 0
    lags = set()
    problems = []
    for r in kept:
        version = r.get("trainer_version", r["step"] - 1)
        for k, runs in enumerate(r["version_runs"]):
            for v, n in runs:
                lag = version - v
                tokens += n
                lags.add(lag)
                if not 0 <= lag <= bound:
                    problems.append(f"{where(r, k)}: lag {lag} ({n} token{'s' * (n != 1)})")
    seen = f"lag {min(lags)}..{max(lags)}" if lags else "no lag"
    return verdict("lag", problems, f"{tokens} tokens, {seen}, bound {bound} ({source})")


def check_steps(kept: list, finished_at) -> tuple:
    ranks_of = defaultdict(set)  # epoch -> the ranks that wrote records in it
    per_step = defaultdict(Counter)  # step -> records per rank
    epochs_at = defaultdict(set)  # step -> the epochs of its records
    for r in kept:
        ranks_of[r["epoch"]].add(r["rank"])
        per_step[r["step"]][r["rank"]] += 1
        epochs_at[r["step"]].add(r["epoch"])
    every_rank = set().union(*ranks_of.values())
    last = max(per_step, default=0)
    problems = []
    for step in range(1, last + 1):
        # a resumed run may run on another number of ranks: a step wants its epoch's ranks
        expected = set().union(*(ranks_of[e] for e in epochs_at[step])) or every_rank
        missing = sorted(expected - set(per_step[step]))
        twice = sorted(rank for rank, n in per_step[step].items() if n > 1)
        if missing:
            problems.append(f"step {step} missing on rank {', '.join(map(str, missing))}")
        if twice:
            problems.append(f"step {step} twice on rank {', '.join(map(str, twice))}")
    if finished_at is not None and finished_at != last:
        problems.append(f"the run finished at step {finished_at}, its samples records end at "
                        f"step {last}")
    state = "finished" if finished_at is not None else "not finished"
    return verdict("steps", problems,
                   f"steps 1..{last} on {len(every_rank)} rank(s), {state}")


def trained_samples(records: list) -> dict:
    """group id -> the sample_idx of each of its samples in `records` (None: not recorded)."""
    samples = defaultdict(list)
    for r in records:
        idx = r["sample_idx"] or [None] * len(r["group_ids"])
        for g, i in zip(r["group_ids"], idx):
            samples[g].append(i)
    return samples


def check_groups(samples: dict, group_size: int, kept: list) -> tuple:
    steps_of = defaultdict(set)
    for r in kept:
        for g in r["group_ids"]:
            steps_of[g].add(r["step"])
    problems = [f"group {g}: trained in steps {', '.join(map(str, sorted(steps_of[g])))} (want one)"
                for g in sorted(steps_of) if len(steps_of[g]) > 1]
    for g in sorted(samples):
        got = samples[g]
        if None in got:
            if len(got) != group_size:
                problems.append(f"group {g}: {len(got)} samples (want {group_size})")
        elif sorted(got) != list(range(group_size)):
            problems.append(f"group {g}: sample_idx {sorted(got)} (want 0..{group_size - 1} "
                            "once each)")
    n_samples = sum(len(got) for got in samples.values())
    return verdict("groups", problems,
                   f"{len(samples)} groups, {n_samples} samples, group_size {group_size}")


def check_ids(run_dir, kept: list, records: list, cfg: dict) -> tuple:
    actor = cfg["actor"]
    batch_size = cfg["trainer"]["batch_size"]
    if actor["schedule"] == "conventional":
        tail = 2 * actor["G_steps"] * batch_size // actor["group_size"]
    else:
        tail = (actor["max_lag"] + 2) * batch_size // actor["group_size"]
    trained = set(trained_samples(kept))
    top = max(trained, default=-1)
    dropped = {d["group_id"]: d.get("reason", "?") for d in read_dropped(run_dir)}
    # a group dropped in a cut (that cut's verifier held it), or by an incarnation since lost, may
    # be generated again, in a later cut or by another incarnation: only the same copy is both
    trained_in = defaultdict(set)
    for r in kept:
        for g, inc in zip(r["group_ids"], r.get("incs") or [None] * len(r["group_ids"])):
            trained_in[g].add((r.get("cut"), inc))
    dropped_in = defaultdict(set)
    for d in read_dropped(run_dir):
        dropped_in[d["group_id"]].add((d.get("cut"), d.get("inc")))
    problems = [f"group {g} dropped ({dropped[g]}) and trained"
                for g in sorted(trained & set(dropped)) if trained_in[g] & dropped_in[g]]
    finished = read_given_up(run_dir, at_end=True)
    skipped = [g for g in range(top + 1) if g not in trained and g not in dropped]
    below_tail = [g for g in skipped if g <= top - tail and g not in finished]
    # where a skipped id went, when the run's files say
    given_up = read_given_up(run_dir)
    kept_ids = {id(r) for r in kept}
    superseded = set(trained_samples([r for r in records if id(r) not in kept_ids]))
    for g in below_tail:
        fate = ""
        if g in given_up:
            fate = " (given up by an actor)"
        elif g in superseded:
            fate = " (trained only in steps a restarted trainer redid)"
        problems.append(f"id {g} neither trained nor dropped{fate}")
    n_dropped = sum(g in dropped for g in range(top + 1))
    return verdict("ids", problems,
                   f"ids 0..{top}: {len(trained)} trained, {n_dropped} dropped, "
                   f"{len(skipped) - len(below_tail)} in flight at the end (the last {tail} ids)")


def check(run_dir) -> list:
    """[(name, ok, detail)] for lag, steps, groups and ids (the module's docstring); raises
    FileNotFoundError when run_dir holds no config.yaml."""
    run_dir = Path(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    records = read_samples(run_dir)
    kept = timeline(records)
    metrics = read_jsonl(run_dir / "metrics_trainer.jsonl")
    finished_at = metrics[-1]["step"] if metrics and "trainer/done" in metrics[-1] else None
    return [check_lag(kept, cfg["actor"]),
            check_steps(kept, finished_at),
            check_groups(trained_samples(kept), cfg["actor"]["group_size"], kept),
            check_ids(run_dir, kept, records, cfg)]


def clause(run_dir) -> str:
    """The verdict in one clause, `invariants: ok` or `invariants: VIOLATED (lag, groups)`; ""
    where run_dir holds no config.yaml. Never raises: run.sh's closing summary prints it."""
    try:
        results = check(run_dir)
    except FileNotFoundError:
        return ""
    except (KeyError, TypeError, ValueError, yaml.YAMLError) as e:
        return f"invariants: unknown (unreadable records: {type(e).__name__}: {e})"
    violated = [name for name, ok, _ in results if not ok]
    return f"invariants: VIOLATED ({', '.join(violated)})" if violated else "invariants: ok"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python scripts/check_run.py RUN_DIR", file=sys.stderr)
        return 2
    try:
        results = check(argv[0])
    except FileNotFoundError:
        print(f"check_run: {argv[0]}: no config.yaml, not a run directory", file=sys.stderr)
        return 2
    for name, ok, detail in results:
        print(f"check_run: {name}: {'ok' if ok else 'VIOLATED'} ({detail})")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
