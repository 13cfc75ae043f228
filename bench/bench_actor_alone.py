"""The actor's generation path alone: actor.run_actor as `bash run.sh` runs it (same engine, sampling,
prompts, admission loop, ZMQ push), but no trainer, verifier, weight updates or evaluation: a thread
here is trainer rank 0 (it sends version 0, then nothing) and drains the rollouts. The lag budget is
made unlimited, so the engine keeps actor.max_inflight sequences in flight as fast as it can. The
denominator of "engine tokens/s inside a run / the same engine alone at the same h"
(bench/run_figures.py --alone).

    .venv/bin/python bench/bench_actor_alone.py [--seconds 60] [--h 64] [--cores 0] [--pin] [k=v ...]

Also prints the front-end's CPU time per 1k engine tokens (this process: request intake, outputs, the loop).
--pin: the actor process on --cores with its engine (as run.sh did before the front-end moved off the
engine's cores), else engine_setup.start_engines' layout, as in a run: the engine process on --cores, the actor's
front-end on the other cores. Prints the mean of actor/engine_tokens_per_s over the last three quarters of
the run (the first quarter warms up).
Not a test: the number depends on the machine and on what else runs on it.
"""
import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--h", type=int, default=64)
    ap.add_argument("--cores", default="0")
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    import torch
    torch.set_num_threads(1)
    import vllm.v1.engine.async_llm  # noqa: F401  (before any engine exists; see actor.main)
    import zmq
    import actor
    from scripts import engine_setup
    import common
    from scripts import telemetry
    from scripts.rundir import read_events, read_jsonl
    import weights_sync as ws
    from safetensors.torch import load_file
    from tests.conftest import free_port
    from tests.conftest import Owner, budget_of
    tmp = tempfile.mkdtemp()
    # the run's owner process (elastic.py: store, ledger) as run.sh starts it
    owner = Owner(tmp, f"ports.rollouts={free_port()}", f"actor.max_inflight={args.h}",
                  f"actor.cpu_cores={args.cores}", "actor.eval_every=0", "actor.max_lag=100000",
                  "sync.verify_every=0", *args.overrides)
    cfg, store = owner.cfg, owner.store
    telemetry.setup_logging(cfg, "actor")
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(common.zmq_addr("127.0.0.1", cfg.ports.rollouts))
    stop, got = threading.Event(), [0]

    def drain():
        while not stop.is_set():
            if pull.poll(100):
                pull.recv_multipart()
                got[0] += 1

    sd = load_file(os.path.join(cfg.model_path, "model.safetensors"))

    async def run():
        engine = engine_setup.start_engines(cfg)[0]
        await actor.init_sync(cfg, [engine])
        # trainer rank 0's side: a trainer epoch whose (unbounded: max_lag) lag budget the ledger keeps;
        # its weight server takes the actor into a roster once it says hello and sends version 0
        epoch = owner.ledger.request("trainer_hello", epoch=0, step=0, done_below=0, done_above=[],
                                     budget=budget_of(cfg))["epoch"]
        server = ws.WeightServer(cfg, version=0, device=torch.device("cpu"), epoch=epoch,
                                 ledger=lambda: common.LedgerClient(cfg, store))
        server.send(0, iter(sd.items()), wait=True)
        halt = asyncio.Event()
        task = asyncio.ensure_future(actor.run_actor(cfg, [engine], store, halt))
        await asyncio.sleep(args.seconds / 4)  # warm-up; then the front-end's CPU time is counted
        cpu.append((time.time(), time.process_time()))
        await asyncio.sleep(args.seconds * 3 / 4)
        cpu.append((time.time(), time.process_time()))
        halt.set()
        await task
        engine.shutdown()

    threading.Thread(target=drain, daemon=True).start()
    t0, cpu = time.time(), []
    asyncio.run(run())
    stop.set()
    recs = [r for r in read_jsonl(Path(tmp) / "metrics_actor.jsonl") if "actor/engine_tokens_per_s" in r]
    keep = [r["actor/engine_tokens_per_s"] for r in recs if r["time"] > t0 + (recs[-1]["time"] - t0) / 4]
    # engine tokens made while the front-end's CPU time was counted: rate x window of each record inside it
    tokens = sum(r["actor/engine_tokens_per_s"] * (r["time"] - q["time"]) for q, r in zip(recs, recs[1:])
                 if cpu[0][0] < q["time"] and r["time"] <= cpu[1][0])
    # the engine's busy fraction (time inside decode steps / wall) over the same records' span
    busy = [c[3]["busy"] for c in read_events(Path(tmp) / "events_engine0-0.jsonl")
            if c[0] == "C" and c[2] > t0 + (recs[-1]["time"] - t0) / 4]
    print(f"\n== the actor alone, h={args.h}, cores {args.cores} ({'pinned' if args.pin else 'engine process there, front-end elsewhere'}): "
          f"{np.mean(keep):.0f} engine tokens/s (mean of {len(keep)} one-second records; {got[0]} rollouts); "
          f"engine busy {np.mean(busy):.3f}; "
          f"front-end CPU {1000 * (cpu[1][1] - cpu[0][1]) / max(tokens, 1):.3f} s per 1k engine tokens "
          f"({(cpu[1][1] - cpu[0][1]) / (cpu[1][0] - cpu[0][0]):.2f} of a core)", flush=True)
    owner.close()
    # Leave at once: tearing down the gloo group at interpreter exit,
    # with the engine's worker gone, aborts ("terminate called ... TCPStore"); there is nothing left to clean up.
    os._exit(0)


if __name__ == "__main__":
    main()
