"""Datasets: the built-in arithmetic and longtail tasks, GSM8K/MATH-style sets, prompt formatting,
grading (`score`).

Training problems: an endless seeded stream that never overlaps the test split. Arithmetic: `a+b`
with 1..4-digit operands, the target adding column by column, right to left, with the carry, then
`#answer`:

    47+385=   ->   7+5=12 / 4+8+1=13 / 3+1=4 / #432

so its length grows with the problem (8 characters for 3+4, ~40 for 4-digit operands with carries):
a short tail only.

Longtail (`data.task=longtail`, configs/longtail.yaml): named one-digit terms summed with a running
total, one line per term, then `#answer`:

    k=3 l=5 m=8   ->   k=3: 0+3=3 / l=5: 3+5=8 / m=8: 8+8=16 / #16

PipelineRL's gain comes from the long tail of generation lengths (paper Sec. 3, App. A). Reasoning
traces are right-skewed, most short and a few many times longer, so the number of additions is
drawn lognormal, round(2 e^(1.25 z)) clipped to 1..25; each line is ~13 tokens, so the targets are
p50 40 tokens, p90 ~130, longest 369 (tests/test_longtail.py). Why this form: the tiny model learned
neither unnamed terms (`17+5+83=` -> `17+5=22 / 22+83=105`) nor randomly named ones, and does learn
this one (docs/RESULTS.md, "Figures behind the code's comments"). Here the next name is the
successor letter of the last, each line restates `name=value` as the prompt has it (the value is
copied from after `l=`: the simplest lookup), and a line adds one digit to the running total. The
first name is drawn, so that even the one-addition problems number 2,025 (the fixed test split holds
~6% of them). A long problem is right only if every line is, and its total (up to 234) cannot be
guessed: short problems are mostly right, long ones rarely. The grader is exact, as arithmetic's.
"""
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent

ANSWER_MARK = "#"
_ARITH_ANSWER = re.compile(r"#(\d+)\s*$")
_TEST_SEED = 12345  # the procedural test splits are fixed, whatever run.seed is
# what grading says of an answer
STATUSES = ("correct", "wrong", "no_answer", "unparsable", "timeout")
TASKS = ("arithmetic", "longtail", "calc", "math")
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")  # 1,234.5 or 1234.5

@dataclass(frozen=True)
class Problem:
    prompt: str  # the raw question text (format_prompt makes the model's input)
    answer: str  # the gold final answer
    task: str  # the grader: one of TASKS
    # a worked solution where one exists (arithmetic, longtail: it warm-starts the tiny model)
    target: str = ""

# --- arithmetic ----------------------------------------------------------------------------------

def arithmetic_problem(a: int, b: int) -> Problem:
    """`a+b=` with its worked solution: digit-by-digit addition with carries, ending in `#a+b`."""
    da, db = str(a)[::-1], str(b)[::-1]
    lines = []
    carry = 0
    for i in range(max(len(da), len(db))):
        terms = [d[i] for d in (da, db) if i < len(d)] + ([str(carry)] if carry else [])
        s = sum(int(t) for t in terms)
        lines.append("+".join(terms) + f"={s}")
        carry = s // 10
    return Problem(prompt=f"{a}+{b}=\n", answer=str(a + b), task="arithmetic",
                   target="\n".join(lines) + f"\n{ANSWER_MARK}{a + b}")

def arithmetic_final_answer(completion: str):
    """The final answer as the arithmetic task formats it (`#123` on the last line), else None."""
    m = _ARITH_ANSWER.search(completion.strip())
    return m.group(1) if m else None

def _draw_arithmetic(rng, min_digits, max_digits) -> Problem:
    def operand():
        digits = int(rng.integers(min_digits, max_digits + 1))
        return int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits))
    return arithmetic_problem(operand(), operand())

def _fixed_split(draw, size) -> list:
    """`size` distinct problems from a fixed seed, in the order first drawn."""
    rng = np.random.default_rng(_TEST_SEED)
    problems = {}
    while len(problems) < size:
        p = draw(rng)
        problems.setdefault(p.prompt, p)
    return list(problems.values())

def arithmetic_test(size, min_digits=1, max_digits=4) -> list:
    return _fixed_split(lambda rng: _draw_arithmetic(rng, min_digits, max_digits), size)

# --- longtail: a running total over named terms, their number long-tailed -----------------------

# Additions per problem: round(median * exp(sigma * z)), z standard normal, clipped to [1, most]
# (26 letters name the terms: 25 additions at most).
_LONGTAIL_ADDITIONS = dict(median=2.0, sigma=1.25, most=25)

def longtail_problem(first: str, terms) -> Problem:
    """`k=3 l=5 m=8` -> `k=3: 0+3=3 / l=5: 3+5=8 / m=8: 8+8=16 / #16`: terms named by consecutive
    letters from `first`, a running total with one line per term."""
    names = [chr(ord(first) + i) for i in range(len(terms))]
    # the running total before each term, then after the last
    totals = list(accumulate(terms, initial=0))
    lines = [f"{name}={t}: {s}+{t}={s + t}" for name, t, s in zip(names, terms, totals)]
    prompt = " ".join(f"{name}={t}" for name, t in zip(names, terms)) + "\n"
    return Problem(prompt=prompt, answer=str(totals[-1]), task="longtail",
                   target="\n".join(lines) + f"\n{ANSWER_MARK}{totals[-1]}")

def _draw_longtail(rng) -> Problem:
    a = _LONGTAIL_ADDITIONS
    n = round(a["median"] * float(np.exp(a["sigma"] * rng.standard_normal())))
    n = min(max(n, 1), a["most"])
    first = chr(ord("a") + int(rng.integers(0, 26 - n)))
    return longtail_problem(first, [int(t) for t in rng.integers(1, 10, size=n + 1)])

def longtail_test(size) -> list:
    return _fixed_split(_draw_longtail, size)

# --- calc: multiplication with a calculator tool (envs.Calculator) --------------------------------

def calc_problem(a: int, b: int) -> Problem:
    """`a*b` (data.min_digits..max_digits-digit operands): more than the tiny model can multiply in
    its head. Its worked solution calls the tool, whose answer (`=` then the value, envs.Calculator)
    is the environment's, not the model's: `a*b=` <tool: `v` newline> `#v`."""
    return Problem(prompt=f"{a}*{b}\n", answer=str(a * b), task="calc",
                   target=f"{a}*{b}={a * b}\n{ANSWER_MARK}{a * b}")

def _draw_calc(rng, min_digits, max_digits) -> Problem:
    a = _draw_arithmetic(rng, min_digits, max_digits).prompt[:-2].split("+")
    return calc_problem(int(a[0]), int(a[1]))

# --- GSM8K / MATH-style sets ---------------------------------------------------------------------

def extract_boxed(text: str):
    """Content of the last \\boxed{...} with balanced braces, else None."""
    for m in reversed(list(re.finditer(r"\\boxed\s*\{", text))):
        depth = 0
        for j in range(m.end() - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[m.end():j]
    return None

def gold_answer(record: dict) -> str:
    """GSM8K: text after '####'; MATH: last \\boxed{} of the answer/solution; else the answer
    as is."""
    ans = str(record.get("answer", record.get("solution", "")))
    if "####" in ans:
        return ans.split("####")[-1].strip().replace(",", "")
    return extract_boxed(ans) or extract_boxed(str(record.get("solution", ""))) or ans.strip()

def math_problems(source: str, split: str) -> list:
    """Problems from a local JSONL file; else, read by `datasets`, an HF dataset (`name` or
    `name:config`, from the hub or the local HF cache) or a local dataset folder (e.g. train.jsonl +
    test.jsonl: split = file name)."""
    if source.endswith(".jsonl") or os.path.isfile(source):
        with open(source) as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        import datasets
        name, _, config = source.partition(":")
        records = datasets.load_dataset(name, config or None, split=split)
    out = []
    for r in records:
        q = r.get("problem", r.get("question"))
        if q is None or ("answer" not in r and "solution" not in r):
            raise SystemExit(f"{source}: each record needs 'problem' or 'question', and 'answer'; "
                             f"got {sorted(r)}")
        out.append(Problem(prompt=str(q), answer=gold_answer(r), task="math"))
    return out

# --- grading -------------------------------------------------------------------------------------

def score(completion: str, answer: str, task: str):
    """-> (reward, status) with the default table (correct 1.0, else 0.0). No time limit of its own:
    sympy can run for hours on a hostile answer, so the verifier calls it through ScorePool."""
    if task in ("arithmetic", "longtail", "calc"):
        pred = arithmetic_final_answer(completion)
        if pred is None:
            return 0.0, "no_answer"
        return (1.0, "correct") if int(pred) == int(answer) else (0.0, "wrong")
    if task != "math":
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    pred = extract_boxed(completion)
    # GSM8K-style gold: the last number of the completion
    if pred is None and _PLAIN_NUMBER.fullmatch(answer.strip().replace(",", "")):
        numbers = _NUMBER.findall(completion)
        pred = numbers[-1].replace(",", "") if numbers else None
    if pred is None:
        return 0.0, "no_answer"
    from math_verify import parse, verify  # lazy: only scoring processes pay for sympy
    # Both sides in the same \boxed{} wrapper, so that parse reads them alike. Timeouts off:
    # math_verify's signal.alarm works in a main thread only (verifier.py, simplification 3).
    gold, parsed = (parse("\\boxed{" + s + "}", parsing_timeout=None) for s in (answer, pred))
    if not parsed:
        return 0.0, "unparsable"
    if gold and verify(gold, parsed, timeout_seconds=None):
        return 1.0, "correct"
    # parse falls back to the raw string when sympy cannot read it: only an exact string
    # match counts
    return (0.0, "wrong") if any(not isinstance(p, str) for p in parsed) else (0.0, "unparsable")

# --- the scoring pool: grading in worker processes, each item under a time limit ------------------

def _worker_loop():
    """A ScorePool worker: JSON lines [completion, answer, task] on stdin -> [reward, status] on
    stdout."""
    # Ctrl-C hits the whole process group; the parent stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Linux: die with the parent even while stuck in sympy (PR_SET_PDEATHSIG = 1)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a library that prints must not corrupt the protocol: fd 1 now goes to stderr
    import logging
    # its "timeout is disabled" warnings: the timeouts are off on purpose
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # pay the import before saying ready, so that the item limit times scoring only
    import math_verify  # noqa: F401
    out.write(b"ready\n")
    for line in sys.stdin.buffer:
        try:
            reward, status = score(*json.loads(line))
        except Exception as e:  # our bug or a bad gold: one answer must never stop the worker
            print(f"[verifier] scoring error {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            reward, status = 0.0, "unparsable"
        out.write(json.dumps([reward, status]).encode() + b"\n")

class ScorePool:
    """`workers` scoring processes (simplification 3); an item's `timeout_s` runs from when a worker
    takes it. Completions are cut to their last `max_chars` characters (the answer is at the end):
    submit, then collect. Workers die with the thread that started them (PR_SET_PDEATHSIG): use a
    long-lived one."""

    def __init__(self, workers: int, timeout_s: float, max_chars: int):
        self.timeout_s, self.max_chars = timeout_s, max_chars
        # backlog: (ticket, item) not yet taken; results: (ticket, reward, status, seconds)
        self.backlog, self.results = deque(), []
        self.next_ticket, self.restarts, self.failed_starts = 0, 0, 0
        self.workers = [self._start() for _ in range(workers)]

    @staticmethod
    def _start():  # a fresh interpreter that imports this file only (simplification 3)
        code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import tasks; tasks._worker_loop()"
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return {"proc": proc, "ready": False, "job": None, "t0": 0.0}

    @staticmethod
    def _stop(w):
        w["proc"].kill()
        w["proc"].wait()
        for pipe in (w["proc"].stdin, w["proc"].stdout):
            with contextlib.suppress(OSError):  # unflushed input to a dead worker
                pipe.close()

    def _replace(self, w):
        self._stop(w)
        self.failed_starts += not w["ready"]
        if self.failed_starts > 3:
            raise RuntimeError("scoring workers die while starting; run `python -c 'import "
                               "tasks; tasks._worker_loop()'` to see why")
        if w["job"] is not None:
            self.results.append((w["job"], 0.0, "timeout", time.monotonic() - w["t0"]))
        self.workers[self.workers.index(w)] = self._start()
        self.restarts += 1

    def _dispatch(self):
        for w in list(self.workers):
            if self.backlog and w["ready"] and w["job"] is None:
                w["job"], item = self.backlog.popleft()
                w["t0"] = time.monotonic()
                try:
                    w["proc"].stdin.write(json.dumps(item).encode() + b"\n")
                    w["proc"].stdin.flush()
                except OSError:  # BrokenPipe: it died while idle; the item scores timeout
                    self._replace(w)

    def submit(self, completion: str, answer: str, task: str) -> int:
        """Queue one item; returns its ticket (collect reports it)."""
        ticket = self.next_ticket
        self.next_ticket += 1
        self.backlog.append((ticket, [completion[-self.max_chars:], answer, task]))
        self._dispatch()
        return ticket

    def busy(self) -> int:  # items submitted and not yet collected: queued + being scored
        return len(self.backlog) + sum(w["job"] is not None for w in self.workers)

    # the pipes that results arrive on (to wait on); they change when a worker is replaced
    def fds(self) -> list:
        return [w["proc"].stdout.fileno() for w in self.workers]

    def collect(self, timeout: float = 0.0) -> list:
        """-> [(ticket, reward, status, seconds)] finished since the last call; waits up to
        `timeout` s."""
        readable, _, _ = select.select(self.fds(), [], [], 0 if self.results else timeout)
        for w in list(self.workers):
            if w["proc"].stdout.fileno() in readable:
                # cannot block: a worker writes one whole line, then waits
                line = w["proc"].stdout.readline()
                if not line:  # EOF: the worker died (killed, out of memory, a crash in C)
                    self._replace(w)
                elif not w["ready"]:
                    w["ready"] = True
                    self.failed_starts = 0
                else:
                    reward, status = json.loads(line)
                    self.results.append((w["job"], float(reward), status, time.monotonic() - w["t0"]))
                    w["job"] = None
            elif w["job"] is not None and time.monotonic() - w["t0"] > self.timeout_s:
                self._replace(w)
        self._dispatch()
        out, self.results = self.results, []
        return out

    def close(self):
        for w in self.workers:
            self._stop(w)
        self.workers = []

# --- the training stream and the test split -------------------------------------------------------

class TrainStream:
    """Endless seeded stream of training problems, indexed by group id: `get(i)` is the same
    problem in every process and every restart (actor.py asks for group i's; an id generated again
    gets its problem again)."""

    def __init__(self, cfg_data, seed: int, test: list):
        self.cfg, self.seed = cfg_data, seed
        self.test_keys = {p.prompt for p in test}
        self.items = None
        if cfg_data.task == "math":
            items = math_problems(cfg_data.train_path, cfg_data.hf_split_train)
            self.items = [p for p in items if p.prompt not in self.test_keys] or items

    def get(self, i: int) -> Problem:
        if self.items is not None:  # a fresh seeded permutation per epoch
            n = len(self.items)
            return self.items[np.random.default_rng([self.seed, i // n]).permutation(n)[i % n]]
        for k in range(1000):  # redraw the rare training problem that is in the test split
            rng = np.random.default_rng([self.seed, i, k])
            if self.cfg.task == "longtail":
                p = _draw_longtail(rng)
            else:
                draw = _draw_calc if self.cfg.task == "calc" else _draw_arithmetic
                p = draw(rng, self.cfg.min_digits, self.cfg.max_digits)
            if p.prompt not in self.test_keys:
                return p
        raise RuntimeError(f"{self.cfg.task}: the test split covers the whole problem space; "
                           "lower data.test_size")

def load_tasks(cfg):
    """-> (TrainStream, test problems) for a Config."""
    d = cfg.data
    if d.task == "math":
        test = math_problems(d.test_path, d.hf_split_test)[:d.test_size] if d.test_path else []
    elif d.task == "longtail":
        test = longtail_test(d.test_size)
    elif d.task == "calc":
        test = _fixed_split(lambda rng: _draw_calc(rng, d.min_digits, d.max_digits), d.test_size)
    else:
        test = arithmetic_test(d.test_size, d.min_digits, d.max_digits)
    return TrainStream(d, cfg.run.seed, test), test

def format_prompt(problem: Problem, tokenizer=None, prompt_format: str = "plain",
                  tools: tuple = ()) -> str:
    """plain: the question as is (the tiny models); chat: the tokenizer's chat template + a
    \\boxed{} ask, and the environment's tools (JSON schemas, envs.Env.tools) where it has any."""
    if prompt_format == "plain":
        return problem.prompt
    ask = "Please reason step by step, and put your final answer within \\boxed{}."
    messages = [{"role": "user", "content": f"{problem.prompt}\n{ask}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **({"tools": list(tools)} if tools else {}))
