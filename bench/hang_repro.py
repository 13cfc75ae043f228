"""One hang, reproduced: start `bash run.sh` (any checkout: --repo), SIGSTOP one process at a
step (--kill: SIGKILL, a death), watch what the run does for a while, then stop everything. Not a test: it prints what
happened, for before/after comparisons of the fault layer.

    .venv/bin/python bench/hang_repro.py --target engine --at-step 10 --watch 150 [--repo DIR]
        [--kill] [section.key=value ...]

--target: engine (the actor's vLLM engine core), actor (the actor's own process), verifier,
trainer0 (trainer rank 0). Reported (and written as JSON to --out): the last step before the stop,
steps made in the watch window and the longest gap between steps in it, the lines of run.sh's
log that say a role exited or was started again, and every line of the run's logs that mentions
the words "hung", "no progress", "no decode step", "lost", "killed" or "exited" (vLLM's own
lines and the metrics lines left out).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


def steps(run_dir: Path) -> list:
    """[(time, step)] of the trainer's step records."""
    path = run_dir / "metrics_trainer.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "trainer/loss" in r:
            out.append((r["time"], r["step"]))
    return out


def find(target: str, run_dir: Path):
    """The process to stop, among those started for this run directory."""
    mine = [p for p in psutil.process_iter(["pid", "cmdline"])
            if f"run.dir={run_dir}" in (p.info["cmdline"] or [])]
    for p in mine:
        cmd = p.info["cmdline"]
        launcher = any("torch.distributed.run" in c or c.endswith("torchrun") for c in cmd)
        if target in ("engine", "actor") and any(c.endswith("actor.py") for c in cmd[1:3]):
            if target == "actor":
                return p
            return next(c for c in p.children(recursive=True)
                        if "EngineCore" in c.name() + " ".join(c.cmdline()))
        if target == "verifier" and any(c.endswith("verifier.py") for c in cmd[1:3]):
            return p
        if target == "trainer0" and not launcher and any(c.endswith("trainer.py") for c in cmd[1:3]):
            if p.environ().get("RANK", "0") == "0":
                return p
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=["engine", "actor", "verifier", "trainer0"], required=True)
    ap.add_argument("--at-step", type=int, default=10)
    ap.add_argument("--watch", type=float, default=150.0)
    ap.add_argument("--kill", action="store_true", help="SIGKILL instead of SIGSTOP: a death, not a hang")
    ap.add_argument("--repo", default=str(REPO))
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    repo = Path(a.repo).resolve()
    run_dir = repo / "runs" / f"hang-{a.target}-{int(time.time())}"
    log = run_dir.parent / f"{run_dir.name}.runsh.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    node = subprocess.Popen(["bash", "run.sh", f"run.dir={run_dir}", *a.overrides], cwd=repo,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    stopped = None
    try:
        deadline = time.time() + 600
        while time.time() < deadline and node.poll() is None:
            if steps(run_dir) and steps(run_dir)[-1][1] >= a.at_step:
                break
            time.sleep(0.2)
        stopped = find(a.target, run_dir)
        if stopped is None:
            raise SystemExit(f"hang_repro: no {a.target} process found (see {log})")
        before = steps(run_dir)[-1][1]
        t_stop = time.time()
        sig = signal.SIGKILL if a.kill else signal.SIGSTOP
        stopped.send_signal(sig)
        print(f"hang_repro: {sig.name} {a.target} (pid {stopped.pid}) after step {before}", flush=True)
        while time.time() < t_stop + a.watch and node.poll() is None:
            time.sleep(0.5)
        after = [(t, s) for t, s in steps(run_dir) if t > t_stop]
        edges = [t_stop] + [t for t, _ in after] + [min(time.time(), t_stop + a.watch)]
        words = ("hung", "no progress", "no decode step", "lost", "killed", "exited")
        named = []
        for path in sorted((run_dir / "logs").glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                # (not a metrics line, "[role] step N k=v ...", nor a start-up line naming a pid)
                progress = re.match(r"\[\w+\] step \d+ ", line)
                if any(w in line for w in words) and "pid=" not in line and not progress:
                    named.append(f"{path.name}: {line.strip()[:300]}")
        runsh = [line.strip() for line in log.read_text(errors="replace").splitlines()
                 if "exited" in line or "FAILED" in line or "starting it again" in line]
        report = {"repo": str(repo), "target": a.target, "signal": sig.name, "pid": stopped.pid,
                  "stopped_after_step": before,
                  "watch_s": a.watch, "steps_in_watch": len(after),
                  "last_step_in_watch": after[-1][1] if after else None,
                  "first_step_after_stop_s": round(after[0][0] - t_stop, 1) if after else None,
                  "longest_gap_s": round(max(b - x for x, b in zip(edges, edges[1:])), 1),
                  "run_sh": runsh, "lines_naming_it": named[:20], "run_dir": str(run_dir)}
        text = json.dumps(report, indent=1)
        print(text, flush=True)
        if a.out:
            Path(a.out).write_text(text)
    finally:
        if stopped is not None:
            try:
                stopped.send_signal(signal.SIGCONT)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGTERM)
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
        for p in psutil.process_iter(["pid", "cmdline"]):
            if f"run.dir={run_dir}" in (p.info["cmdline"] or []):
                try:
                    os.killpg(os.getpgid(p.pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


if __name__ == "__main__":
    sys.exit(main())
