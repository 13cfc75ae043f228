"""Tier (c): `run.sh` end to end in subprocesses, on a tiny random model: success, failures, bad input,
resume, two "nodes" on loopback, the GPU recipe's keys on CPU, and the README's paths.

Run: bash run.sh test tests/test_e2e.py      (6-8 minutes on 2 cores)
"""
import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

import common
import envs
import loss
import tasks
from conftest import REPO, free_port, hf_greedy, read_jsonl, vllm_greedy
from scripts import check_run
from scripts.rundir import read_samples, timeline

MAX_LAG = 2
GROUP_SIZE = 4


def short_config(model_dir, run_dir, **extra):
    """A few steps of the whole pipeline on a random tiny model, on free ports."""
    sync_port = free_port()
    kv = {"model.path": model_dir, "run.dir": run_dir, "trainer.max_steps": 4, "trainer.batch_size": 16,
          "actor.group_size": GROUP_SIZE, "actor.max_tokens": 24, "actor.max_lag": MAX_LAG, "actor.max_inflight": 32,
          "actor.eval_every": 2, "data.test_size": 16, "trainer.checkpoint_every": 2,
          "run.peer_timeout_s": 120, "run.restart_s": 60, "sync.port": sync_port,
          "ports.rollouts": free_port(), "ports.samples": free_port(), "ports.ledger": free_port(),
          "run.log_every": 0.5}
    kv.update(extra)
    return [f"{k}={v}" for k, v in kv.items()]


def start(args, env=None):
    return subprocess.Popen(["bash", "run.sh", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
                            start_new_session=True)


def finish(proc, timeout=400):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("run.sh did not finish in time:\n" + out[-5000:])
    return proc.returncode, out


def wait_for(cond, timeout, proc=None, what=""):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"run.sh exited early ({proc.returncode}) while waiting for {what}:\n"
                        + proc.stdout.read()[-5000:])
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def trainer_steps(run_dir):
    return [r["step"] for r in read_jsonl(Path(run_dir) / "metrics_trainer.jsonl")]


def check_run_dir(run_dir):
    run_dir = Path(run_dir)
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True)
    for role in ("actor", "verifier", "trainer"):
        assert read_jsonl(run_dir / f"metrics_{role}.jsonl"), f"no {role} metrics"
        info = json.loads((run_dir / f"run_info_{role}.json").read_text())
        if git.returncode == 0:  # the start-up record names the commit that ran (not "unknown")
            assert re.fullmatch(r"[0-9a-f]{40}", info["git_commit"]), info["git_commit"]
    # trained sequences: per-token versions; lag <= max_lag everywhere; in-flight updates happened
    records = read_jsonl(run_dir / "samples_trainer.jsonl")
    assert records
    spans_two, max_lag = False, 0
    for rec in records:
        for runs in rec["version_runs"]:  # run-length coded [[version, count], ...] per sequence
            versions = [v for v, _ in runs]
            if versions:
                spans_two |= len(set(versions)) >= 2
                max_lag = max(max_lag, rec["trainer_version"] - min(versions))
    assert spans_two, "no trained sequence had tokens from two policy versions"
    assert max_lag <= MAX_LAG
    # a checkpoint loadable by HF
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert ckpts and (ckpts[-1] / "COMPLETE").exists()
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(ckpts[-1])
    return ckpts


def test_e2e_single_node(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    rc, out = finish(start(short_config(tiny_model_dir, run_dir)))
    assert rc == 0, out[-6000:]
    assert re.search(r"step +4 \| reward", out), out[-3000:]  # one progress line per optimizer step
    assert "[run.sh] done" in out
    check_run_dir(run_dir)
    assert trainer_steps(run_dir)[-1] == 4
    assert read_jsonl(run_dir / "eval.jsonl"), "no test evaluation recorded"
    # the trained checkpoint also loads in vLLM and generates what HF generates
    ckpt = max((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    prompts = [[49, 50, 43, 51, 52, 61, 10], [57, 43, 57, 61, 10]]  # "12+34=\n", "9+9=\n" as bytes
    assert vllm_greedy(ckpt, prompts, 8) == hf_greedy(ckpt, prompts, 8)


def check_update_and_off_policy_metrics(run_dir, model_dir):
    """The actor's update timings and the trainer's off-policy diagnostics (steps that trained) as a
    real run logs them: present, finite, in range. Pauses: > 0 in some line, the max >= the mean.
    The engine's own stall around an update, where measured, holds that update's wire + load (they run
    one after the other in the worker).
    Per lag bucket: ESS (6) in (0, 1], clamp fraction in [0, 1]; lag 0 is on-policy (the same
    weights, fp32 both sides: w = 1 within ~1e-5), so its ESS is ~1. Entropy in (0, log V]."""
    run_dir = Path(run_dir)
    actor = [r for r in read_jsonl(run_dir / "metrics_actor.jsonl") if "actor/pause_s_mean" in r]
    pauses = [(r["actor/pause_s_mean"], r["actor/pause_s_max"]) for r in actor]
    assert pauses and all(math.isfinite(m) and 0 <= m <= top for m, top in pauses), pauses
    assert max(m for m, _ in pauses) > 0, "no update was timed"
    # An update's stall is measured only if the engine was decoding around it: in a 4-step run on a loaded
    # machine the engine can be idle at every update (the lag budget spent); test_switch_in_flight checks
    # that a stall is measured and reported.
    stalls = [(r["actor/update_stall_s"], r["actor/update_stall_wire_load_s"]) for r in actor
              if r["actor/update_stall_s"] is not None]
    assert all(math.isfinite(stall) and stall >= load > 0 for stall, load in stalls), stalls
    steps = [r for r in read_jsonl(run_dir / "metrics_trainer.jsonl")
             if r.get("trainer/trained_sequences")]  # token diagnostics describe trained sequences
    log_v = math.log(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    entropy = [r["trainer/entropy"] for r in steps]
    assert steps and all(0 < h <= log_v for h in entropy), entropy
    labels = loss.LAG_BUCKET_LABELS
    buckets = {label: [r for r in steps if f"trainer/ess_lag_{label}" in r] for label in labels}
    assert buckets["0"] and any(buckets[label] for label in labels[1:]), buckets
    for label, records in buckets.items():
        for r in records:
            ess, clamp = r[f"trainer/ess_lag_{label}"], r[f"trainer/clamp_lag_{label}"]
            assert 0 < ess <= 1 + 1e-9 and 0 <= clamp <= 1, (label, ess, clamp)
    assert all(r["trainer/ess_lag_0"] > 0.99 for r in buckets["0"]), buckets["0"]


def eos_model_dir(out_dir, p_eos=0.3):
    """A model whose next-token distribution is the same at every position, with P(EOS) = p_eos: completion
    lengths are geometric, so an overlong penalty gives some groups different rewards and others (every
    attempt short) the same ones. Attention and MLP outputs are zeroed and every embedding row is one
    vector e, so the final hidden state is h = norm(e); the EOS row of lm_head is set along h."""
    import numpy as np
    from safetensors.torch import load_file, save_file
    from scripts.make_tiny_model import make_tokenizer, random_model_dir
    d = random_model_dir(out_dir, seed=0)
    sd = load_file(os.path.join(d, "model.safetensors"))
    e = sd["model.embed_tokens.weight"][0].clone()
    sd["model.embed_tokens.weight"][:] = e
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k].zero_()
    h = e / e.pow(2).mean().sqrt() * sd["model.norm.weight"]
    head = sd["lm_head.weight"]
    head.zero_()  # every other token: logit 0
    V, eos = head.shape[0], make_tokenizer().eos_token_id
    head[eos] = float(np.log(p_eos * (V - 1) / (1 - p_eos))) * h / h.pow(2).sum()  # logit_eos = log(p(V-1)/(1-p))
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("schedule", ["pipeline", "conventional"])
def test_dropped_groups_do_not_stall_either_schedule(tmp_path, schedule):
    """verifier.drop_zero_adv_groups=true drops every group whose rewards are all equal (a third here: every
    attempt at most 4 tokens long, no penalty); the drops reach the actor's budget (store dropped/<proc>),
    so the run gets to trainer.max_steps with every token's lag <= max_lag (before drops were given back, it
    stalled on the first dropped group, or after ~max_lag*B drops). The pipeline run, whose groups carry gradient
    (unlike test_e2e_single_node's random model: reward 0 everywhere), also has its update and
    off-policy metrics checked."""
    run_dir = tmp_path / "run"
    extra = {"verifier.drop_zero_adv_groups": "true", "actor.max_tokens": 8, "verifier.overlong_buffer": 4,
             "trainer.max_steps": 4, "actor.eval_every": 0}
    if schedule == "conventional":
        extra.update({"actor.schedule": "conventional", "actor.G_steps": 2})
    model_dir = eos_model_dir(tmp_path / "model")
    rc, out = finish(start(short_config(model_dir, run_dir, **extra)), timeout=600)
    assert rc == 0, out[-6000:]
    assert trainer_steps(run_dir)[-1] == 4
    verifier = read_jsonl(run_dir / "metrics_verifier.jsonl")[-1]
    assert verifier["verifier/dropped_groups"] >= 1, verifier  # the drops happened
    assert_invariants(run_dir, ("lag", "groups", "tickets", "ids", "stalls"))
    if schedule == "pipeline":  # (conventional updates an idle engine: no stall to measure)
        check_update_and_off_policy_metrics(run_dir, model_dir)


def test_bad_config_fails_before_starting(tmp_path):
    r = subprocess.run(["bash", "run.sh", "actor.typo=1", f"run.dir={tmp_path}/x"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "actor.typo" in r.stderr
    assert not (tmp_path / "x").exists()


def test_a_long_command_line_with_its_run_dir_is_not_refused(tmp_path):
    """NNODES>1 wants run.dir on the command line. run.sh looked for it with `printf | grep -q` under
    pipefail: grep left at its match, and a printf still writing died of SIGPIPE and failed the check, now
    and then (a fault soak's 24 overrides hit it); with 80 KB after run.dir, every time. The config error
    that comes instead is the typo's."""
    flood = ["run.seed=1"] * 8000
    r = subprocess.run(["bash", "run.sh", f"run.dir={tmp_path}/x", *flood, "actor.typo=1"], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    assert r.returncode == 2 and "must be explicit" not in r.stderr, r.stderr[-2000:]
    assert "actor.typo" in r.stderr, r.stderr[-2000:]


def ports(run_dir):
    return [f"run.dir={run_dir}", f"sync.port={free_port()}", f"ports.rollouts={free_port()}",
            f"ports.samples={free_port()}", f"ports.ledger={free_port()}"]


def test_bad_override_prints_the_config_error_alone(tmp_path):
    r = subprocess.run(["bash", "run.sh", "trainer.lr=abc", *ports(tmp_path / "x")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == ["config error: trainer.lr: expected a number, got 'abc'"] and not r.stdout
    assert not (tmp_path / "x").exists()


def test_missing_model_fails_before_any_process_starts(tmp_path):
    r = subprocess.run(["bash", "run.sh", "model.path=/nonexistent", *ports(tmp_path / "x")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        "config error: model.path: '/nonexistent' is neither a local model directory nor a model in the local HF "
        "cache; point it at an HF model directory, or download it first (hf download /nonexistent)"]
    assert "started" not in r.stdout and not (tmp_path / "x").exists()


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_chat_model(out_dir, tied):
    """A random tiny Qwen2 (the real HF config class) with the char tokenizer and a ChatML-style template."""
    import torch
    from transformers import Qwen2ForCausalLM
    from scripts.make_tiny_model import make_tokenizer, save, tiny_config
    config = tiny_config(max_pos=1024)  # chat prompts of GSM8K questions: ~300 byte tokens
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return save(model, tokenizer, out_dir)


def gsm8k_folder(path, n_train=20, n_test=4):
    """GSM8K's format ({"question", "answer" ending in "#### N"}) as a local HF dataset folder."""
    path.mkdir()
    for split, n, off in (("train", n_train, 0), ("test", n_test, 100)):
        rows = [{"question": f"Natalia sold {a} clips in April and {a + 7} clips in May. How many clips did "
                             f"Natalia sell altogether in April and May?",
                 "answer": f"In May she sold {a}+7 = <<{a}+7={a + 7}>>{a + 7} clips.\nAltogether "
                           f"{a}+{a + 7} = <<{a}+{a + 7}={2 * a + 7}>>{2 * a + 7} clips.\n#### {2 * a + 7}"}
                for a in range(off + 3, off + 3 + n)]
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gpu_recipe_runs_on_cpu_with_what_run_sh_installs(tmp_path):
    """configs/qwen2.5-1.5b-gsm8k.yaml's own keys (math task, HF-dataset loader, chat prompts, its
    lr, lag and activation checkpointing: read back from the run's resolved config) on a tied tiny
    Qwen2, with only the CPU-scale keys overridden. Answers are graded by math_verify: some are
    `wrong` or `correct`, statuses only its parse of a number gives (no number: `no_answer`). That
    checkpointing really recomputes is shown in test_trainer.py, not here."""
    model = tiny_chat_model(tmp_path / "model", tied=True)
    data = gsm8k_folder(tmp_path / "gsm8k")
    run_dir = tmp_path / "run"
    cpu_scale = ["actor.engines=1", "trainer.nproc=1", "model.dtype=float32",
                 "trainer.batch_size=16", "actor.max_inflight=32", "actor.max_tokens=24", "trainer.max_steps=3",
                 "verifier.workers=1", "run.peer_timeout_s=120", "run.restart_s=60"]
    rc, out = finish(start(["configs/qwen2.5-1.5b-gsm8k.yaml", f"model.path={model}", f"data.train_path={data}",
                            f"data.test_path={data}", *cpu_scale, *ports(run_dir)]))
    assert rc == 0, out[-6000:]
    assert trainer_steps(run_dir)[-1] == 3
    resolved = common.load_config([], path=run_dir / "config.yaml")
    assert (resolved.data.task, resolved.data.prompt_format, resolved.trainer.lr) == ("math", "chat", 1e-6)
    assert resolved.actor.max_lag == 8 and resolved.trainer.activation_checkpointing
    verifier = read_jsonl(run_dir / "metrics_verifier.jsonl")[-1]  # counts since the start
    assert verifier["verifier/status_wrong"] + verifier["verifier/status_correct"] > 0, verifier
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert evals and evals[0]["version"] == 0 and evals[0]["n"] == 4  # the 4 test problems
    assert len(read_jsonl(run_dir / "samples_trainer.jsonl")) == 3


TOOL_TEMPLATE = (  # Qwen2.5's template in short: the tools in a system message, calls in <tool_call> tags
    "{% if tools %}<|im_start|>system\nTools:\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'


def tiny_tool_model(out_dir, problems, steps=400):
    """A tiny Qwen2 with the special tokens of Qwen2.5's chat and tool-call protocol, trained for ~30 s
    to answer each of `problems` (every prompt of the run: it learns them by heart, nothing more) with
    one call of the Python tool, then, once the tool's answer is back, `\\boxed{42}`: a random-init model
    would never call it."""
    import torch
    from transformers import Qwen2ForCausalLM
    from scripts.make_tiny_model import make_tokenizer, save, tiny_config
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<tool_call>",
                                                                "</tool_call>"]})
    tokenizer.chat_template = TOOL_TEMPLATE
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(max_pos=1024))
    assert len(tokenizer) <= model.config.vocab_size
    answer = envs.PythonTool.answer.format("42\n")
    rows = []
    for p in problems:
        prompt = tokenizer(tasks.format_prompt(p, tokenizer, "chat", envs.PythonTool.tools))["input_ids"]
        completion = tokenizer(CALL + answer + "\\boxed{42}", add_special_tokens=False)["input_ids"]
        rows.append((prompt, completion + [tokenizer.eos_token_id]))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / steps)  # to 0: it ends converged
    for i in range(steps):
        prompt, completion = rows[i % len(rows)]
        ids = torch.tensor([prompt + completion])
        labels = ids.clone()
        labels[0, :len(prompt)] = -100
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        decay.step()
    return save(model, tokenizer, out_dir)


def test_the_python_tool_config_on_a_tiny_model_of_its_protocol(tmp_path):
    """configs/qwen2.5-1.5b-instruct-python.yaml's keys (actor.env=python, chat prompts listing the tool,
    4 turns) with only the CPU-scale keys overridden, on a tiny Qwen2 of its tokenizer's protocol that calls
    the tool: episodes of two turns whose tool tokens (the sandbox's `42`, in the template's tool message)
    are in the stream and carry no loss."""
    data = gsm8k_folder(tmp_path / "gsm8k")
    problems = [p for split in ("train", "test") for p in tasks.math_problems(f"{data}/{split}.jsonl", split)]
    model = tiny_tool_model(tmp_path / "model", problems)
    run_dir = tmp_path / "run"
    cpu_scale = ["actor.engines=1", "trainer.nproc=1", "model.dtype=float32", "trainer.batch_size=16",
                 "actor.max_inflight=32", "actor.max_tokens=160", "trainer.max_steps=3", "verifier.workers=1",
                 "run.peer_timeout_s=120", "run.restart_s=60", "trainer.lr=1e-6"]
    rc, out = finish(start(["configs/qwen2.5-1.5b-instruct-python.yaml", f"model.path={model}",
                            f"data.train_path={data}", f"data.test_path={data}", *cpu_scale, *ports(run_dir)]))
    assert rc == 0, out[-6000:]
    resolved = common.load_config([], path=run_dir / "config.yaml")
    assert (resolved.actor.env, resolved.actor.max_turns, resolved.data.prompt_format) == ("python", 4, "chat")
    steps = [r for r in read_jsonl(run_dir / "metrics_trainer.jsonl") if "trainer/loss" in r]
    assert len(steps) == 3 and all(r["trainer/turns_mean"] > 1 and r["trainer/env_tokens"] > 0
                                   for r in steps), steps
    # the greedy evaluation's episode, as the verifier read it (special tokens skipped): the call, the
    # sandbox's output in the tool message, the answer
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert evals and evals[0]["n"] == 4
    assert evals[0]["example"] == ('\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n\nuser\n'
                                   '<tool_response>\n42\n\n</tool_response>\nassistant\n\\boxed{42}'), evals[0]


def _descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def assert_invariants(run_dir, names):
    """scripts/check_run.py's invariants `names` hold in the run's files (e.g. "lag": every trained
    token's lag in [0, actor.max_lag]); the offending items if not."""
    failed = [f"{name}: {detail}" for name, ok, detail in check_run.check(run_dir)
              if name in names and not ok]
    assert not failed, failed


def _role_pid(run_dir, role):
    return json.loads((Path(run_dir) / f"run_info_{role}.json").read_text())["pid"]


def failures(out) -> list:
    """run.sh's `FAILED: role ...` lines, in order -> [(role, exit code)]."""
    return re.findall(r"\[run.sh\] FAILED: role '(\w+)' exited with code (\d+)", out)


def test_killed_role_stops_everything_without_restarts(tiny_model_dir, tmp_path):
    """run.max_restarts=0 and SIGKILL the actor: run.sh sees that death first and stops the others itself.
    The one failure it reports is the killed role's, with our signal's exit code (128 + 9); a run.sh that
    left the others running until one of them noticed (run.peer_timeout_s) would report that one instead."""
    run_dir = tmp_path / "run"
    proc = start(short_config(tiny_model_dir, run_dir, **{"trainer.max_steps": 1000, "run.max_restarts": 0}))
    wait_for(lambda: len(trainer_steps(run_dir)) >= 1, 300, proc, "the first optimizer step")
    procs = _descendants(proc.pid)
    os.kill(_role_pid(run_dir, "actor"), signal.SIGKILL)
    rc, out = finish(proc, timeout=60)
    assert rc != 0 and failures(out) == [("actor", "137")], out[-3000:]
    time.sleep(1)
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphans: {[(p.pid, p.cmdline()[:3]) for p in alive]}"


def test_killed_trainer_restarts_from_its_checkpoint(tiny_model_dir, tmp_path):
    """SIGKILL the trainer after a checkpoint: run.sh starts it again from that checkpoint (run.resume=true)
    while the actor keeps its engine (the same process, one engine start), and the run completes. The
    restarted trainer cuts: no token sampled by a version newer than the one it trains is ever trained (in
    the timeline that stays: the checkpoint's steps, then the new trainer's), every group id below the
    checkpoint's last trained one is trained on (those in flight at the checkpoint come first)."""
    run_dir = tmp_path / "run"
    # long enough that the kill comes mid-run (~8 steps/s here); every checkpoint kept, to read the resumed one's
    steps = 200
    args = short_config(tiny_model_dir, run_dir, **{"trainer.max_steps": steps, "trainer.checkpoint_every": 10,
                                                    "trainer.keep_checkpoints": steps})
    proc = start(args)
    ckpt = run_dir / "checkpoints" / "step-10" / "COMPLETE"
    wait_for(ckpt.exists, 300, proc, "checkpoint step-10")
    actor_pid = _role_pid(run_dir, "actor")
    os.kill(_role_pid(run_dir, "trainer"), signal.SIGKILL)
    rc, out = finish(proc, timeout=400)
    assert rc == 0 and "role 'trainer' exited with code 1; starting it again (1 of" in out, out[-6000:]
    actor_log = (run_dir / "logs" / "actor.log").read_text()
    # the actor was not restarted (if it was: run.sh's lines and the actor's own, not its step lines)
    said = [x for x in (out + actor_log).splitlines() if "] step " not in x and x.startswith(("[run.sh]", "[actor]"))]
    assert _role_pid(run_dir, "actor") == actor_pid, "\n".join(said) + actor_log[-4000:]
    assert actor_log.count("engine 0: up in") == 1, actor_log[-3000:]
    # the timeline that stays: each trainer's records, the later one replacing the steps it redid
    kept = timeline(read_samples(run_dir))
    resumed_at = int(re.findall(r"resumed from \S+/step-(\d+)", (run_dir / "logs" / "trainer.log").read_text())[-1])
    assert [r["step"] for r in kept if r["rank"] == 0] == list(range(1, steps + 1))
    assert_invariants(run_dir, ("lag", "steps", "groups", "tickets", "ids", "stalls"))
    trained = {g for r in kept for g in r["group_ids"]}
    meta = json.loads((run_dir / "checkpoints" / f"step-{resumed_at}" / "trainer_state.json").read_text())
    done = set(range(meta["done_below"])) | set(meta["done_above"])
    assert done <= trained, sorted(done - trained)  # (no group is dropped in this run)


def test_five_seeded_faults_kills_and_hangs_at_max_lag_0(tiny_model_dir, tmp_path, capsys):
    """bench/chaos.py --hang, 5 faults on one node at actor.max_lag=0 drawn by seed 111: the verifier
    stopped (SIGSTOP: nothing dies), trainer rank 0 stopped, the actor killed, the actor and the verifier or
    the trainer killed at once, the engine core stopped; each a drawn 5-15 steps after training moved again
    (run.hang_timeout_s=15). Each hang is found by the progress it stops, named, killed and started again;
    every fault is survived within its stated bound; scripts/check_run.py finds every invariant held (lags
    in [0, 0], steps once, groups whole and once, every ticket closed, no id skipped); run.sh restarted no
    role that did not fail, and nothing of a failed role lives on (a SIGKILLed actor's vLLM engine core
    did, for good). Before (90804ca), a stopped engine core made the trainer restart itself from step 0
    until run.max_restarts, and a stopped trainer rank sat silent for good; one actor killed at max_lag=0
    stalled the trainer until run.peer_timeout_s in 2 of 5 trials; and after the actor and the verifier
    were killed at once, the trainer once heard nothing from the restarted verifier until
    run.peer_timeout_s (test_trainer.py: a connection that brings nothing is made again)."""
    import sys
    sys.path.insert(0, str(REPO / "bench"))
    import chaos
    rc = chaos.main(["--kills", "5", "--seed", "111", "--hang", "--actors", "1", "--nproc", "1",
                     "--workers", "2", "--max-lag", "0", "--model", str(tiny_model_dir), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "chaos.json").read_text())
    logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("node*.log"))
    kinds = [k["kind"] for k in summary["kills"]]
    assert kinds == ["verifier_stop", "trainer_stop", "actor", "two", "engine_stop"], summary
    assert summary["kills_done"] == 5 and rc == 0, f"{out}\n{json.dumps(summary, indent=1)}\n{logs}"

def test_run_dir_resume_takes_the_newest_run_and_a_used_run_dir_is_refused(tmp_path, monkeypatch):
    """scripts/launch.resolve_run_dir, what run.sh's start-up calls, on a scratch runs/ folder (its
    module's REPO): run.resume=true without run.dir continues the newest run (by modification time,
    not name; a folder without config.yaml is no run), and fails when there is none; a run.dir that
    holds metrics of this node's roles is refused without run.resume=true and reused with it, except
    by a node of actors only (it rejoins the live run)."""
    from common import ConfigError
    from scripts import launch
    monkeypatch.setattr(launch, "REPO", tmp_path)
    runs = tmp_path / "runs"

    def resolve(*overrides, roles=("verifier", "trainer", "actor")):
        return launch.resolve_run_dir(common.load_config(list(overrides)), list(roles))

    with pytest.raises(ConfigError, match="no run under runs/ to resume"):
        resolve("run.resume=true")
    for name, age_s in (("a-newest", 100), ("b-older", 200), ("c-not-a-run", 0)):
        (runs / name).mkdir(parents=True)
        if name != "c-not-a-run":
            (runs / name / "config.yaml").write_text("")
        os.utime(runs / name, (time.time() - age_s, time.time() - age_s))
    assert resolve("run.resume=true") == str(runs / "a-newest")
    fresh = Path(resolve())  # no run.dir, no resume: a new runs/<time>
    assert fresh.parent == runs and not fresh.exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics_trainer.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"already holds a run \(trainer metrics\)"):
        resolve(f"run.dir={used}")
    assert resolve(f"run.dir={used}", "run.resume=true") == str(used)
    assert resolve(f"run.dir={used}", roles=["actor"]) == str(used)  # an actor-only node's roles
    (used / "metrics_actor.jsonl").write_text("{}\n")  # an actor node that rejoins the running run
    assert resolve(f"run.dir={used}", roles=["actor"]) == str(used)
    with pytest.raises(ConfigError, match=r"already holds a run \(verifier metrics\)"):
        (used / "metrics_verifier.jsonl").write_text("{}\n")
        resolve(f"run.dir={used}", roles=["verifier", "actor"])


def test_two_nodes_on_loopback(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = short_config(tiny_model_dir, run_dir, **{"trainer.cpu_cores": "1", "verifier.cpu_cores": "1",
                                                    "actor.cpu_cores": "0"})
    env = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1"}
    node0 = start(args, {**env, "NODE_RANK": "0"})
    node1 = start(args, {**env, "NODE_RANK": "1"})
    rc0, out0 = finish(node0)
    rc1, out1 = finish(node1, timeout=120)
    assert rc0 == 0, out0[-5000:]
    assert rc1 == 0, out1[-5000:]
    assert "runs: store verifier trainer" in out0 and "runs: watch actor" in out1
    check_run_dir(run_dir)


def test_the_stores_death_ends_every_node_within_a_minute(tiny_model_dir, tmp_path):
    """The run's store (node 0's elastic.py: the store and the ledger) killed mid-run, three nodes: node 0 (store, verifier,
    trainer rank 0), node 1 (trainer rank 1: trainer.nnodes=2), node 2 (an actor). Node 0's run.sh stops (the
    store is never restarted); node 2's actor says it lost the store and exits 3, which its run.sh does not
    restart; node 1's torchrun fails with status 1 (it reports a rank's exit as its own failure), and its
    run.sh, finding the store gone, does not restart it either. Every node ends within 60 s, with one line
    naming the store. Before, an actor-only node restarted its actor, which waited run.peer_timeout_s in the
    store's connect at every start (~15 min at the defaults), and a trainer-only node restarted torchrun."""
    run_dir = tmp_path / "run"
    args = short_config(tiny_model_dir, run_dir, **{"trainer.cpu_cores": "1", "verifier.cpu_cores": "1",
                                                    "actor.cpu_cores": "0", "trainer.max_steps": 100000,
                                                    "trainer.nnodes": 2, "run.peer_timeout_s": 300})
    env = {"NNODES": "3", "MASTER_ADDR": "127.0.0.1"}
    nodes = [start(args, {**env, "NODE_RANK": str(k)}) for k in range(3)]
    wait_for(lambda: len(trainer_steps(run_dir)) >= 3, 300, nodes[0], "step 3")
    store = [p for p in psutil.process_iter(["pid", "cmdline"])
             if any(c.endswith("elastic.py") for c in p.info["cmdline"] or [])
             and "watch" not in p.info["cmdline"] and f"run.dir={run_dir}" in p.info["cmdline"]]
    assert len(store) == 1, store
    store[0].kill()
    t0 = time.time()
    outs = [finish(node, timeout=max(1, 60 - (time.time() - t0))) for node in nodes]
    assert time.time() - t0 < 60
    (rc0, out0), (rc1, out1), (rc2, out2) = outs
    assert rc0 != 0 and "FAILED: role 'store' exited" in out0, out0[-3000:]
    for rc, out in ((rc1, out1), (rc2, out2)):
        assert rc != 0 and "lost the run's store" in out, out[-3000:]
        assert "starting it again" not in out, out[-3000:]


def test_readme_paths_exist():
    text = (REPO / "README.md").read_text()
    paths = set(re.findall(r"`((?:[\w.-]+/)*[\w.-]+\.(?:py|sh|yaml|md|txt|jsonl))`", text))
    paths |= set(re.findall(r"\]\(((?!http)[^)#]+)\)", text))
    assert len(paths) >= 8
    missing = [p for p in paths if not (REPO / p).exists() and not p.startswith(("runs/", "assets/"))]
    assert not missing, missing
    # the role table's line counts stay honest (within 10%)
    for name, lines in re.findall(r"\| `(\w+\.py)` \| (\d+) \|", text):
        actual = sum(1 for _ in open(REPO / name))
        assert abs(actual - int(lines)) <= 0.1 * actual, (name, lines, actual)
