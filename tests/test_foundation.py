"""Tier (a)/(b): config, wire format, tasks, tokenizer, the tiny model in HF and vLLM.

Run: bash run.sh test tests/test_foundation.py
"""
import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

import common
import tasks
from common import ConfigError, WireError
from scripts import telemetry
from conftest import REPO, free_port, hf_greedy, read_jsonl, recv, send, vllm_greedy


# --- config -----------------------------------------------------------------------------------------

def test_config_yaml_is_the_one_source_of_defaults():
    """Every key's default and type come from config.yaml (the one place a default lives): the section
    dataclasses have its keys as fields, with no default of their own, typed by the YAML value; each key
    has its comment."""
    import dataclasses
    import yaml
    cfg = common.load_config()
    assert cfg.trainer.batch_size % cfg.actor.group_size == 0
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    for section, cls in common.SECTIONS.items():
        fields = dataclasses.fields(cls)
        assert [f.name for f in fields] == list(raw[section]), section
        assert all(f.default is dataclasses.MISSING for f in fields), section
        for f in fields:
            value = getattr(getattr(cfg, section), f.name)
            assert value == (tuple(raw[section][f.name]) if isinstance(value, tuple) else raw[section][f.name])
            assert isinstance(value, f.type), (section, f.name)
    for line in (REPO / "config.yaml").read_text().splitlines():
        if line.startswith("  ") and ":" in line and not line.strip().startswith("#"):
            assert "#" in line, f"config.yaml field without a comment: {line!r}"


def test_override_types():
    cfg = common.load_config(["trainer.lr=3e-5", "actor.max_lag=2", "run.resume=true",
                              "trainer.betas=[0.8,0.9]", "run.dir=/tmp/x"])
    assert cfg.trainer.lr == 3e-5 and isinstance(cfg.trainer.lr, float)
    assert cfg.actor.max_lag == 2 and cfg.run.resume is True
    assert cfg.trainer.betas == (0.8, 0.9)
    assert str(cfg.run_dir) == "/tmp/x"
    with pytest.raises(Exception):  # frozen
        cfg.trainer.lr = 1.0


@pytest.mark.parametrize("override,needle", [
    ("actor.nope=1", "unknown key 'actor.nope'"),
    ("nosection.x=1", "unknown section 'nosection'"),
    ("trainer.lr=fast", "trainer.lr: expected a number"),
    ("actor.max_lag=1.5", "actor.max_lag: expected an integer"),
    ("run.resume=3", "run.resume: expected true or false"),
    ("trainer.betas=[0.9]", "trainer.betas: expected a list of 2 numbers"),
    ("trainer.batch_size=100", "multiple of actor.group_size=8"),
    ("trainer.nproc=3", "divisible by the trainer ranks"),
    ("actor.schedule=async", "actor.schedule='async'; allowed: pipeline, conventional"),
    ("actor.temperature=0", "actor.temperature=0.0: must be > 0"),
    ("actor.group_size=0", "actor.group_size=0: must be >= 1"),
    ("data.task=math", "data.task=math needs data.train_path"),
    ("actor.env=python", "actor.env=python: its calls and answers follow the model's chat template"),
    ("actor.env=bash", "actor.env='bash'; allowed: \"\", calc, python"),
    ("trainer.lr", "expected section.key=value"),
])
def test_bad_config_names_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        common.load_config([override])
    assert needle in str(e.value)


def test_conventional_needs_lag_room():
    common.load_config(["actor.schedule=conventional", "actor.G_steps=4", "actor.max_lag=3"])
    with pytest.raises(ConfigError, match="G_steps-1"):
        common.load_config(["actor.schedule=conventional", "actor.G_steps=4", "actor.max_lag=2"])


def test_check_cli_exits_nonzero_before_anything_starts():
    ok = subprocess.run([sys.executable, "scripts/launch.py", "check", "trainer.lr=1e-5"], cwd=REPO,
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "lr: 1.0e-05" in ok.stdout
    bad = subprocess.run([sys.executable, "scripts/launch.py", "check", "trainer.bogus=1"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "trainer.bogus" in bad.stderr


def test_run_info_and_metrics(tmp_path):
    cfg = common.load_config([f"run.dir={tmp_path}"])
    telemetry.setup_logging(cfg, "actor")  # every role's start-up: the record (write_run_info), then its metrics file
    info = json.loads((tmp_path / "run_info_actor.json").read_text())
    assert info["versions"]["torch"] and info["git_commit"]
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode == 0:
        assert re.fullmatch(r"[0-9a-f]{40}", info["git_commit"]), info["git_commit"]  # "unknown"?
    assert common.load_config([], path=tmp_path / "config.yaml") == cfg  # resolved config reloads
    telemetry.log("actor", {"tokens_per_s": 12.5, "lag_max": 3}, step=7)
    rec = read_jsonl(tmp_path / "metrics_actor.jsonl")[-1]
    assert rec["step"] == 7 and rec["actor/tokens_per_s"] == 12.5 and rec["actor/lag_max"] == 3


def test_wandb_offline_mirror(tmp_path, monkeypatch):
    """run.wandb=true mirrors every logged record to Weights & Biases (offline mode: no network)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = common.load_config([f"run.dir={tmp_path}", "run.wandb=true"])
    telemetry.setup_logging(cfg, "verifier")
    run = telemetry._log_state["verifier"]["wandb"]
    assert run is not None
    telemetry.log("verifier", {"reward_mean": 0.625, "queue_depth": 3}, step=1)
    run.finish()
    files = list(tmp_path.glob("wandb/offline-run-*/*.wandb"))
    assert len(files) == 1
    for _ in range(60):  # wandb-core may still be writing the file after finish() returns (seen: 7 bytes)
        blob = files[0].read_bytes()
        if b"verifier/queue_depth" in blob:
            break
        time.sleep(0.5)
    assert b"verifier/reward_mean" in blob and b"0.625" in blob and b"verifier/queue_depth" in blob
    assert read_jsonl(tmp_path / "metrics_verifier.jsonl")[-1]["verifier/reward_mean"] == 0.625


# --- wire format --------------------------------------------------------------------------------------

def _rollout(n=5):
    header = {"group_id": 3, "sample_idx": 1, "group_size": 8, "task": "arithmetic", "answer": "42",
              "finish_reason": "stop", "t_start": 1.0, "t_end": 2.5, "ticket": 1, "epoch": 1, "eval": False,
              "turns": 1, "env_reward": 0.0}
    arrays = {"prompt_ids": np.arange(4, dtype=np.int32), "completion_ids": np.arange(n, dtype=np.int32),
              "logprobs": -np.ones(n, dtype=np.float32), "versions": np.zeros(n, dtype=np.int32)}
    return header, arrays


def test_wire_roundtrip_over_zmq():
    ctx = zmq.Context.instance()
    port = free_port()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{port}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    h, a = _rollout()
    send(push, h, a)
    sample = {**h, "reward": 1.0, "status": "correct", "advantage": 0.5, "verifier": 1, "order": 0}
    send(push, sample, a)
    h2, a2 = recv(pull, "rollout")
    h3, a3 = recv(pull, "sample")
    assert h2 == h and h3 == sample
    for k in a:
        assert a2[k].dtype == a[k].dtype and np.array_equal(a2[k], a[k]) and np.array_equal(a3[k], a[k])
    push.close(0)
    pull.close(0)


def test_wire_malformed_raises_wire_error_only():
    h, a = _rollout()
    good = common.encode(h, a)
    cases = {
        "truncated frame": good[:1] + [good[1][:-4]] + good[2:],
        "missing frame": good[:-1],
        "bad json": [b"{not json"] + good[1:],
        "not utf8": [b"\xff\xfe"] + good[1:],
        "wrong dtype": common.encode(h, {**a, "logprobs": a["logprobs"].astype(np.float64)}),
        "wrong length": common.encode(h, {**a, "versions": np.zeros(3, dtype=np.int32)}),
        "missing field": common.encode({k: v for k, v in h.items() if k != "answer"}, a),
        "wrong field type": common.encode({**h, "group_id": "3"}, a),
        "bool as int": common.encode({**h, "group_size": True}, a),
        "missing array": common.encode(h, {k: v for k, v in a.items() if k != "versions"}),
        "bad sample_idx": common.encode({**h, "sample_idx": 8}, a),
        "empty": [],
        "header not object": [b"[1,2]"],
        "NaN logprob": common.encode(h, {**a, "logprobs": np.array([-1, np.nan, -1, -1, -1], np.float32)}),
        "-inf logprob": common.encode(h, {**a, "logprobs": np.array([-1, -np.inf, -1, -1, -1], np.float32)}),
        "NaN header float": common.encode({**h, "t_end": float("nan")}, a),  # JSON encodes it as NaN
        "eval not a bool": common.encode({**h, "eval": 1}, a),
        # the trainer merges arrays into the header: an extra array would replace its advantage
        "array outside the schema": common.encode(h, {**a, "advantage": np.zeros(1, np.float32)}),
        "id over int32": common.encode({**h, "group_id": 2**31}, a),
    }
    # episodes (envs.py): the model's tokens (version >= 0) and the environment's (version -1, logprob 0)
    episode = {**a, "versions": np.array([0, 0, -1, -1, 1], np.int32),
               "logprobs": np.array([-1, -1, 0, 0, -1], np.float32)}
    assert common.decode(common.encode(h, episode), "rollout")[1]["versions"].tolist() == [0, 0, -1, -1, 1]
    cases.update({
        "environment token first": common.encode(h, {**episode, "versions": np.array([-1, 0, -1, -1, 1], np.int32),
                                                     "logprobs": np.array([0, -1, 0, 0, -1], np.float32)}),
        "environment token with a logprob": common.encode(h, {**episode, "logprobs": -np.ones(5, np.float32)}),
        "model versions going back": common.encode(h, {**episode, "versions": np.array([1, 1, -1, -1, 0], np.int32)}),
        "version below -1": common.encode(h, {**episode, "versions": np.array([0, 0, -2, -2, 1], np.int32)}),
    })
    for name, frames in cases.items():
        with pytest.raises(WireError):
            common.decode(frames, "rollout")
            pytest.fail(name)
    with pytest.raises(WireError, match="missing field 'reward'"):
        common.decode(good, "sample")
    sample = {**h, "reward": 1.0, "status": "correct", "advantage": 0.5, "verifier": 1, "order": 0}
    for bad in ({"advantage": float("nan")}, {"advantage": float("inf")}, {"reward": float("-inf")}):
        with pytest.raises(WireError, match="finite"):  # a non-finite advantage never reaches the loss
            common.decode(common.encode({**sample, **bad}, a), "sample")
    with pytest.raises(WireError, match="not allowed"):
        common.encode(h, {"x": np.array(["a"])})


def test_no_pickle_anywhere():
    for f in ["common.py", "actor.py", "verifier.py", "trainer.py", "weights_sync.py"]:
        p = REPO / f
        if p.exists():
            src = p.read_text()
            assert "import pickle" not in src and "recv_pyobj" not in src and "send_pyobj" not in src, f


# --- tasks ----------------------------------------------------------------------------------------------

def test_arithmetic_splits_disjoint_answers_correct_lengths_spread():
    cfg = common.load_config()
    train, test = tasks.load_tasks(cfg)
    assert len(test) == cfg.data.test_size == len({p.prompt for p in test})
    train_items = [train.get(i) for i in range(3000)]
    assert not {p.prompt for p in train_items} & {p.prompt for p in test}
    for p in train_items[:500] + test:
        a, b = map(int, p.prompt.strip().rstrip("=").split("+"))
        assert int(p.answer) == a + b
        assert tasks.arithmetic_final_answer(p.target) == p.answer
        # the worked solution adds up column by column
        for line in p.target.splitlines()[:-1]:
            lhs, rhs = line.split("=")
            assert sum(map(int, lhs.split("+"))) == int(rhs)
    lengths = [len(p.target) for p in train_items]
    assert max(lengths) >= 4 * min(lengths)
    fresh, _ = tasks.load_tasks(cfg)  # addressable by cursor (resume): a new stream, from 17 on
    assert [fresh.get(i) for i in (17, 2999, 5)] == [train_items[i] for i in (17, 2999, 5)]
    other, _ = tasks.load_tasks(common.load_config(["run.seed=1"]))
    assert [other.get(i) for i in range(20)] != train_items[:20]


def test_math_loaders_and_prompt_formats(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"question": "2+2?", "answer": "two plus two\n#### 4"},
        {"problem": "Half?", "answer": "\\frac{1}{2}"},
        {"problem": "Sol?", "solution": "so \\boxed{\\frac{3}{\\sqrt{2}}} done"},
        {"question": "Big?", "answer": "#### 1,000"},
    ]) + "\n")
    probs = tasks.math_problems(str(path), "train")
    assert [p.answer for p in probs] == ["4", "\\frac{1}{2}", "\\frac{3}{\\sqrt{2}}", "1000"]
    assert all(p.task == "math" for p in probs)
    cfg = common.load_config(["data.task=math", f"data.train_path={path}", f"data.test_path={path}"])
    train, test = tasks.load_tasks(cfg)
    assert len(test) == 4 and train.get(0).task == "math"
    assert tasks.format_prompt(probs[0]) == "2+2?"
    assert tasks.extract_boxed("a \\boxed{1} b \\boxed{x^{2}}") == "x^{2}"
    assert tasks.extract_boxed("no box") is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(SystemExit, match="needs 'problem' or 'question'"):
        tasks.math_problems(str(bad), "train")


def test_chat_prompt_format_uses_template():
    class Tok:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "<user>" + messages[0]["content"] + "<assistant>"
    p = tasks.Problem("What is 1+1?", "2", "math")
    out = tasks.format_prompt(p, Tok(), "chat")
    assert out.startswith("<user>What is 1+1?") and "\\boxed{}" in out and out.endswith("<assistant>")


# --- tokenizer + tiny model -------------------------------------------------------------------------

def test_tokenizer_roundtrips_identically(tiny_model_dir):
    from transformers import AutoTokenizer
    from scripts.make_tiny_model import make_tokenizer
    fast = make_tokenizer()
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["47+385=\n", tasks.arithmetic_problem(9999, 9999).target, " two  spaces\n\nnewlines\t tab ",
             "\\boxed{\\frac{1}{2}} ünïcödé ∑"]
    for t in texts:
        ids = fast.backend_tokenizer.encode(t, add_special_tokens=False).ids
        assert auto(t, add_special_tokens=False)["input_ids"] == ids
        assert len(ids) == len(t.encode("utf-8"))  # one token per byte: no merges
        assert auto.decode(ids) == t == fast.decode(ids)
    assert auto.eos_token_id == 256


def test_tiny_model_hf_and_vllm_greedy_agree(tiny_model_dir):
    """The embedded architecture loads in HF and in vLLM, and greedy generations match."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.8e6 < n_params < 1.5e6 and not model.config.tie_word_embeddings
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["12+34=\n", "9+9=\n", "1234+5678=\n"]]
    assert vllm_greedy(tiny_model_dir, prompts) == hf_greedy(tiny_model_dir, prompts)


def test_reading_guide_names_exist():
    """docs/READING.md maps the paper to `file.py:function` (or `file.py:Class.method`): each must exist."""
    import ast
    import re
    text = (REPO / "docs" / "READING.md").read_text()
    refs = {r for r in re.findall(r"`(\w+\.py):([\w.]+)`", text) if r[0] != "file.py"}
    assert len(refs) >= 12, refs
    for path, name in refs:
        tree = ast.parse((REPO / path).read_text())
        scope = tree.body
        for part in name.split("."):
            found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part]
            assert found, f"docs/READING.md names {path}:{name}, which does not exist"
            scope = found[0].body


# The store keys an earlier fault layer kept (the ledger now owns its books in memory: none may come back into
# the algorithm) and the calls through which the algorithm reaches the fault layer: a function docs/READING.md
# cites names neither the keys nor anything else of elastic.py.
FAULT_KEYS = ("actor/incarnations", "alive/", "groups/next", "redo/", "ids/", "budget/", "dropped/",
              "forwarded/", "oldest/", "verifier/incarnations", "trainer/epoch", "group/")
NAMED_CALLS = {"Client", "Progress", "store_lost", "unless_store_lost"}


def reading_functions():
    """[(file.py:name, its ast node)] of every function or class docs/READING.md cites."""
    import ast
    import re
    text = (REPO / "docs" / "READING.md").read_text()
    out = []
    for path, name in sorted({r for r in re.findall(r"`(\w+\.py):([\w.]+)`", text) if r[0] != "file.py"}):
        scope = ast.parse((REPO / path).read_text()).body
        for part in name.split("."):
            node = next(n for n in scope if getattr(n, "name", None) == part)
            scope = node.body
        out.append((f"{path}:{name}", node))
    return out


def test_the_reading_path_reaches_the_fault_layer_only_through_its_named_calls():
    """A newcomer following docs/READING.md beside the paper meets the paper's steps, not the fault layer.
    Each function it cites holds no store key of the fault layer and reaches elastic.py only by calling one of
    its few named entry points (`common.LedgerClient(...)`, `elastic.Progress(...)`, ...), never its internals.
    Fails, e.g., on actor.Actor.run keeping incarnations in the store, or a function reading elastic.Ledger's
    books."""
    import ast
    bad = []
    for ref, node in reading_functions():
        body = node.body[1:] if ast.get_docstring(node) else node.body  # the docstring may explain
        for stmt in body:
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    bad += [f"{ref}: store key {k!r}" for k in FAULT_KEYS if k in sub.value]
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id == "elastic" and sub.attr not in NAMED_CALLS):
                    bad.append(f"{ref}: elastic.{sub.attr}")
    assert not bad, bad
    assert len(reading_functions()) >= 12


def test_compute_dtype_is_one_rule_for_trainer_and_engine():
    """model.dtype=auto: bfloat16 on GPU, float32 on CPU (config.yaml); an explicit dtype wins on both."""
    cfg = common.load_config([])
    assert (cfg.compute_dtype(True), cfg.compute_dtype(False)) == ("bfloat16", "float32")
    assert common.load_config(["model.dtype=float16"]).compute_dtype(False) == "float16"


def test_every_test_has_a_time_limit(request):
    """A hang costs one failed test, not the whole suite (a CI run once hung past its limit)."""
    assert request.config.pluginmanager.hasplugin("timeout"), "pip install pytest-timeout"
    from conftest import TEST_TIMEOUT_S
    assert request.node.get_closest_marker("timeout").args == (TEST_TIMEOUT_S,)
