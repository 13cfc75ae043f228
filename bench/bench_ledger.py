"""What the run's books cost as the run grows, and the round trips an admitted group costs the actor's
loop: this tree's ledger (elastic.Ledger, one owner, books in memory) or an earlier tree's books over
the store (--repo: the fault layer before the ledger had one owner), measured the same way.

    .venv/bin/python bench/bench_ledger.py [--ids 100000] [--repo DIR]

This tree: the ledger with `--ids` tickets issued, forwarded and trained before (the history a long
run leaves), then the time of one trainer report (a step's 16 groups trained) and of one actor request
granting a group: neither should grow with the history. An earlier tree (its elastic.Ledger.publish):
a lost actor incarnation that took `--ids` group ids, and the time of one publish, which trainer rank
0 runs every step and every 0.2 s while it waits; and its actor's admission calls replayed against a
store that counts them (elastic.reserve, take_group_id, forwarded_groups, read_budget,
publish_oldest: what Actor.admit_groups and refresh_budget call), round trips per admitted group.
For this tree the round trips per group come from a run: its metrics_actor.jsonl's
`actor/ledger_requests` over `actor/tickets` (`--run RUN_DIR`).
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent


def timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def this_tree(ids: int) -> dict:
    import common
    import elastic
    with tempfile.TemporaryDirectory() as d:
        cfg = common.load_config([f"run.dir={d}"])
        ledger = elastic.Ledger(cfg)

        def ask(kind, **fields):
            return json.loads(json.dumps(ledger.handle(json.dumps({"op": kind, **fields}).encode())))
        budget = {"batch_size": 128, "group_size": 8, "max_lag": 10**9, "schedule": "pipeline",
                  "G_steps": 1}
        ask("verifier_hello")
        ask("trainer_hello", epoch=0, step=0, done_below=0, done_above=[], budget=budget)
        inc = ask("actor_hello", pid=1, host="bench")["inc"]
        version = 0
        while ledger.next_ticket <= ids:  # the history: granted, forwarded, trained, 16 a step
            granted = ask("tickets", inc=inc, epoch=1, version=version, want=16, pushed=[], drop=[])
            tickets = [k for k, _ in granted["tickets"]]
            ask("forward", verifier=1, forward=tickets, drop=[])
            version += 1
            ask("report", epoch=1, version=version, trained=tickets, lost=[])
        journal = (Path(d) / "ledger.jsonl").stat().st_size
        in_flight = ask("tickets", inc=inc, epoch=1, version=version, want=64, pushed=[], drop=[])
        step = [k for k, _ in in_flight["tickets"][:16]]
        ask("forward", verifier=1, forward=step, drop=[])

        def report():
            ask("report", epoch=1, version=version, trained=[], lost=[])

        def grant():
            ask("tickets", inc=inc, epoch=1, version=version, want=1, pushed=[], drop=[])
        out = {"history_tickets": ledger.next_ticket - 1, "journal_bytes": journal,
               "report_ms": 1e3 * timed(report, 2000), "grant_ms": 1e3 * timed(grant, 2000)}
        ledger.journal.close()
        return out


class Counting:
    """A store whose calls are counted (each one a round trip to the store's process)."""

    def __init__(self, store):
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return call(*args, **kwargs)
        return counted


def earlier_tree(repo: Path, ids: int) -> dict:
    """The books over the store, as 90804ca's elastic.py keeps them."""
    sys.path.insert(0, str(repo))
    import actor
    import common
    import elastic
    import weights_sync as ws
    store = ws.create_store("127.0.0.1", 0, True, 60)
    cut = 1
    store.set(f"budget/{cut}", "0 0 0")
    store.set(f"budget/{cut}/started", f"{8 * ids} 2:{8 * ids}")
    store.set(f"redo/{cut}", "")
    store.set(f"redo/{cut}/taken", "0 trainer")
    store.set("groups/next", f"{cut} 0 fence")
    store.add("actor/incarnations", 2)
    store.set(f"ids/{cut}/2", "".join(f"{g}," for g in range(ids)))  # what the lost one took
    books = elastic.Ledger(store, None, SimpleNamespace(trained_below=0, trained_ids=set()))
    books.cut = cut
    books.lost = {}
    group = SimpleNamespace(members={1: 1}, cut=cut, cut_members=[1, 2], recut=False, ids_below=0)

    def publish():  # as every step and every 0.2 s of waiting: the lost one's ids re-read each time
        books.publish(1, {1}, True, {1, 2})
    publish()  # (the first lists them to generate again; the next ones only read them)
    publish_ms = 1e3 * timed(publish, 20)
    value = store.get(f"ids/{cut}/2")
    # the actor's admission of one group, replayed against a counting store
    cfg = common.load_config(["actor.max_lag=1000"])
    counting = Counting(ws.create_store("127.0.0.1", store.port, False, 60))
    store.set(f"budget/{cut}/started", "0")
    st = actor.ActorState(version=0, inc=1, weight_group=1, cut=cut, cut_version=0, others=[],
                          budget_ready=True)
    fake = SimpleNamespace(store=counting, st=st, cfg=cfg, published=None)
    groups = 50
    for gid in range(groups):
        elastic.reserve(counting, st, 8, lambda s: actor.admit(cfg, s))  # Actor.admit_groups
        gid = elastic.take_group_id(counting, st)
        st.groups[gid] = actor.Group(version=0, left=0, engine=0)
        elastic.forwarded(store, 1, cut, gid)  # the verifier's mark (its own connection)
        actor.Actor.refresh_budget(fake)  # forwarded_groups, read_budget
        actor.Actor.publish_oldest(fake)
    return {"lost_ids": ids, "ids_value_bytes": len(value), "publish_ms": publish_ms,
            "round_trips_per_group": counting.calls / groups}


def from_run(run_dir: Path) -> dict:
    sys.path.insert(0, str(REPO))
    from scripts.rundir import read_jsonl
    lines = read_jsonl(run_dir / "metrics_actor.jsonl")
    requests = sum(r.get("actor/ledger_requests", 0) for r in lines)
    tickets = sum(r.get("actor/tickets", 0) for r in lines)
    return {"ledger_requests": requests, "tickets": tickets,
            "round_trips_per_group": requests / max(tickets, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", type=int, default=100_000)
    ap.add_argument("--repo", default=None, help="an earlier tree (its books over the store)")
    ap.add_argument("--run", default=None, help="a run of this tree: round trips per group")
    a = ap.parse_args(argv)
    if a.run:
        out = from_run(Path(a.run))
    elif a.repo:
        out = earlier_tree(Path(a.repo).resolve(), a.ids)
    else:
        sys.path.insert(0, str(REPO))
        out = this_tree(a.ids)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
