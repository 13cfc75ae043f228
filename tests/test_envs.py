"""Tier (a): the environment interface (envs.py) and the trainer's side of episodes, without vLLM: the
calculator tool, a step's timeout, error and latency, the calc task, and that an environment's tokens
(version -1) carry no loss and no lag. The engine's side (one exact token stream, weights updated
mid-episode) is in tests/test_actor.py.

Run: bash run.sh test tests/test_envs.py      (< 20 s)
"""
import asyncio
import random
import time

import numpy as np
import pytest
import torch

import common
import envs
import loss
import tasks
import trainer


def step(env, turn, **kw):
    return asyncio.run(envs.bounded_step(env, turn, kw.pop("timeout_s", 5.0), **kw))


@pytest.mark.parametrize("expression, value", [
    ("347*58", "20126"), ("1+2*3", "7"), ("(1+2)*3", "9"), ("7-10", "-3"), (" 12 * 3 ", "36"),
    ("2**100", "?"), ("1/2", "?"), ("3*(4", "?"), ("", "?"), ("__import__('os').system('ls')", "?"),
    ("9" * 41, "?"), ("x", "?"), ("1e3", "?"), ("True+1", "?")])
def test_the_calculator_evaluates_integer_arithmetic_and_nothing_else(expression, value):
    assert envs.evaluate(expression) == value


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
    assert step(Hung(None), "x", timeout_s=0.2) == envs.Step("[error: the environment gave no answer in 0.2 s]\n")
    assert time.time() - t0 < 2
    assert step(Broken(None), "x") == envs.Step("[error: KeyError: 'no such tool']\n")


def test_latency_is_drawn_log_uniform_within_its_bounds():
    class Instant(envs.Env):
        async def step(self, turn):
            return envs.Step("ok")
    rng = random.Random(0)
    waits = []
    for _ in range(6):
        t0 = time.monotonic()
        step(Instant(None), "x", latency=(0.01, 0.3), rng=rng)
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
