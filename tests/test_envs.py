"""Tier (a): the environment interface (envs.py) and the trainer's side of episodes, without vLLM: the
calculator tool, a step's timeout, error and latency, the calc task, and that an environment's tokens
(version -1) carry no loss and no lag. The engine's side (one exact token stream, weights updated
mid-episode) is in tests/test_actor.py.

Run: bash run.sh test tests/test_envs.py      (< 20 s)
"""
import asyncio
import json
import random
import socket
import time

import numpy as np
import pytest
import torch

import common
import envs
import loss
import tasks
import trainer
from conftest import REPO
from scripts.sandbox import Limits


def step(env, turn, **kw):
    return asyncio.run(envs.bounded_step(env, turn, kw.pop("timeout_s", 5.0), **kw))


@pytest.mark.parametrize("expression, value", [
    ("347*58", "20126"), ("1+2*3", "7"), ("(1+2)*3", "9"), ("7-10", "-3"), (" 12 * 3 ", "36"),
    ("2**100", "?"), ("1/2", "?"), ("3*(4", "?"), ("", "?"), ("__import__('os').system('ls')", "?"),
    ("9" * 41, "?"), ("x", "?"), ("1e3", "?"), ("True+1", "?")])
def test_the_calculator_evaluates_integer_arithmetic_and_nothing_else(expression, value):
    assert envs.evaluate(expression) == value


def test_reset_gives_the_first_observation_the_actor_templates_and_a_group_shares_it(monkeypatch):
    """An environment's reset(problem) is the episode's first observation: the actor's prompt is it, as
    tokenized for the model, for every attempt of the group, each environment reset to the problem. One
    that gives the attempts of a group different first observations is refused, naming itself."""
    import types
    import actor
    from scripts.make_tiny_model import make_tokenizer

    class Guess(envs.Env):
        def reset(self, problem):
            super().reset(problem)
            return f"Guess {problem.answer[:1]}? {problem.prompt}"

    class Moody(envs.Env):
        def reset(self, problem):
            return random.choice("ab")

    tok, problem = make_tokenizer(), tasks.arithmetic_problem(12, 34)
    me = types.SimpleNamespace(cfg=common.load_config([]), tokenizer=tok)
    monkeypatch.setitem(envs.ENVS, problem.task, Guess)
    prompt, environments = actor.Actor.episodes(me, problem, 3)
    assert tok.decode(prompt["prompt_token_ids"]) == "Guess 4? 12+34=\n"
    assert [type(e) for e in environments] == [Guess] * 3
    assert all(e.problem is problem for e in environments) and len(set(map(id, environments))) == 3
    monkeypatch.setitem(envs.ENVS, problem.task, Moody)
    random.seed(1)
    with pytest.raises(ValueError, match="Moody.reset gave the attempts of one group 2 first observations"):
        actor.Actor.episodes(me, problem, 8)


def test_every_registered_environment_is_a_choice_of_actor_env():
    """actor.env's choices (common.CHOICES, checked before any process starts) are envs.ENVS's names: one
    registered but not a choice would be refused, one a choice but not registered would fail in the actor."""
    assert common.CHOICES[("actor", "env")] == ("", *envs.ENVS)


def test_calculator_steps():
    calc = envs.make(tasks.calc_problem(347, 58))
    assert isinstance(calc, envs.Calculator) and calc.stop == ("=",)
    assert step(calc, "347*58=") == envs.Step("20126\n", 0.0, False)
    assert step(calc, "20126\n100+1=") == envs.Step("101\n", 0.0, False)  # the turn's last line
    assert step(calc, "#20126") == envs.Step("", 0.0, True)  # a turn that is not a call: the answer
    single = envs.make(tasks.arithmetic_problem(1, 2))
    assert type(single) is envs.SingleTurn and single.stop == () and step(single, "#3").done


def test_a_step_that_hangs_or_raises_is_an_error_observation():
    class Hung(envs.Env):
        async def step(self, turn):
            await asyncio.sleep(3600)

    class Broken(envs.Env):
        async def step(self, turn):
            raise KeyError("no such tool")
    t0 = time.time()
    assert step(Hung(), "x", timeout_s=0.2) == envs.Step("[error: the environment gave no answer in 0.2 s]\n")
    assert time.time() - t0 < 2
    assert step(Broken(), "x") == envs.Step("[error: KeyError: 'no such tool']\n")


def test_latency_is_drawn_log_uniform_within_its_bounds():
    class Instant(envs.Env):
        async def step(self, turn):
            return envs.Step("ok")
    rng = random.Random(0)
    waits = []
    for _ in range(6):
        t0 = time.monotonic()
        step(Instant(), "x", latency=(0.01, 0.3), rng=rng)
        waits.append(time.monotonic() - t0)
    assert all(0.01 <= w < 0.3 + 0.2 for w in waits) and max(waits) > 2 * min(waits), waits


def test_calc_task_problems_and_grading():
    cfg = common.load_config(["data.task=calc", "data.test_size=20", "data.max_digits=3"])
    stream, test = tasks.load_tasks(cfg)
    p = stream.get(0)
    a, b = map(int, p.prompt.strip().split("*"))
    assert p.task == "calc" and p.answer == str(a * b) and p.prompt not in {q.prompt for q in test}
    assert tasks.score(p.target, p.answer, "calc") == (1.0, "correct")
    assert tasks.score("#1", p.answer, "calc")[1] == "wrong"


def test_the_environments_tokens_carry_no_loss_and_no_lag():
    """An episode [model, env, env, model]: the trainer's mask and lags cover the model's two tokens; the
    loss does not move whatever the environment's positions hold."""
    sample = {"prompt_ids": np.array([1, 2], np.int32), "completion_ids": np.array([5, 6, 7, 8], np.int32),
              "logprobs": np.array([-1.0, 0.0, 0.0, -2.0], np.float32),
              "versions": np.array([3, -1, -1, 4], np.int32), "advantage": 1.0}
    x = trainer.collate([sample], 5, torch.device("cpu"))
    assert x["mask"][0].tolist() == [False, True, False, False, True]
    assert x["lags"][0][x["mask"][0]].tolist() == [2, 1]
    logprobs = torch.tensor([[0.0, -0.5, -3.0, -4.0, -1.5]], requires_grad=True)
    first, _ = loss.policy_loss(logprobs, x["old_logprobs"], x["advantages"], x["mask"], 1)
    changed = x["old_logprobs"].clone()
    changed[0, 2:4] = -30.0  # the environment's positions
    second, _ = loss.policy_loss(logprobs, changed, x["advantages"], x["mask"], 1)
    (g,) = torch.autograd.grad(first, logprobs)
    assert first.item() == second.item() and g[0, 2:4].abs().sum() == 0 and g[0, 1] != 0


# --- the Python tool (envs.PythonTool: a chat model's tool calls, run in scripts/sandbox.py) -------------

def call(code, name="python", as_string=False):
    """A turn that ends in a tool call, as Qwen2.5's template asks for one."""
    args = json.dumps({"code": code}) if as_string else {"code": code}
    return "I will compute it.\n<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def tool_output(s: envs.Step) -> str:
    """The text of the template's tool message, which every answer of the tool is."""
    head, tail = "<|im_end|>\n<|im_start|>user\n<tool_response>\n", "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert s.observation.startswith(head) and s.observation.endswith(tail) and not s.done, s
    return s.observation[len(head):-len(tail)]


def python_tool():
    tool = envs.make(tasks.arithmetic_problem(1, 2), "python")
    assert isinstance(tool, envs.PythonTool) and tool.stop == ("</tool_call>",)
    tool.limits = Limits(wall_s=4.0, cpu_s=2)
    return tool


def test_the_python_tool_answers_a_call_and_explains_a_bad_one():
    tool = python_tool()
    assert tool_output(step(tool, call("print(6 * 7)"), timeout_s=30)) == "42\n"
    assert tool_output(step(tool, call("print(1 + 1)", as_string=True), timeout_s=30)) == "2\n"
    for bad in ('<tool_call>{"name": "python"}</tool_call>', "<tool_call>print(1)</tool_call>",
                call("print(1)", name="bash"), '<tool_call>{"name": "python", "arguments": {"code": 5}}</tool_call>'):
        assert tool_output(step(tool, bad, timeout_s=30)).startswith("error: a call is {"), bad
    assert step(tool, "So the answer is \\boxed{42}.") == envs.Step("", 0.0, True)  # not a call: the answer


@pytest.mark.parametrize("code, said", [
    ("while True:\n    pass", "[error: killed by signal 24 (over 2 s of CPU time)]"),
    ("import time\ntime.sleep(60)", "[error: no end after 4 s of wall time: stopped]"),
    ("x = bytearray(10 * 2**30)", "MemoryError"),
    ("import os\nwhile True:\n    os.fork()", "BlockingIOError"),
    ("print(open('/etc/passwd').read())", "FileNotFoundError"),
    (f"print(open({str(REPO / 'actor.py')!r}).read())", "FileNotFoundError"),
    ("import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=2)", "ConnectionRefusedError"),
    ("while True:\n    print('x' * 1000)", "[error: output over 16384 bytes: cut, and the code stopped]")])
def test_code_that_tries_to_escape_gets_an_error_result_and_the_tool_goes_on(code, said):
    """The escapes of tests/test_sandbox.py, through the tool: each is an answer the model reads (an error
    named), never an exception in the actor; the next call runs."""
    tool = python_tool()
    with socket.socket() as listener:  # a port on the host that does listen: the sandbox cannot reach it
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        out = tool_output(step(tool, call(code.replace("PORT", str(listener.getsockname()[1]))), timeout_s=30))
    assert said in out and "[error:" in out, out
    assert tool_output(step(tool, call("print('next')"), timeout_s=30)) == "next\n"


def test_a_python_tool_that_outlasts_its_step_is_stopped():
    """actor.step_timeout_s shorter than the sandbox's wall time: the step's error, and no process left."""
    from test_sandbox import none_left
    tool = python_tool()
    tool.limits = Limits(wall_s=60.0, cpu_s=60)
    assert step(tool, call("import time\ntime.sleep(60)"), timeout_s=1.0) == envs.Step(
        "[error: the environment gave no answer in 1 s]\n")
    none_left()


def test_the_calc_warm_start_trains_the_model_s_tokens_and_not_the_tools():
    """scripts/make_tiny_model.py --task calc: a worked solution that calls the calculator has no loss on the
    calculator's answer (the environment's tokens, as in an episode); tool_share of them call it, and none is
    a test problem."""
    from scripts import make_tiny_model as mtm
    tok = mtm.make_tokenizer()
    ids, labels, _ = mtm._batch(tok, [tasks.calc_problem(12, 34), tasks.arithmetic_problem(1, 2)])
    prompt = len(tok("12*34\n")["input_ids"])
    trained = [tok.decode([i]) if y != -100 else "_" for i, y in zip(ids[0].tolist(), labels[0].tolist())]
    assert trained[prompt:] == [*"12*34=", *"____", *"#408", tok.eos_token], trained
    assert (labels[1] != -100).sum() == len(tok(tasks.arithmetic_problem(1, 2).target)["input_ids"]) + 1
    test = {p.prompt for p in tasks._fixed_split(lambda rng: tasks._draw_calc(rng, 1, 3), 300)}
    batch = [p for _, b in zip(range(20), mtm.train_batches("calc", 0, 64, test)) for p in b]
    calls = np.mean(["=" in p.target for p in batch])
    assert abs(calls - mtm.BUILDS["calc"]["tool_share"]) < 0.05 and not {p.prompt for p in batch} & test
    assert all(p.target.endswith(f"#{p.answer}") for p in batch)


def test_the_calc_overlay_matches_its_warm_start():
    """configs/calc.yaml: the model run.sh builds for it (scripts/make_tiny_model.py --task calc), the same
    operands as its warm start, room for the longest episode (a call, the tool's value, the answer, EOS)."""
    import re
    from scripts import make_tiny_model as mtm
    cfg = common.load_config(["configs/calc.yaml"])
    assert cfg.data.task == "calc" and cfg.model.path == mtm.BUILDS["calc"]["out"]
    assert (cfg.data.min_digits, cfg.data.max_digits) == mtm.BUILDS["calc"]["digits"]
    assert len(tasks.calc_problem(999, 999).target) + 1 <= cfg.actor.max_tokens and cfg.actor.max_turns >= 2
    assert re.search(r"assets/tiny-calc\)\s+BUILD_TASK=calc;", (REPO / "run.sh").read_text())


def test_every_run_of_the_tool_latency_bench_is_a_valid_config():
    """bench/tool_latency.py: PipelineRL and conventional RL on configs/calc.yaml, with and without the
    drawn tool latency; each run's overrides load."""
    import sys
    sys.path.insert(0, str(REPO / "bench"))
    import tool_latency
    a = tool_latency.argparse.Namespace(steps=200, latency=[0.01, 2.0], seed=0)
    runs = {name: common.load_config([str(REPO / o) if o.endswith(".yaml") else o for o in over])
            for name, over in tool_latency.settings(a)}
    assert {(c.actor.schedule, c.actor.step_latency_s, c.data.task) for c in runs.values()} == {
        (s, lat, "calc") for s in ("pipeline", "conventional") for lat in ((0.0, 0.0), (0.01, 2.0))}
