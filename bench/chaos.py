"""Fault soak: SIGKILL roles of a running run, or SIGSTOP them (a hang: --hang), at steps drawn by a
seed, measure how long training stops after each fault, and check the run's invariants at the end
(scripts/check_run.py).

    .venv/bin/python bench/chaos.py --kills 20 --seed 0 [--hang] [--actors 2] [--nproc 2]
        [--workers 4] [--max-lag 4] [--steps-per-kill 45] [--kinds actor,verifier,...] [--out DIR]
        [--model DIR] [section.key=value ...]

The run: `bash run.sh` nodes on loopback. With --actors 1, one node runs every role; with more,
node 0 runs the store, the verifier and the trainer (trainer.nproc=--nproc ranks) and nodes
1..actors an actor each. run.max_restarts is above the kills of any role. Each kill is drawn:
  actor       one actor process (a node's; any of them)
  verifier    the verifier
  trainer     one trainer rank (drawn among trainer.nproc; torchrun restarts them together)
  two         two at once: an actor and the verifier, or an actor and the trainer
  regroup     an actor, then (with two or more actors) another while the weight roster re-forms
  checkpoint  the trainer, right after it wrote a checkpoint
and with --hang, drawn with them, the hangs (SIGSTOP: nothing dies; the fault layer must find the
hang, kill the process and start it again):
  engine_stop   an actor's vLLM engine core (its actor sees no decode step: run.hang_timeout_s)
  actor_stop    an actor's own process (the ledger hears nothing: run.heartbeat_timeout_s; its
                node's watchdog kills it: run.hang_timeout_s)
  verifier_stop the verifier (node 0's watchdog: run.hang_timeout_s)
  trainer_stop  one trainer rank (its node's watchdog: run.hang_timeout_s; torchrun stops the rest)
then the next fault comes a drawn 5-15 steps after training moved again, once every actor is back in
the weight roster (so that an actor's fault has a survivor). The run is long enough for every fault
(trainer.max_steps) and ends by itself.

Reported (one line per kill, then a summary; JSON in OUT/chaos.json, the steps over time with the
kills in OUT/chaos.png): the stall after each death,
the longest gap between two trainer steps from the kill until training has made 5 steps again,
against the bound stated for the fault (`bound_for`: from the run's settings, the time to find it,
plus the time to start the role again; a hang's is run.hang_timeout_s more than its death's), and
faults survived, the invariants' verdict, roles that run.sh restarted without a fault of theirs,
groups given back (the ledger's journal) and samples discarded (the trainer's).
"""
import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import weights_sync as ws  # noqa: E402
from scripts import check_run  # noqa: E402
from scripts.rundir import read_jsonl  # noqa: E402

KINDS = ["actor", "verifier", "trainer", "two", "regroup", "checkpoint"]
WEIGHTS = [4, 2, 2, 1, 1, 1]
HANGS = ["engine_stop", "actor_stop", "verifier_stop", "trainer_stop"]
HANG_WEIGHTS = [3, 2, 2, 2]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan(kills: int, seed: int, actors: int, kinds=KINDS) -> list:
    """[(kind, gap in steps)] drawn by the seed, among `kinds` (kills, and hangs with --hang)."""
    rng = random.Random(seed)
    out = []
    pairs = [(k, w) for k, w in zip(KINDS + HANGS, WEIGHTS + HANG_WEIGHTS) if k in kinds]
    for _ in range(kills):
        kind = rng.choices([k for k, _ in pairs], [w for _, w in pairs])[0]
        if kind == "regroup" and actors < 2:
            kind = "actor"
        out.append((kind, rng.randint(5, 15)))
    return out


def role_processes(role: str) -> list:
    """The live processes running `role`.py (trainer: one per rank, not torchrun; actor: one per
    node, not its vLLM engine core)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        launcher = any(c.endswith("torchrun") or "torch.distributed.run" in c for c in cmd)
        if not launcher and any(c.endswith(f"{role}.py") for c in cmd[1:3]):
            found.append(p)
    return found


KILLED_GROUPS = set()  # process groups of the killed roles (run.sh starts each role in its own)


def kill(role: str, rng, not_node: str = None, stop: bool = False) -> str:
    """SIGKILL (SIGSTOP with `stop`: a hang) one process of `role` drawn by rng (an actor: not on node
    `not_node`; "engine": an actor's vLLM engine core) -> what was killed."""
    procs = sorted(role_processes("actor" if role == "engine" else role), key=lambda p: p.pid)
    if not_node is not None:
        procs = [p for p in procs if p.environ().get("NODE_RANK") != not_node]
    if not procs:
        return f"{role}: none running"
    p = rng.choice(procs)
    try:
        rank = p.environ().get("RANK", "") if role == "trainer" else ""
        node = p.environ().get("NODE_RANK", "") if role in ("actor", "engine") else ""
        KILLED_GROUPS.add(os.getpgid(p.pid))
        if role == "engine":
            p = next(c for c in p.children(recursive=True) if "EngineCore" in " ".join(c.cmdline()))
        p.suspend() if stop else p.kill()
    except (psutil.NoSuchProcess, ProcessLookupError, StopIteration):
        return f"{role}: gone before the {'stop' if stop else 'kill'}"
    where = f" rank {rank}" if rank else f" node {node}" if node else ""
    return f"{role}{where} (pid {p.pid}){' stopped' if stop else ''}"


def left_behind() -> list:
    """Processes still alive in a killed role's process group (a SIGKILLed actor's vLLM engine core
    lived on, holding its memory, until run.sh killed the group)."""
    left = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(p.pid) in KILLED_GROUPS:
                left.append(f"{p.info['name']} (pid {p.pid})")
        except ProcessLookupError:
            pass
    return left


def members(store) -> int:
    """Actor incarnations in the newest weight roster (the store gone, the run over: a large number)."""
    try:
        g = int(store.add("roster/count", 0))
    except RuntimeError:  # DistNetworkError
        return 10**9
    if not g or not store.check([f"roster/{g}"]):
        return 0
    return len(json.loads(store.get(f"roster/{g}"))["members"])


def steps_times(run_dir: Path) -> list:
    """[(time, step)] of the trainer's step records, in the order written."""
    return [(r["time"], r["step"]) for r in read_jsonl(run_dir / "metrics_trainer.jsonl")
            if "trainer/loss" in r]


def wait_steps_after(run_dir: Path, t: float, n: int, timeout: float, nodes) -> bool:
    """Wait until the trainer has logged n steps after time t."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if sum(1 for tt, _ in steps_times(run_dir) if tt > t) >= n:
            return True
        if nodes[0].poll() is not None:
            return False
        time.sleep(0.5)
    return False


def stall_after(run_dir: Path, t: float, n: int = 5) -> float:
    """The longest gap from the kill at t to the trainer's n-th step record after it."""
    times = [tt for tt, _ in steps_times(run_dir) if tt > t][:n]
    edges = [t, *times]
    return max((b - a for a, b in zip(edges, edges[1:])), default=float("nan"))


def plot(run_dir: Path, report: list, path: Path):
    """The trainer's steps over wall time, a line at each kill (the picture of the stalls)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = steps_times(run_dir)
    if not steps:
        return
    t0 = steps[0][0]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([t - t0 for t, _ in steps], [s for _, s in steps], ".", ms=2, color="k")
    colors = dict(zip(KINDS + HANGS, [f"C{k}" for k in range(10)]))
    for row in report:
        ax.axvline(row["t"] - t0, color=colors[row["kind"]], lw=1, alpha=0.7)
    for kind, color in colors.items():
        ax.plot([], [], color=color, label=kind)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("trainer step (a restarted trainer redoes steps)")
    ax.legend(title="killed", fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SYNC_TIMEOUT_S = 60.0  # the soak's sync.timeout_s (config.yaml's)


def bound_for(kind: str, actors: int, heartbeat_s: float, hang_s: float) -> tuple:
    """(seconds, what) training may stand still after this fault: the time to find it, and to start
    the role again (an engine's start, a checkpoint's load) where nothing else can go on meanwhile."""
    if kind in ("trainer", "checkpoint", "two"):
        return 150.0, "trainer: restart + checkpoint load"
    if kind == "trainer_stop":
        return hang_s + 150.0, "trainer rank stopped: run.hang_timeout_s + restart + checkpoint load"
    if kind == "regroup":
        return 180.0, "both actors: an engine's start"
    if kind == "verifier":
        return 90.0, "verifier: restart"
    if kind == "verifier_stop":
        return hang_s + 90.0, "verifier stopped: run.hang_timeout_s + restart"
    if actors >= 2 and kind in ("actor", "actor_stop"):
        return heartbeat_s + 30.0, "actor with a survivor: run.heartbeat_timeout_s + a new roster"
    if actors >= 2 and kind == "engine_stop":
        # an engine stopped while its actor joins a roster answers no decode-step check (it has no
        # requests yet): the broadcast waiting on it fails at sync.timeout_s (a soak: 69.8 s)
        return max(hang_s, SYNC_TIMEOUT_S) + heartbeat_s + 30.0, (
            "engine stopped, a survivor: run.hang_timeout_s (sync.timeout_s if it was joining a "
            "roster) + run.heartbeat_timeout_s + a new roster")
    if kind in ("engine_stop", "actor_stop"):
        return hang_s + 180.0, "the only actor stopped: run.hang_timeout_s + an engine's start"
    return 180.0, "no actor left: an engine's start"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--max-lag", type=int, default=4)
    ap.add_argument("--steps-per-kill", type=int, default=45,
                    help="trainer.max_steps = 40 + this * kills: the steps run while a killed "
                         "actor's engine starts again count too (one took 119 s here, ~600 steps)")
    ap.add_argument("--kinds", default=None, help="what may be killed or stopped, comma-separated "
                    "(default: the kills, and with --hang the hangs too)")
    ap.add_argument("--hang", action="store_true", help="hangs (SIGSTOP) too, drawn with the kills")
    ap.add_argument("--hang-timeout", type=float, default=15.0, help="run.hang_timeout_s of the run")
    ap.add_argument("--model", default=str(REPO / "assets" / "tiny-model"))
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    out = Path(a.out or REPO / "runs" / "chaos" / f"k{a.kills}-s{a.seed}-lag{a.max_lag}-{int(time.time())}")
    run_dir = out / "run"
    out.mkdir(parents=True, exist_ok=True)
    kinds = a.kinds.split(",") if a.kinds else KINDS + (HANGS if a.hang else [])
    kills = plan(a.kills, a.seed, a.actors, kinds)
    heartbeat_s, hang_s = 3.0, a.hang_timeout
    cfg = {"model.path": a.model, "run.dir": run_dir,
           "trainer.max_steps": 40 + a.steps_per_kill * a.kills,
           "trainer.batch_size": 32, "actor.group_size": 4, "actor.max_tokens": 24,
           "actor.max_lag": a.max_lag, "actor.max_inflight": 32, "actor.eval_every": 0,
           "trainer.checkpoint_every": 10, "trainer.nproc": a.nproc, "verifier.workers": a.workers,
           "run.max_restarts": a.kills + 1, "run.heartbeat_timeout_s": heartbeat_s,
           "run.hang_timeout_s": hang_s, "run.peer_timeout_s": 300, "run.log_every": 0.5,
           "sync.timeout_s": SYNC_TIMEOUT_S,
           "sync.port": free_port(), "ports.rollouts": free_port(), "ports.samples": free_port(),
           "ports.ledger": free_port(),
           "trainer.cpu_cores": "1", "verifier.cpu_cores": "1", "actor.cpu_cores": "0"}
    args = [f"{k}={v}" for k, v in cfg.items()] + a.overrides
    nnodes = 1 if a.actors == 1 else 1 + a.actors
    env = {**os.environ, "NNODES": str(nnodes), "MASTER_ADDR": "127.0.0.1"}
    logs = [out / f"node{k}.log" for k in range(nnodes)]
    nodes = [subprocess.Popen(["bash", "run.sh", *args], cwd=REPO, stdout=open(logs[k], "w"),
                              stderr=subprocess.STDOUT, env={**env, "NODE_RANK": str(k)},
                              start_new_session=True) for k in range(nnodes)]
    rng = random.Random(a.seed + 1)
    store = ws.create_store("127.0.0.1", cfg["sync.port"], False, 600)
    report = []
    try:
        if not wait_steps_after(run_dir, 0, 10, 600, nodes):
            raise SystemExit(f"chaos: the run did not reach step 10: see {logs[0]}")
        def near_end(i) -> bool:  # no kill within the run's last 20 steps (or after it)
            steps = steps_times(run_dir)
            if steps and steps[-1][1] > cfg["trainer.max_steps"] - 20:
                print(f"chaos: kill {i + 1}: too close to the end, stopping the kills", flush=True)
                return True
            return False
        for i, (kind, gap) in enumerate(kills):
            if near_end(i):
                break
            if not wait_steps_after(run_dir, time.time(), gap, 600, nodes):
                break
            # every actor back in the weight group: an actor's death then has a survivor
            deadline = time.time() + 600
            while members(store) < a.actors and time.time() < deadline and nodes[0].poll() is None:
                time.sleep(0.5)
            if nodes[0].poll() is not None:
                break
            if kind == "checkpoint":  # right after the next checkpoint
                ckpts = run_dir / "checkpoints"
                seen = {p.name for p in ckpts.glob("step-*")}
                deadline = time.time() + 300
                while {p.name for p in ckpts.glob("step-*")} <= seen and time.time() < deadline \
                        and nodes[0].poll() is None:  # a run that ended writes none
                    time.sleep(0.05)
            if near_end(i):  # the waits above may have taken the rest of the run
                break
            t_kill = time.time()
            if kind in HANGS:  # the role's process (engine: the actor's engine core) stopped
                what = [kill(kind.removesuffix("_stop"), rng, stop=True)]
            elif kind in ("actor", "verifier", "trainer", "checkpoint"):
                what = [kill("trainer" if kind == "checkpoint" else kind, rng)]
            elif kind == "two":
                what = [kill("actor", rng), kill(rng.choice(["verifier", "trainer"]), rng)]
            else:  # regroup: a second actor dies while the group re-forms without the first
                what = [kill("actor", rng)]
                time.sleep(heartbeat_s + rng.uniform(0.0, 2.0))
                first = what[0].split(" node ")[1].split()[0] if " node " in what[0] else None
                what.append(kill("actor", rng, not_node=first))
            moved = wait_steps_after(run_dir, t_kill, 5, 900, nodes)
            stall = stall_after(run_dir, t_kill)
            bound, because = bound_for(kind, a.actors, heartbeat_s, hang_s)
            row = {"kill": i + 1, "kind": kind, "killed": what, "t": t_kill, "stall_s": round(stall, 1),
                   "bound_s": bound, "bound": because, "moved_again": moved}
            report.append(row)
            print(f"chaos: kill {i + 1}/{len(kills)}: {kind}: {', '.join(what)}; training stood "
                  f"still {stall:.1f} s (bound {bound:.0f} s: {because})", flush=True)
            if not moved:
                break
        for node in nodes:
            node.wait(timeout=3600)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
        # run.sh starts each role in a session of its own: what a killed node's run.sh left
        for p in psutil.process_iter(["pid", "cmdline"]):
            if f"run.dir={run_dir}" in (p.info["cmdline"] or []):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(p.pid), signal.SIGKILL)
    results = check_run.check(run_dir)
    left = left_behind()
    text = "".join(p.read_text() for p in logs)
    restarts = {role: text.count(f"role '{role}' exited") for role in ("actor", "verifier", "trainer")}
    # a stopped engine core's actor exits and is started again: the actor's restart
    killed = {role: sum(w.startswith(role) or (role == "actor" and w.startswith("engine"))
                        for row in report for w in row["killed"])
              for role in ("actor", "verifier", "trainer")}
    trainer = read_jsonl(run_dir / "metrics_trainer.jsonl")
    summary = {
        "command": " ".join(sys.argv), "kills_planned": len(kills), "kills_done": len(report),
        "survived": all(r["moved_again"] for r in report) and nodes[0].returncode == 0,
        "node0_exit": nodes[0].returncode,
        "violations": [f"{name}: {detail}" for name, ok, detail in results if not ok],
        "invariants": {name: detail for name, ok, detail in results},
        "over_bound": [r for r in report if not r["stall_s"] <= r["bound_s"]],
        "longest_stall_by_kind": {k: max(r["stall_s"] for r in report if r["kind"] == k)
                                  for k in {r["kind"] for r in report}},
        "restarted_not_killed": {r: restarts[r] - killed[r] for r in restarts
                                 if restarts[r] > killed[r]},
        "left_behind": left,
        "given_back_groups": sum(len(e["tickets"]) for e in read_jsonl(run_dir / "ledger.jsonl")
                                 if e.get("event") == "given_back"),
        "discarded_samples": max((r.get("trainer/discarded", 0) for r in trainer), default=0),
        "kills": report}
    (out / "chaos.json").write_text(json.dumps(summary, indent=1))
    plot(run_dir, report, out / "chaos.png")
    for name, ok, detail in results:
        print(f"check_run: {name}: {'ok' if ok else 'VIOLATED'} ({detail})")
    print(f"chaos: {len(report)} of {len(kills)} kills survived={summary['survived']}, "
          f"{len(summary['violations'])} violations, {len(summary['over_bound'])} stalls over their "
          f"bound, longest by kind {summary['longest_stall_by_kind']}, restarted without a kill "
          f"{summary['restarted_not_killed'] or 'none'}, left behind {left or 'nothing'}; "
          f"{out / 'chaos.json'}", flush=True)
    ok = summary["survived"] and not summary["violations"] and not summary["over_bound"]
    return 0 if ok and not summary["restarted_not_killed"] and not left else 1


if __name__ == "__main__":
    sys.exit(main())
