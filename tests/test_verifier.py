# Tiers (a) + (b): tasks.score on a table of answers, ScorePool against hostile input with real
# worker processes, and verifier.py as a subprocess between real ZMQ sockets (CPU, ~60 s on 2 busy cores).
# Run: bash run.sh test tests/test_verifier.py    or    .venv/bin/python -m pytest -q tests/test_verifier.py
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import common  # noqa: E402
import tasks  # noqa: E402
import conftest  # noqa: E402
from conftest import read_jsonl, score_many  # noqa: E402
import verifier as V  # noqa: E402

BIG_POW = "\\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate it: verify never returns (measured > 30 s)
DEEP_BRACES = "\\boxed{" + "{" * 10000 + "1" + "}" * 10000 + "}"  # parse never returns (measured > 30 s)

# --- (a) score: (completion, gold, task, expected status) -------------------------------------------
CASES = [
    # arithmetic: `#n` at the very end, exact integer match
    ("7+5=12\n#12", "12", "arithmetic", "correct"),
    ("7+5=12\n#12\n  ", "12", "arithmetic", "correct"),
    ("#012", "12", "arithmetic", "correct"),
    ("#1\n#12", "12", "arithmetic", "correct"),
    ("答案 ½ #12", "12", "arithmetic", "correct"),
    ("7+5=12\n#13", "12", "arithmetic", "wrong"),
    ("#12\n#1", "12", "arithmetic", "wrong"),
    ("7+5=12", "12", "arithmetic", "no_answer"),
    ("#12 I think", "12", "arithmetic", "no_answer"),
    ("#-12", "-12", "arithmetic", "no_answer"),
    ("", "12", "arithmetic", "no_answer"),
    # math: the last \boxed{}, equivalent forms through math_verify
    ("so \\boxed{\\frac{1}{2}}", "0.5", "math", "correct"),
    ("\\boxed{0.5}", "\\frac{1}{2}", "math", "correct"),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", "math", "correct"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", "math", "correct"),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", "math", "correct"),  # nested braces
    ("\\boxed{[1,2)}", "[1,2)", "math", "correct"),
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]", "math", "correct"),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", "math", "correct"),
    ("\\boxed{x=3}", "3", "math", "correct"),
    ("\\boxed{\\pi}", "\\pi", "math", "correct"),
    ("\\boxed{5.0}", "5", "math", "correct"),
    ("\\boxed{1,000}", "1000", "math", "correct"),
    ("\\boxed{\\$18}", "18", "math", "correct"),
    ("\\boxed{180^\\circ}", "180", "math", "correct"),
    ("\\boxed{\\text{(A)}}", "\\text{(A)}", "math", "correct"),
    ("\\boxed {3}", "3", "math", "correct"),
    ("first \\boxed{1}, finally \\boxed{2}", "2", "math", "correct"),  # the last one counts
    ("答案是 \\boxed{42}。", "42", "math", "correct"),  # unicode around the answer
    ("\\boxed{(1,2)}", "[1,2)", "math", "wrong"),
    ("\\boxed{\\{1,3\\}}", "\\{1,2\\}", "math", "wrong"),
    ("\\boxed{3.14}", "\\pi", "math", "wrong"),
    ("\\boxed{-3}", "3", "math", "wrong"),
    ("first \\boxed{1}, finally \\boxed{2}", "1", "math", "wrong"),
    ("the answer is x+1", "x+1", "math", "no_answer"),  # no \boxed and a non-numeric gold
    ("\\boxed{3", "\\frac{1}{2}", "math", "no_answer"),  # unbalanced: no boxed answer
    ("", "\\frac{1}{2}", "math", "no_answer"),
    ("\\boxed{}", "3", "math", "unparsable"),
    ("\\boxed{x^2+}", "x^2", "math", "unparsable"),
    ("\\boxed{)(}", "3", "math", "unparsable"),
    ("\\boxed{½}", "\\frac{1}{2}", "math", "unparsable"),
    # GSM8K-style plain-number gold: without \boxed, the last number in the text
    ("She pays 2*9 = 18 dollars.", "18", "math", "correct"),
    ("It costs 1,234 dollars in total", "1234", "math", "correct"),
    ("The temperature drops to -7", "-7", "math", "correct"),
    ("x = 2.5", "2.5", "math", "correct"),
    ("\\boxed{3", "3", "math", "correct"),  # unbalanced \boxed, but the last number is there
    ("18 eggs, 9 are eaten, so 9 left", "18", "math", "wrong"),
    ("no numbers at all", "18", "math", "no_answer"),
]


@pytest.mark.parametrize("completion,gold,task,expected", CASES)
def test_score_table(completion, gold, task, expected):
    reward, status = tasks.score(completion, gold, task)
    assert status == expected
    assert reward == (1.0 if expected == "correct" else 0.0)


def test_score_table_covers_every_status_but_timeout():
    assert len(CASES) >= 40
    assert {c[3] for c in CASES} == set(tasks.STATUSES) - {"timeout"}  # timeout: only the pool gives it


def test_score_gsm8k_and_math_gold_from_records():
    gsm8k = {"question": "q", "answer": "He has 1,000 + 234 = <<1000+234=1234>>1,234 apples.\n#### 1,234"}
    math = {"problem": "q", "solution": "So $x = \\boxed{\\frac{\\sqrt{3}}{2}}$."}
    assert tasks.gold_answer(gsm8k) == "1234"
    assert tasks.gold_answer(math) == "\\frac{\\sqrt{3}}{2}"
    assert tasks.score("so he has 1,234 apples.", tasks.gold_answer(gsm8k), "math") == (1.0, "correct")
    assert tasks.score("\\boxed{1234}", tasks.gold_answer(gsm8k), "math") == (1.0, "correct")
    assert tasks.score("so he has 1,235 apples.", tasks.gold_answer(gsm8k), "math") == (0.0, "wrong")
    assert tasks.score("\\boxed{\\sqrt{3}/2}", tasks.gold_answer(math), "math") == (1.0, "correct")
    assert tasks.score("\\boxed{\\sqrt{2}/2}", tasks.gold_answer(math), "math") == (0.0, "wrong")
    with pytest.raises(ValueError):
        tasks.score("#1", "1", "chess")


def test_reward_for_table_and_overlong_penalty():
    def vcfg(*kv):
        return common.load_config([f"verifier.{x}" for x in kv]).verifier
    v = vcfg("reward_correct=2.0", "reward_wrong=-0.5", "reward_no_answer=-1.0")
    assert [V.reward_for(s, v, 10, 64) for s in tasks.STATUSES] == [2.0, -0.5, -1.0, -1.0, -1.0]
    # DAPO: buffer 8 before max_tokens 64 -> no penalty up to 56 tokens, then linear down to -penalty at 64
    v = vcfg("overlong_buffer=8", "overlong_penalty=0.5")
    assert V.reward_for("correct", v, 56, 64) == 1.0
    assert V.reward_for("correct", v, 60, 64) == pytest.approx(1.0 - 0.25)
    assert V.reward_for("wrong", v, 64, 64) == pytest.approx(-0.5)
    assert V.reward_for("wrong", v, 80, 64) == pytest.approx(-0.5)  # capped at the max length
    assert V.reward_for("correct", vcfg(), 64, 64) == 1.0  # buffer 0: off


# --- (b) ScorePool: hostile input, dead workers ------------------------------------------------------
TIMEOUT_S = 3.0
MARGIN_S = 10.0  # a functional bound (the item must not hang), generous for a busy 2-core box


@pytest.fixture(scope="module")
def pool():
    with contextlib.closing(tasks.ScorePool(workers=2, timeout_s=TIMEOUT_S, max_chars=50_000)) as p:
        yield p


def wait_ready(pool):
    """Start-up (imports: seconds, more on a loaded box; also a worker replaced by the previous case) is not the
    bound tested: the per-item limit runs from when a ready worker takes the item."""
    deadline = time.monotonic() + 120
    while not all(w["ready"] for w in pool.workers) and time.monotonic() < deadline:
        pool.results += pool.collect(timeout=0.2)


NORMAL = ("7+5=12\n#12", "12", "arithmetic")


@pytest.mark.parametrize("name,item,allowed", [
    ("1 MB, answer at the end", ("x" * 1_000_000 + " \\boxed{42}", "42", "math"), {"correct"}),
    ("1 MB, answer at the start", ("\\boxed{42} " + "x" * 1_000_000, "42", "math"), {"no_answer"}),
    ("10k nested braces", (DEEP_BRACES, "1", "math"), {"timeout"}),
    ("9^9^9^9", (BIG_POW, "5", "math"), {"timeout"}),
    ("a million braces, unbalanced", ("\\boxed{" + "{" * 1_000_000, "5", "math"), {"no_answer"}),
])
def test_pool_hostile_input_is_bounded_and_pool_keeps_serving(pool, name, item, allowed):
    wait_ready(pool)
    tickets = [pool.submit(*item), pool.submit(*NORMAL)]
    results, deadline = {}, time.monotonic() + TIMEOUT_S + MARGIN_S
    while len(results) < 2 and time.monotonic() < deadline:  # a bound, so that a hang fails, not stalls
        results.update({t: (reward, status) for t, reward, status, _ in pool.collect(timeout=0.2)})
    assert len(results) == 2, f"{name}: no result within {TIMEOUT_S + MARGIN_S} s"
    (reward, status), normal = results[tickets[0]], results[tickets[1]]
    assert status in allowed, name
    assert reward == (1.0 if status == "correct" else 0.0)
    assert normal == (1.0, "correct")
    assert score_many(pool, [NORMAL, ("\\boxed{\\frac{1}{2}}", "0.5", "math")]) == [(1.0, "correct")] * 2


def test_pool_cuts_completions_to_max_chars():
    with contextlib.closing(tasks.ScorePool(workers=1, timeout_s=30, max_chars=100)) as p:
        tail = ("y" * 200 + "\\boxed{7}", "7", "math")
        head = ("\\boxed{7}" + "y" * 200, "7", "math")
        assert score_many(p, [tail, head]) == [(1.0, "correct"), (0.0, "no_answer")]


def test_pool_replaces_a_killed_worker():
    with contextlib.closing(tasks.ScorePool(workers=1, timeout_s=120, max_chars=50_000)) as p:
        assert score_many(p, [NORMAL]) == [(1.0, "correct")]  # the worker is up
        pid = p.workers[0]["proc"].pid
        ticket = p.submit(BIG_POW, "5", "math")  # hangs: only the kill can end it before 120 s
        assert p.workers[0]["job"] == ticket
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        results, deadline = [], time.monotonic() + 60
        while not results and time.monotonic() < deadline:
            results = p.collect(timeout=1.0)
        (t, reward, status, seconds), = results
        assert (t, reward, status) == (ticket, 0.0, "timeout") and seconds < 60  # death seen, not the limit
        assert p.restarts == 1 and p.workers[0]["proc"].pid != pid
        assert score_many(p, [NORMAL, ("\\boxed{0.5}", "\\frac{1}{2}", "math")]) == [(1.0, "correct")] * 2


# --- (b) verifier.py as a process between real sockets -----------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from scripts.make_tiny_model import make_tokenizer
    d = tmp_path_factory.mktemp("tok")
    tok = make_tokenizer()
    tok.save_pretrained(str(d))
    return str(d), tok


def start_verifier(run_dir, model_dir, *overrides, owner=None):
    """verifier.py between real sockets, with the run's owner process (the ledger it says hello to and
    forwards through; conftest.Owner), its own when none is given -> (proc, push, pull, ctx, owner)."""
    owner = owner or conftest.Owner(run_dir)
    ports = {"rollouts": free_port(), "samples": free_port()}
    cmd = [sys.executable, os.path.join(REPO, "verifier.py"), f"model.path={model_dir}",
           f"ports.rollouts={ports['rollouts']}", f"ports.samples={ports['samples']}", "run.log_every=0.2",
           "verifier.workers=1", *owner.overrides, *overrides]
    out = open(os.path.join(run_dir, "stdout.txt"), "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{ports['rollouts']}")  # ZMQ queues until the verifier binds
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"tcp://127.0.0.1:{ports['samples']}")
    return proc, push, pull, ctx, owner


def stop_verifier(proc, ctx, run_dir, owner=None):
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
        ctx.destroy(linger=0)
        if owner is not None:
            owner.close()
    assert rc == 0, stdout(run_dir)[-3000:]


def rollout(tok, group_id, sample_idx, group_size, task, answer, text, eos=True, ticket=1):
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    n = len(ids)
    header = {"group_id": group_id, "sample_idx": sample_idx, "group_size": group_size, "task": task,
              "answer": answer, "finish_reason": "stop", "t_start": 1.0, "t_end": 2.0, "ticket": ticket,
              "epoch": 1, "eval": False, "turns": 1, "env_reward": 0.0}
    arrays = {"prompt_ids": np.array([1, 2, 3], np.int32), "completion_ids": np.array(ids, np.int32),
              "logprobs": -np.arange(1, n + 1, dtype=np.float32) / 8,
              "versions": np.full(n, 7 + group_id, np.int32)}
    return header, arrays


def receive(pull, n, timeout_s=60):
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        if pull.poll(200):
            frames = pull.recv_multipart()
            if len(frames) > 1:  # (a tick is one frame)
                out.append(common.decode(frames, "sample"))  # also checks the sample schema
    return out


def stdout(run_dir):
    with open(os.path.join(run_dir, "stdout.txt")) as f:
        return f.read()


def wait_metrics(run_dir, done, timeout_s=60):
    path = os.path.join(run_dir, "metrics_verifier.jsonl")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = read_jsonl(path)
        if records and done(records[-1]):
            return records[-1]
        time.sleep(0.2)
    raise AssertionError(f"metrics never reached the expected state; last: {records[-1:] if records else None}")


def test_service_forwards_complete_groups_with_advantages(tmp_path, tokenizer_dir):
    model_dir, tok = tokenizer_dir
    run_dir = str(tmp_path)
    proc, push, pull, ctx, owner = start_verifier(
        run_dir, model_dir, "verifier.reward_wrong=-0.5", "verifier.overlong_buffer=4",
        "verifier.overlong_penalty=1.0", "actor.max_tokens=24", "verifier.stale_group_s=1")
    try:
        owner.open_epoch()
        # the ledger's tickets for groups 1..5, 9, and a second copy of group 1 ("1b")
        ticket = {g: k for g, (k, _) in zip([1, 2, 3, 4, 5, 9, "1b"], owner.tickets(7))}
        sent = {}

        def send(group_id, idx, size, task, answer, text, eos=True, copy=None):
            header, arrays = rollout(tok, group_id, idx, size, task, answer, text, eos,
                                     ticket[copy or group_id])
            sent[(group_id, idx)] = arrays
            conftest.send(push, header, arrays)

        # group 1: rewards 1, -0.5 (wrong, from the config), 0 (no answer), 1 -> mean 0.375
        send(1, 0, 4, "arithmetic", "12", "7+5=12\n#12")  # EOS must be skipped or this is no_answer
        send(1, 0, 4, "arithmetic", "12", "7+5=12\n#12")  # duplicate
        send(1, 2, 4, "arithmetic", "12", "7+5=12")
        send(1, 1, 4, "arithmetic", "12", "7+5=13\n#13")
        send(1, 3, 4, "arithmetic", "12", "#12", eos=False)
        # group 2: two correct math answers in different forms -> zero advantages, still forwarded
        send(2, 1, 2, "math", "\\frac{1}{2}", "\\boxed{\\dfrac12}")
        send(2, 0, 2, "math", "\\frac{1}{2}", "so \\boxed{0.5}")
        # group 3: one of three samples, never complete
        send(3, 0, 3, "arithmetic", "5", "#5")
        # malformed: bad JSON, a frame of the wrong length, a missing field
        frames = common.encode(*rollout(tok, 9, 0, 2, "arithmetic", "5", "#5", ticket=ticket[9]))
        push.send_multipart([b"{not json"] + frames[1:])
        push.send_multipart(frames[:2] + [frames[2][:-4]] + frames[3:])
        header, arrays = rollout(tok, 9, 0, 2, "arithmetic", "5", "#5", ticket=ticket[9])
        del header["answer"]
        push.send_multipart(common.encode(header, arrays))
        # group 4 after the malformed ones: the overlong penalty starts at 24 - 4 = 20 tokens
        send(4, 0, 2, "arithmetic", "5", "#5")  # 3 tokens with EOS: reward 1
        send(4, 1, 2, "arithmetic", "5", "x" * 19 + "\n#5")  # 23 tokens: 1 - (23 - 20) / 4 = 0.25

        samples = receive(pull, 8)
        assert not receive(pull, 1, timeout_s=1), "an incomplete group or a duplicate was forwarded"
        got = {(h["group_id"], h["sample_idx"]): (h, a) for h, a in samples}
        assert len(samples) == 8 and set(got) == {(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (4, 0), (4, 1)}
        expected = {(1, 0): ("correct", 1.0, 0.625), (1, 1): ("wrong", -0.5, -0.875),
                    (1, 2): ("no_answer", 0.0, -0.375), (1, 3): ("correct", 1.0, 0.625),
                    (2, 0): ("correct", 1.0, 0.0), (2, 1): ("correct", 1.0, 0.0),
                    (4, 0): ("correct", 1.0, 0.375), (4, 1): ("correct", 0.25, -0.375)}
        for key, (status, reward, advantage) in expected.items():
            h, a = got[key]
            assert (h["status"], h["reward"]) == (status, pytest.approx(reward)), key
            assert h["advantage"] == pytest.approx(advantage), key
            assert h["answer"] and h["t_end"] == 2.0 and h["finish_reason"] == "stop"
            for name, array in sent[key].items():  # arrays travel unchanged
                np.testing.assert_array_equal(a[name], array)

        m = wait_metrics(run_dir, lambda r: r.get("verifier/status_correct") == 7)  # group 3's one too
        assert m["step"] == 3 and m["verifier/groups_forwarded"] == 3
        assert (m["verifier/malformed"], m["verifier/duplicates"], m["verifier/zero_adv_groups"]) == (3, 1, 1)
        assert (m["verifier/status_wrong"], m["verifier/status_no_answer"], m["verifier/status_timeout"]) \
            == (1, 1, 0)
        assert m["verifier/queue_depth"] == 1  # group 3's one sample
        # Dropped, and the ledger told why: group 9 only (its malformed sample can never complete it, 2
        # samples). Group 3, still incomplete after stale_group_s, is reported, not dropped: its last
        # samples may wait behind a backlog, and it is trained on.
        m = wait_metrics(run_dir, lambda r: "group 3 still incomplete" in stdout(run_dir)
                         and r["verifier/slow_groups"])
        assert (m["verifier/dropped_groups"], m["verifier/dropped_samples"], m["verifier/queue_depth"]) == (1, 2, 1)
        dropped = [e for e in owner.journal() if e["event"] == "dropped"]
        assert [(e["ticket"], e["why"]) for e in dropped] == [(ticket[9], "malformed")]
        send(3, 2, 3, "arithmetic", "5", "#4")
        send(3, 1, 3, "arithmetic", "5", "#5")
        late = receive(pull, 3)
        assert sorted(h["sample_idx"] for h, _ in late) == [0, 1, 2]
        assert all(h["group_id"] == 3 for h, _ in late)
        # still serving after all that: a late duplicate of a forwarded group is dropped, a new group passes
        send(1, 3, 4, "arithmetic", "12", "#12")
        send(5, 0, 1, "arithmetic", "5", "#4")
        (h, _), = receive(pull, 1)
        assert (h["group_id"], h["status"], h["reward"], h["advantage"]) == (5, "wrong", -0.5, 0.0)
        wait_metrics(run_dir, lambda r: r["verifier/duplicates"] == 2 and r["step"] == 5)
        # a second copy of group 1 (the ledger granted its id again under another ticket): a new group,
        # forwarded, not a duplicate of the one finished above; every group's order is its place in the
        # verifier's forwards, the same for all of its samples
        send(1, 0, 2, "arithmetic", "12", "#12", copy="1b")
        send(1, 1, 2, "arithmetic", "12", "#13", copy="1b")
        again = receive(pull, 2)
        assert [(h["group_id"], h["ticket"], h["verifier"], h["order"]) for h, _ in again] == \
            [(1, ticket["1b"], 1, 5)] * 2
        # nothing left to send: every 0.5 s a tick says where the verifier's forwards stand
        tick = None
        while tick is None:
            frames = pull.recv_multipart()
            tick = common.decode(frames, "tick")[0] if len(frames) == 1 else None
        assert tick == {"verifier": 1, "order": 6}
    finally:
        stop_verifier(proc, ctx, run_dir, owner)
    assert stdout(run_dir).count("group 3 still incomplete") == 1  # logged once, not at every tick
    assert json.load(open(os.path.join(run_dir, "run_info_verifier.json")))["role"] == "verifier"


def test_service_drops_zero_advantage_groups_when_asked(tmp_path, tokenizer_dir):
    model_dir, tok = tokenizer_dir
    run_dir = str(tmp_path)
    proc, push, pull, ctx, owner = start_verifier(run_dir, model_dir, "verifier.drop_zero_adv_groups=true")
    try:
        owner.open_epoch()
        (one, _), (two, _) = owner.tickets(2)
        for idx in range(2):  # all correct: dropped
            conftest.send(push, *rollout(tok, 1, idx, 2, "arithmetic", "5", "#5", ticket=one))
        conftest.send(push, *rollout(tok, 2, 0, 2, "arithmetic", "5", "#5", ticket=two))
        conftest.send(push, *rollout(tok, 2, 1, 2, "arithmetic", "5", "#6", ticket=two))
        samples = receive(pull, 2)
        assert not any(len(pull.recv_multipart()) > 1 for _ in range(2))  # ticks only
        assert sorted((h["group_id"], h["advantage"]) for h, _ in samples) == [(2, -0.5), (2, 0.5)]
        m = wait_metrics(run_dir, lambda r: r["verifier/groups_forwarded"] == 1)
        assert (m["verifier/zero_adv_groups"], m["verifier/dropped_groups"]) == (1, 1)
        # the ledger knows: the budget is free again, else the run stalls
        assert [(e["ticket"], e["why"]) for e in owner.journal() if e["event"] == "dropped"] == \
            [(one, "zero_adv")]
    finally:
        stop_verifier(proc, ctx, run_dir, owner)


def test_service_grades_evaluations_and_drops_non_finite_rollouts(tmp_path, tokenizer_dir):
    """An evaluation pass (eval: true, one "group" over the test split) goes to eval.jsonl with the span of
    versions that produced its tokens, never to the trainer; a rollout with a NaN logprob is malformed, and
    its group (of actor process 1) is dropped and given back to that process's budget."""
    model_dir, tok = tokenizer_dir
    run_dir = str(tmp_path)
    proc, push, pull, ctx, owner = start_verifier(run_dir, model_dir, "verifier.stale_group_s=0.5")
    try:
        owner.open_epoch()
        (ticket, _), = owner.tickets(1)
        for i, text in enumerate(["#5", "#4", "#5", "nothing"]):  # 2 of 4 right
            h, a = rollout(tok, 30, i, 4, "arithmetic", "5", text, ticket=0)
            a["versions"] = np.full(len(a["versions"]), 30 + i // 2, np.int32)  # the pass spans versions 30-31
            if i == 3:  # a slow pass: its last attempt comes after stale_group_s; it is recorded all the same
                wait_metrics(run_dir, lambda r: r["verifier/slow_groups"] == 1)
            conftest.send(push, {**h, "eval": True}, a)
        # training group 30 (another id space), one of its samples with a NaN logprob
        h, a = rollout(tok, 30, 0, 2, "arithmetic", "5", "#5", ticket=ticket)
        conftest.send(push, h, a)
        a = {**a, "logprobs": a["logprobs"].copy()}
        a["logprobs"][0] = np.nan
        conftest.send(push, {**h, "sample_idx": 1}, a)
        m = wait_metrics(run_dir, lambda r: r["verifier/evaluations"] == 1 and r["verifier/malformed"] == 1)
        assert (m["verifier/dropped_groups"], m["verifier/groups_forwarded"]) == (1, 0)
        assert m["verifier/test_reward"] == 0.5 and m["verifier/test_version"] == 30
        assert all(len(pull.recv_multipart()) == 1 for _ in range(3))  # ticks only: nothing to train
        assert [(e["ticket"], e["why"]) for e in owner.journal() if e["event"] == "dropped"] == \
            [(ticket, "malformed")]
    finally:
        stop_verifier(proc, ctx, run_dir, owner)
    (record,) = read_jsonl(os.path.join(run_dir, "eval.jsonl"))
    assert (record["version"], record["versions"], record["test_reward"], record["n"]) == (30, [30, 31], 0.5, 4)


def test_service_closes_groups_the_ledger_gave_back_before_their_samples_came(tmp_path, tokenizer_dir):
    """An actor lost before any sample of its group reached the verifier: the ledger gives the ticket
    back and tells the verifier (its `void`), which closes the copy by (group id, ticket). Samples of it
    that come later are late duplicates: not scored, not forwarded."""
    model_dir, tok = tokenizer_dir
    run_dir = str(tmp_path)
    proc, push, pull, ctx, owner = start_verifier(run_dir, model_dir)
    try:
        owner.open_epoch()
        (gone, gone_id), (first, first_id) = owner.tickets(2)

        def group(ticket, group_id):
            for idx, text in enumerate(["#5", "#6"]):
                conftest.send(push, *rollout(tok, group_id, idx, 2, "arithmetic", "5", text, ticket=ticket))
            return {(h["group_id"], h["ticket"]) for h, _ in receive(pull, 2)}

        assert group(first, first_id) == {(first_id, first)}  # the verifier is up (it said hello)
        owner.ledger.request("lost", inc=owner.inc, why="the test")
        owner.inc = owner.ledger.request("actor_hello", pid=os.getpid(), host="test")["inc"]
        (second, second_id), (third, third_id) = owner.tickets(2)
        # forwarded after the give-back: the ledger's reply that accepted it carried the void (or one before)
        assert group(second, second_id) == {(second_id, second)}
        conftest.send(push, *rollout(tok, gone_id, 0, 2, "arithmetic", "5", "#5", ticket=gone))
        conftest.send(push, *rollout(tok, gone_id, 1, 2, "arithmetic", "5", "#6", ticket=gone))
        assert group(third, third_id) == {(third_id, third)}  # (after the late ones: one socket)
        m = wait_metrics(run_dir, lambda r: r["verifier/groups_forwarded"] == 3)
        assert (m["verifier/duplicates"], m["verifier/refused_groups"]) == (2, 0)
        assert m["verifier/status_correct"] + m["verifier/status_wrong"] == 6  # the void copy never scored
    finally:
        stop_verifier(proc, ctx, run_dir, owner)
