"""Shared test fixtures. Run the suite with `bash run.sh test` (or `.venv/bin/python -m pytest tests`)."""
import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# vLLM's worker processes import weights_sync by name: make the repo importable in every child.
os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Every test has a time limit (pytest-timeout, requirements-common.txt): a hang fails that one test
# with its stack instead of running the suite into CI's limit. Twice the slowest test (~10 min, test_elastic).
TEST_TIMEOUT_S = 1200


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


def free_port() -> int:
    """A TCP port nothing listens on right now (tests never use fixed ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forkserver():
    """The multiprocessing context of the multi-rank tests: ranks fork from one server that imported torch,
    transformers' Qwen2 and those test modules once per session (spawned ranks import them anew: ~10 s a test)."""
    import multiprocessing
    multiprocessing.set_forkserver_preload(["test_trainer", "test_weights_sync",
                                            "transformers.models.qwen2.modeling_qwen2"])
    return multiprocessing.get_context("forkserver")


# --- the core's calls as tests use them (the roles call the parts these join) ------------------------------
# metrics files: run.sh's summary reads them with the same reader
from scripts.rundir import read_jsonl  # noqa: E402, F401


def send(sock, header: dict, arrays: dict):
    import common
    sock.send_multipart(common.encode(header, arrays), copy=False)


def recv(sock, kind: str):
    """Blocking receive of one message; raises WireError if it is malformed."""
    import common
    return common.decode(sock.recv_multipart(copy=True), kind)


def receive_weights(pg, expected=None):
    """A plain receiver of one weight update -> (version, {name: tensor}); `expected` as in receive_header."""
    import weights_sync
    header = weights_sync.receive_header(pg, expected)
    return header["version"], {n: t.clone() for n, t in weights_sync.iter_tensors(pg, header)}


def budget_of(cfg) -> dict:
    """The lag budget's terms as trainer rank 0 sends them to the ledger at its hello (trainer.main)."""
    return {"batch_size": cfg.trainer.batch_size, "group_size": cfg.actor.group_size,
            "max_lag": cfg.actor.max_lag, "schedule": cfg.actor.schedule, "G_steps": cfg.actor.G_steps}


class Owner:
    """Node 0's owner process as run.sh starts it (`python elastic.py`: the run's store, the ledger, the
    node's watchdog), on free ports: `overrides` for the roles, a `store` and a `ledger` client, `journal()`
    (the ledger's records). `open_epoch()` says hello as trainer rank 0 and as one actor; `tickets(n)` asks
    for n tickets as that actor -> [(ticket, group id)]."""

    def __init__(self, run_dir, *overrides):
        import subprocess
        import common
        import weights_sync
        self.run_dir = Path(run_dir)
        # (the test's actor speaks only when it asks for tickets: not counted lost for its silence)
        self.overrides = [f"run.dir={run_dir}", f"sync.port={free_port()}", f"ports.ledger={free_port()}",
                          "run.heartbeat_timeout_s=600", *overrides]
        self.cfg = common.load_config(self.overrides)
        self.log = open(self.run_dir / "owner.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(REPO / "elastic.py"), *self.overrides], cwd=REPO,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.store = weights_sync.create_store("127.0.0.1", self.cfg.sync.port, False, 60)
        self.ledger = common.LedgerClient(self.cfg, self.store)
        self.inc, self.epoch = None, None

    def open_epoch(self, step=0):
        self.epoch = self.ledger.request("trainer_hello", epoch=0, step=step, done_below=0, done_above=[],
                                         budget=budget_of(self.cfg))["epoch"]
        self.inc = self.ledger.request("actor_hello", pid=os.getpid(), host="test")["inc"]

    def tickets(self, n, version=0, **reports):
        reply = self.ledger.request("tickets", inc=self.inc, epoch=self.epoch, version=version, want=n,
                                    pushed=reports.get("pushed", []), drop=reports.get("drop", []))
        return [tuple(t) for t in reply["tickets"]]

    def journal(self) -> list:
        return read_jsonl(self.run_dir / "ledger.jsonl")

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


class FakeActor:
    """An actor as the trainer's WeightServer sees it, in threads of this process (no vLLM): it says hello to
    the ledger (`inc`), asks it for nothing every 0.2 s (it is alive), joins each weight roster that takes it in
    (one engine), receives every version announced to it (`updates`: [(version, {name: tensor})]) and
    acknowledges "done" (`done`). `epoch`: its roster's trainer epoch. `lost`: the ledger counted it lost."""

    def __init__(self, cfg, timeout_s: float = 120):
        import threading
        import common
        import weights_sync
        self.cfg, self.timeout_s = cfg, timeout_s
        self.store = weights_sync.create_store("127.0.0.1", cfg.sync.port, False, timeout_s)
        self.updates, self.epoch, self.error, self.lost = [], None, None, False
        self.done = threading.Event()
        self.first = int(self.store.add("announced", 0)) + 1
        self.inc = common.LedgerClient(cfg, self.store).request("actor_hello", pid=os.getpid(), host="fake")["inc"]
        threading.Thread(target=self._beat, daemon=True).start()
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def versions(self) -> list:
        return [v for v, _ in self.updates]

    def _beat(self):
        import time
        import common
        import weights_sync
        ledger = common.LedgerClient(self.cfg, weights_sync.create_store("127.0.0.1", self.cfg.sync.port, False,
                                                                    self.timeout_s))
        while not self.done.is_set():
            reply = ledger.request("tickets", inc=self.inc, epoch=-1, version=-1, want=0, pushed=[], drop=[])
            self.lost = self.lost or reply["lost"]
            time.sleep(0.2)

    def _run(self):
        import json
        from datetime import timedelta
        import weights_sync
        pg, n = None, self.first
        try:
            while True:
                self.store.wait([f"announce/{n}"], timedelta(seconds=self.timeout_s))
                value = self.store.get(f"announce/{n}").decode()
                n += 1
                if value == "done":
                    self.store.add("done_ack", 1)
                    return
                if value.startswith("roster "):
                    g = int(value.split()[1])
                    info = json.loads(self.store.get(f"roster/{g}"))
                    if str(self.inc) in info["members"]:
                        pg = weights_sync.init_group(self.store, info["members"][str(self.inc)],
                                                     1 + len(info["members"]), "gloo", 60, f"weights/{g}")
                        self.epoch = info["epoch"]
                elif pg is not None and value != "skip":
                    self.updates.append(receive_weights(pg))
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e
        finally:
            self.done.set()


def score_many(pool, items: list) -> list:
    """[(completion, answer, task)] -> [(reward, status)] in the same order, through a tasks.ScorePool."""
    tickets, done = [pool.submit(*item) for item in items], {}
    while len(done) < len(items):
        done.update({t: (reward, status) for t, reward, status, _ in pool.collect(timeout=0.1)})
    return [done[t] for t in tickets]


def vllm_greedy(model_dir, prompt_ids, max_tokens=16, timeout=600):
    """Greedy token ids from real vLLM (a subprocess: vLLM spawns workers and keeps global state)."""
    import json
    import subprocess
    code = f"""
import json, os
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and model in this process: two fewer starts (~20 s)
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model={str(model_dir)!r}, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=128, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
    outs = llm.generate([{{"prompt_token_ids": ids}} for ids in {prompt_ids!r}], sp)
    print("RESULT" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[0][6:])


def hf_greedy(model_dir, prompt_ids, max_tokens=16):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        y = model.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        out.append(y[0, x.shape[1]:].tolist())
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Qwen2 + the char tokenizer, built in seconds."""
    import torch
    torch.set_num_threads(1)
    from scripts.make_tiny_model import random_model_dir
    return random_model_dir(tmp_path_factory.mktemp("tiny-model"), seed=0)


def fsdp_manifest(fsdp):
    """[(name, shape, dtype)] of a trainer.FSDP's tensors in the order full_units yields them: the
    manifest a WeightSender checks a broadcast against."""
    return [(n, tuple(s), fsdp.dtype) for u in fsdp.units for n, s in zip(u.names, u.shapes)]
