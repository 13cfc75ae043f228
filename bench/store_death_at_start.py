"""An actor started just before the run's store dies: how long until it ends, and how.

    .venv/bin/python bench/store_death_at_start.py [--limit 120] [--repo DIR] [section.key=value ...]

The run's store (`python weights_sync.py`, as run.sh starts it on node 0) and one `python actor.py`
with the embedded default model, no trainer or verifier: the actor connects to the store, then
starts its engine; when it prints `engine 0: starting`, the store is killed (SIGKILL). Once the
engine is up, its worker connects to the store for weight updates (actor.init_sync). Before
elastic.unless_store_lost that connect waited out sync.timeout_s (300 s, then retried) and the actor
with it: in a soak an actor started 30 s before the run ended was still there 8 minutes after. Now
the actor should end with status 3 (elastic.STORE_LOST) and one line naming the store within seconds
of its engine being up.

Reported: the seconds from the kill to the engine being up and to the actor's exit, its status and
its last line; an actor still running after --limit seconds is killed and reported so. --repo runs
another checkout's actor.py and weights_sync.py (an older commit, for a before/after).
Not a test: the seconds depend on this machine (an engine's start is ~20-30 s on 2 cores).
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=float, default=120.0, help="seconds after the kill before giving up")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose roles run")
    args, overrides = ap.parse_known_args(argv)
    repo = args.repo.resolve()
    run_dir = Path(tempfile.mkdtemp(prefix="store-death-"))
    over = [f"run.dir={run_dir}", f"sync.port={free_port()}", f"ports.rollouts={free_port()}",
            f"ports.samples={free_port()}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    store = subprocess.Popen([sys.executable, "weights_sync.py", *over], cwd=repo, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "[store] serving" in store.stdout.readline(), "the store did not start"
    actor = subprocess.Popen([sys.executable, "actor.py", *over], cwd=repo, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, marks = [], {}

    def read():
        for line in actor.stdout:
            lines.append(line.rstrip())
            if "engine 0: starting" in line and "kill" not in marks:
                store.send_signal(signal.SIGKILL)
                marks["kill"] = time.time()
            if "engine 0: up" in line:
                marks["up"] = time.time()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while "kill" not in marks and actor.poll() is None:
            time.sleep(0.1)
        try:
            status = actor.wait(timeout=args.limit)
        except subprocess.TimeoutExpired:
            status = None
        end = time.time()
    finally:
        actor.kill()
        store.kill()
    reader.join(timeout=10)
    kill = marks.get("kill", end)
    up = f"{marks['up'] - kill:.1f} s" if "up" in marks else "never"
    print(f"repo {repo}")
    print(f"engine up after the store's kill: {up}")
    if status is None:
        print(f"actor still running {args.limit:.0f} s after the store's kill (killed now)")
    else:
        print(f"actor exited with status {status}, {end - kill:.1f} s after the store's kill "
              f"({end - marks['up']:.1f} s after its engine was up)" if "up" in marks else
              f"actor exited with status {status}, {end - kill:.1f} s after the store's kill")
    named = [line for line in lines if "lost the run's store" in line]
    print(f"its line naming the store: {named[0] if named else 'none'}")
    print("its last lines:\n  " + "\n  ".join(line for line in lines[-3:] if line))
    return 0 if status == 3 else 1


if __name__ == "__main__":
    sys.exit(main())
