"""Checks a run directory, finished, killed or resumed, against what every run must hold.

    .venv/bin/python scripts/check_run.py RUN_DIR

One line per invariant, `check_run: <name>: ok (<figures>)` or `check_run: <name>: VIOLATED
(<count>: <the first offending items>)`; exit status 1 on any violation, 2 when RUN_DIR holds no
config.yaml. Read from two independent records: the trainer ranks' samples records (the timeline
that stays: scripts/rundir.py, a restarted trainer's records replacing the steps it redid) and the
ledger's journal, ledger.jsonl (elastic.py: every ticket issued, forwarded, trained, dropped and
given back, and every hello).

  lag      every trained token has 0 <= lag <= bound, lag = the trainer's version - the version
           that sampled it; bound = actor.max_lag (pipeline), actor.G_steps - 1 (conventional); an
           environment's tokens (version -1, envs.py) are not the model's: counted apart
  steps    steps 1..N each once on every trainer rank of its epoch; a finished run ends at its last
  groups   judged by copy (ticket): every trained ticket has actor.group_size samples, sample_idx
           0..group_size-1 once each, across ranks, all in one step; no group id trained by two
           tickets
  tickets  the journal's own books: every ticket issued once (numbering holds across a resume),
           closed at most once (trained, dropped or given back), forwarded before it is trained;
           and they agree with the trainer's: the tickets the journal says trained (in steps that
           stay) are exactly those the samples records hold. Every sample started is then
           trained, dropped, given back, or in flight at the end (counted)
  ids      every group id below the largest trained is trained, dropped, or in flight when the
           journal ends (held by an open ticket, or given back and not yet granted again: the
           ledger grants those first, smallest first, and `tickets` checks it did); within one
           trainer epoch no id is both dropped and trained
  stalls   no gap between two trainer steps over sync.timeout_s + run.hang_timeout_s +
           run.restart_s (a hang found, its role started again), but across a resumed run's new
           start

Importable: check(run_dir) -> [(name, ok, detail)]; clause(run_dir), the verdict as
scripts/launch.py's summary prints it.
"""
import sys
from collections import Counter, defaultdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.rundir import read_jsonl, read_samples, timeline  # noqa: E402

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
    return f"step {r['step']} rank {r['rank']} ticket {r['tickets'][k]} sample {r['sample_idx'][k]}"


def check_lag(kept: list, actor: dict) -> tuple:
    conventional = actor["schedule"] == "conventional"
    bound = actor["G_steps"] - 1 if conventional else actor["max_lag"]
    source = "actor.G_steps - 1" if conventional else "actor.max_lag"
    tokens, env_tokens, lags, problems = 0, 0, set(), []
    for r in kept:
        for k, runs in enumerate(r["version_runs"]):
            for v, n in runs:
                if v == -1:
                    env_tokens += n
                    continue
                lag = r["trainer_version"] - v
                tokens += n
                lags.add(lag)
                if not 0 <= lag <= bound:
                    problems.append(f"{where(r, k)}: lag {lag} ({n} token{'s' * (n != 1)})")
    seen = f"lag {min(lags)}..{max(lags)}" if lags else "no lag"
    env = f", {env_tokens} environment tokens" if env_tokens else ""
    return verdict("lag", problems, f"{tokens} tokens{env}, {seen}, bound {bound} ({source})")


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
    return verdict("steps", problems, f"steps 1..{last} on {len(every_rank)} rank(s), {state}")


def trained_tickets(kept: list) -> dict:
    """ticket -> {"group": its group id, "steps": {step}, "idx": [sample_idx ...]} in `kept`."""
    out = {}
    for r in kept:
        for g, k, i in zip(r["group_ids"], r["tickets"], r["sample_idx"]):
            t = out.setdefault(k, {"group": g, "steps": set(), "idx": []})
            t["steps"].add(r["step"])
            t["idx"].append(i)
    return out


def check_groups(trained: dict, group_size: int) -> tuple:
    problems, by_group = [], defaultdict(list)
    for k, t in sorted(trained.items()):
        by_group[t["group"]].append(k)
        if len(t["steps"]) > 1:
            problems.append(f"ticket {k}: trained in steps {sorted(t['steps'])} (want one)")
        if sorted(t["idx"]) != list(range(group_size)):
            problems.append(f"ticket {k} (group {t['group']}): sample_idx {sorted(t['idx'])} "
                            f"(want 0..{group_size - 1} once each)")
    problems += [f"group {g} trained by tickets {tickets} (want one)"
                 for g, tickets in sorted(by_group.items()) if len(tickets) > 1]
    n = sum(len(t["idx"]) for t in trained.values())
    return verdict("groups", problems, f"{len(trained)} tickets, {n} samples, group_size "
                   f"{group_size}")


def replay(journal: list) -> dict:
    """The journal, replayed: every ticket's group and events, the trained events, where each
    trainer epoch resumed, the ids waiting to be granted again at the end, and the problems the
    journal shows by itself (a number twice, a ticket closed twice or never issued)."""
    tickets, trained, resumed, problems = {}, [], {}, []
    redo, incs, fresh = set(), Counter(), 0  # (fresh: the next new id the ledger may grant)
    for e in journal:
        kind = e.get("event")
        if kind == "hello" and e.get("role") == "actor":
            incs[e["inc"]] += 1
        if kind == "hello" and e.get("role") == "trainer":
            resumed[e["epoch"]] = e["step"]
            redo, fresh = set(e["redo"]), e["next"]
        if kind == "issued":
            if e["ticket"] in tickets:
                problems.append(f"ticket {e['ticket']} issued twice")
            if redo and e["group"] != min(redo):  # the ids given back go first, smallest first
                problems.append(f"ticket {e['ticket']} got id {e['group']} while id {min(redo)} "
                                "waited to be granted again")
            elif not redo and e["group"] != fresh:  # else the next new one
                problems.append(f"ticket {e['ticket']} got id {e['group']}, not the next new id "
                                f"{fresh}")
            fresh = max(fresh, e["group"] + 1)
            tickets[e["ticket"]] = {"group": e["group"], "events": [], "epoch": e["epoch"]}
            redo.discard(e["group"])
            continue
        if kind == "forwarded":
            named = [k for k, _ in e["tickets"]]
        elif kind in ("trained", "given_back"):
            named = e["tickets"]
        elif kind == "dropped":
            named = [e["ticket"]]
        else:
            continue
        for k in named:
            if k not in tickets:
                problems.append(f"ticket {k} {kind} but never issued")
                continue
            t = tickets[k]
            closed = [x for x in t["events"] if x != "forwarded"]
            if kind != "forwarded" and closed:
                problems.append(f"ticket {k} {kind} after {closed[0]}")
            if kind == "trained" and "forwarded" not in t["events"]:
                problems.append(f"ticket {k} trained but never forwarded")
            t["events"].append(kind)
            if kind == "given_back":
                redo.add(t["group"])
        if kind == "trained":
            trained.append(e)
    problems += [f"actor incarnation {i} said hello {n} times" for i, n in incs.items() if n > 1]
    return {"tickets": tickets, "trained": trained, "resumed": resumed, "redo": redo,
            "problems": problems}


def superseded(event: dict, resumed: dict) -> bool:
    """A trained event of an epoch that a later trainer epoch resumed before (from a step below the
    version it made): its step is not in the timeline that stays."""
    return any(epoch > event["epoch"] and step < event["version"]
               for epoch, step in resumed.items())


def check_tickets(books: dict, trained: dict) -> tuple:
    problems = list(books["problems"])
    said = {k for e in books["trained"] if not superseded(e, books["resumed"]) for k in e["tickets"]}
    problems += [f"ticket {k} trained (samples records) but not in the journal"
                 for k in sorted(set(trained) - said)]
    problems += [f"ticket {k} trained (journal) but in no samples record that stays"
                 for k in sorted(said - set(trained))]
    fates = Counter(t["events"][-1] if t["events"] else "open" for t in books["tickets"].values())
    fates["open"] += fates.pop("forwarded", 0)  # forwarded and neither trained nor lost: open
    shown = ", ".join(f"{fates[k]} {k}" for k in ("trained", "dropped", "given_back", "open"))
    return verdict("tickets", problems, f"{len(books['tickets'])} issued: {shown} (in flight at "
                   "the end)")


def check_ids(books: dict, trained: dict) -> tuple:
    done = {t["group"] for t in trained.values()}
    dropped = {t["group"] for t in books["tickets"].values() if t["events"][-1:] == ["dropped"]}
    # by copy: within one trainer epoch an id is trained or dropped, not both (across a restart
    # an id dropped after the checkpoint may be generated again and trained)
    trained_in = {(t["group"], books["tickets"][k]["epoch"]) for k, t in trained.items()
                  if k in books["tickets"]}
    both = [f"id {t['group']} dropped (ticket {k}) and trained in epoch {t['epoch']}"
            for k, t in books["tickets"].items()
            if t["events"][-1:] == ["dropped"] and (t["group"], t["epoch"]) in trained_in]
    waiting = {t["group"] for t in books["tickets"].values()
               if not t["events"] or t["events"][-1] == "forwarded"} | books["redo"]
    top, ended = max(done, default=-1), done | dropped
    problems = both + [f"id {g} neither trained nor dropped, nor in flight at the end"
                       for g in range(top + 1) if g not in ended and g not in waiting]
    in_flight = sum(g in waiting and g not in ended for g in range(top + 1))
    return verdict("ids", problems, f"ids 0..{top}: {len(done)} trained, "
                   f"{len(dropped & set(range(top + 1)) - done)} dropped, {in_flight} in flight "
                   "at the end")


def check_stalls(run_dir: Path, cfg: dict, journal: list) -> tuple:
    bound = cfg["sync"]["timeout_s"] + cfg["run"]["hang_timeout_s"] + cfg["run"]["restart_s"]
    steps = [r["time"] for r in read_jsonl(run_dir / "metrics_trainer.jsonl")
             if "trainer/loss" in r]
    starts = [e["time"] for e in journal if e.get("event") == "start"]
    gaps = [(b - a, a) for a, b in zip(steps, steps[1:])
            if not any(a < s < b for s in starts)]  # a resumed run's new start: not a stall
    problems = [f"{gap:.1f} s without a step after {a - steps[0]:.0f} s" for gap, a in gaps
                if gap > bound]
    longest = max(gaps, default=(0.0, 0))[0]
    return verdict("stalls", problems, f"longest {longest:.1f} s between steps, bound {bound:.0f}"
                   " s (sync.timeout_s + run.hang_timeout_s + run.restart_s)")


def check(run_dir) -> list:
    """[(name, ok, detail)] for the invariants of the module's docstring; raises FileNotFoundError
    when run_dir holds no config.yaml."""
    run_dir = Path(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    kept = timeline(read_samples(run_dir))
    metrics = read_jsonl(run_dir / "metrics_trainer.jsonl")
    finished_at = metrics[-1]["step"] if metrics and "trainer/done" in metrics[-1] else None
    journal = read_jsonl(run_dir / "ledger.jsonl")
    trained, books = trained_tickets(kept), replay(journal)
    return [check_lag(kept, cfg["actor"]),
            check_steps(kept, finished_at),
            check_groups(trained, cfg["actor"]["group_size"]),
            check_tickets(books, trained),
            check_ids(books, trained),
            check_stalls(run_dir, cfg, journal)]


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
