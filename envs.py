"""Environments: what answers the model between its turns. Every sample is an episode (actor.py,
`run_episode`): the model generates until its turn ends (a stop token of the environment's protocol,
its end-of-sequence token, or the token budget), the environment answers, its answer's tokens are
appended to the episode as token ids (tokenized alone, never the history again: what the engine saw
is what is trained), and the model goes on, until the environment says done or actor.max_turns or
actor.max_tokens runs out. A single-turn task is an episode of one turn (`SingleTurn`).

The interface, for your own environment (one instance per episode):

    class MyEnv(Env):
        stop = ("</tool_call>",)   # tokens that end a turn, as the vocabulary spells them
        def reset(self, problem) -> str:      # the first observation (default: the question)
            return f"Guess a number in 1..100. {problem.prompt}"
        async def step(self, turn) -> Step:   # the model's turn as text
            return Step(observation="...", reward=0.0, done=False)

`reset` gives the first observation, the user's first message: the actor templates it
(tasks.format_prompt: a chat template also lists the environment's `tools`) into the episode's
prompt. A group's attempts share their prompt, so `reset` must give each of them the same one; it
runs on the actor's loop, once per attempt, and must not block. actor.env names one environment for
every problem; by default each problem gets its task's (ENVS, by task name; SingleTurn for the
rest).

A turn that ends at a stop token goes to `step`; one that ends otherwise (the model's end of
sequence, the budget) ends the episode. `step` may await (a tool, a sandbox, a remote service): the
actor's loop runs on meanwhile. Each call is bounded by actor.step_timeout_s: a step that raises or
hangs gives the episode an error observation, never a hang. A reward is optional, per step: their
sum travels with the sample (`env_reward`); the verifier's reward is its grade of the final answer
(tasks.score). actor.step_latency_s = [lo, hi] delays each step by a time drawn log-uniform in
[lo, hi] (a tool's latency, for experiments; 0: none).
"""
import ast
import asyncio
import json
import math
import random
from dataclasses import dataclass

from scripts import sandbox

@dataclass(frozen=True)
class Step:
    observation: str       # appended to the episode as its own tokens ("" for none)
    reward: float = 0.0
    done: bool = False


class Env:
    """One episode's environment."""
    stop: tuple = ()
    tools: tuple = ()  # JSON schemas of its tools, for a chat template (data.prompt_format=chat)
    problem = None

    def reset(self, problem) -> str:
        """A new episode of `problem` -> the first observation (default: the question)."""
        self.problem = problem
        return problem.prompt

    async def step(self, turn: str) -> Step:
        raise NotImplementedError


class SingleTurn(Env):
    """Every single-turn task: no stop token, so its one turn ends the episode; the verifier grades
    the answer."""

    async def step(self, turn: str) -> Step:
        return Step("", 0.0, True)


class Calculator(Env):
    """data.task=calc: the model may end a turn with `=` after an arithmetic expression (its last
    line); the tool answers with the value and a newline. A turn that ends otherwise is the
    answer."""
    stop = ("=",)

    async def step(self, turn: str) -> Step:
        if not turn.endswith("="):
            return Step("", 0.0, True)
        return Step(f"{evaluate(turn[:-1].rsplit(chr(10), 1)[-1])}\n")


def evaluate(expression: str) -> str:
    """An integer expression of + - * and parentheses, at most 40 characters -> its value, else
    "?" (parsed by Python's ast, evaluated node by node: nothing else is ever run)."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}

    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError

    try:
        if len(expression) > 40:
            raise ValueError
        result = value(ast.parse(expression.strip(), mode="eval").body)
        return str(result) if abs(result) < 10**18 else "?"
    except (ValueError, SyntaxError):
        return "?"


class PythonTool(Env):
    """actor.env=python, for chat models with Qwen2.5's tool-call format (Hermes'): a turn that ends
    with <tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call> has its code run in
    the sandbox (scripts/sandbox.py: no network, a scratch directory, limits) and gets its output
    back as the template's tool message; a call that is not that JSON gets an error message. A turn
    that ends otherwise is the answer."""
    stop = ("</tool_call>",)
    tools = ({"type": "function", "function": {
        "name": "python", "description": "Run a Python 3 script; returns what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                       "required": ["code"]}}},)
    answer = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n")
    limits = sandbox.Limits()

    async def step(self, turn: str) -> Step:
        if not turn.endswith(self.stop[0]):
            return Step("", 0.0, True)
        try:
            call = json.loads(turn[:-len(self.stop[0])].rsplit("<tool_call>", 1)[-1])
            args = call["arguments"]
            code = (json.loads(args) if isinstance(args, str) else args)["code"]
            if call["name"] != "python" or not isinstance(code, str):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return Step(self.answer.format('error: a call is {"name": "python", "arguments": '
                                           '{"code": "..."}}'))
        r = await sandbox.run_python(code, self.limits)
        return Step(self.answer.format(r.output + (f"[error: {r.error}]" if r.error else "")))


ENVS = {"calc": Calculator, "python": PythonTool}


def kind(problem, name: str = "") -> type:
    """The Env class of `problem`: ENVS[name] (actor.env), or its task's (SingleTurn unless one is
    registered in ENVS under the task's name)."""
    return ENVS[name] if name else ENVS.get(problem.task, SingleTurn)


def make(problem, name: str = "") -> Env:
    """A new environment of `problem`'s kind, reset to it."""
    env = kind(problem, name)()
    env.reset(problem)
    return env


async def bounded_step(env: Env, turn: str, timeout_s: float, latency: tuple = (0.0, 0.0),
                       rng: random.Random = random) -> Step:
    """env.step(turn) after the drawn latency, within timeout_s: an exception or a timeout is an
    error observation and the episode goes on (the turn budget ends it)."""
    lo, hi = latency
    if hi > 0:
        await asyncio.sleep(math.exp(rng.uniform(math.log(max(lo, 1e-3)), math.log(hi))))
    try:
        return await asyncio.wait_for(env.step(turn), timeout_s)
    except asyncio.TimeoutError:
        return Step(f"[error: the environment gave no answer in {timeout_s:g} s]\n")
    except Exception as e:  # noqa: BLE001 - the environment's own bug: said to the model
        return Step(f"[error: {type(e).__name__}: {e}]\n"[:500])
