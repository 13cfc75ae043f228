"""Datasets: the built-in arithmetic task, GSM8K/MATH-style sets, prompt formatting, grading (`score`).

Training problems: an endless seeded stream that never overlaps the test split. Arithmetic: `a+b` with
1..4-digit operands, the target adding column by column, right to left, with the carry, then `#answer`:

    47+385=   ->   7+5=12 / 4+8+1=13 / 3+1=4 / #432

so its length grows with the problem (8 characters for 3+4, ~40 for 4-digit operands with carries): the long
tail that PipelineRL exploits (paper Sec. 3).
"""
import json
import os
import re
from dataclasses import dataclass

import numpy as np

ANSWER_MARK = "#"
_ARITH_ANSWER = re.compile(r"#(\d+)\s*$")
_TEST_SEED = 12345  # the arithmetic test split is fixed, whatever run.seed is
STATUSES = ("correct", "wrong", "no_answer", "unparsable", "timeout")  # what grading says of an answer
TASKS = ("arithmetic", "math")
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")  # 1,234.5 or 1234.5

@dataclass(frozen=True)
class Problem:
    prompt: str  # the raw question text (format_prompt makes the model's input)
    answer: str  # the gold final answer
    task: str  # the grader: one of TASKS
    target: str = ""  # a worked solution where one exists (arithmetic: warm-starts the tiny model)

# --- arithmetic -------------------------------------------------------------------------------------

def arithmetic_problem(a: int, b: int) -> Problem:
    """`a+b=` with its worked solution: digit-by-digit addition with carries, ending in `#a+b`."""
    da, db = str(a)[::-1], str(b)[::-1]
    lines, carry = [], 0
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

def _draw_operands(rng, min_digits, max_digits):
    def one():
        d = int(rng.integers(min_digits, max_digits + 1))
        return int(rng.integers(10 ** (d - 1) if d > 1 else 0, 10 ** d))
    return one(), one()

def arithmetic_test(size, min_digits=1, max_digits=4) -> list:
    """`size` distinct problems from a fixed seed, in the order first drawn."""
    rng, operands = np.random.default_rng(_TEST_SEED), {}
    while len(operands) < size:
        operands.setdefault(_draw_operands(rng, min_digits, max_digits))
    return [arithmetic_problem(*ab) for ab in operands]

# --- GSM8K / MATH-style sets ------------------------------------------------------------------------

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
    """GSM8K: text after '####'; MATH: last \\boxed{} of the answer/solution; else the answer as is."""
    ans = str(record.get("answer", record.get("solution", "")))
    if "####" in ans:
        return ans.split("####")[-1].strip().replace(",", "")
    return extract_boxed(ans) or extract_boxed(str(record.get("solution", ""))) or ans.strip()

def math_problems(source: str, split: str) -> list:
    """Problems from a local JSONL file; else, read by `datasets`, an HF dataset (`name` or `name:config`, from
    the hub or the local HF cache) or a local dataset folder (e.g. train.jsonl + test.jsonl: split = file name)."""
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
            raise SystemExit(f"{source}: each record needs 'problem' or 'question', and 'answer'; got {sorted(r)}")
        out.append(Problem(prompt=str(q), answer=gold_answer(r), task="math"))
    return out

# --- grading -------------------------------------------------------------------------------------------

def score(completion: str, answer: str, task: str):
    """-> (reward, status) with the default table (correct 1.0, else 0.0). No time limit of its own: sympy
    can run for hours on a hostile answer, so the verifier calls it through ScorePool."""
    if task == "arithmetic":
        pred = arithmetic_final_answer(completion)
        if pred is None:
            return 0.0, "no_answer"
        return (1.0, "correct") if int(pred) == int(answer) else (0.0, "wrong")
    if task != "math":
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    pred = extract_boxed(completion)
    if pred is None and _PLAIN_NUMBER.fullmatch(answer.strip().replace(",", "")):  # GSM8K-style gold
        numbers = _NUMBER.findall(completion)
        pred = numbers[-1].replace(",", "") if numbers else None
    if pred is None:
        return 0.0, "no_answer"
    from math_verify import parse, verify  # lazy: only scoring processes pay for sympy
    # Both sides in the same \boxed{} wrapper, so that parse reads them alike. Timeouts off: math_verify's
    # signal.alarm works in a main thread only (verifier.py, simplification 3).
    gold, parsed = (parse("\\boxed{" + s + "}", parsing_timeout=None) for s in (answer, pred))
    if not parsed:
        return 0.0, "unparsable"
    if gold and verify(gold, parsed, timeout_seconds=None):
        return 1.0, "correct"
    # parse falls back to the raw string when sympy cannot read it: only an exact string match counts
    return (0.0, "wrong") if any(not isinstance(p, str) for p in parsed) else (0.0, "unparsable")

# --- the training stream and the test split -----------------------------------------------------------

class TrainStream:
    """Endless seeded stream of training problems, addressed by cursor (for resume)."""

    def __init__(self, cfg_data, seed: int, test: list):
        self.cfg, self.seed, self.test_keys, self.items = cfg_data, seed, {p.prompt for p in test}, None
        if cfg_data.task == "math":
            items = math_problems(cfg_data.train_path, cfg_data.hf_split_train)
            self.items = [p for p in items if p.prompt not in self.test_keys] or items

    def get(self, i: int) -> Problem:
        if self.items is not None:  # a fresh seeded permutation per epoch
            n = len(self.items)
            return self.items[np.random.default_rng([self.seed, i // n]).permutation(n)[i % n]]
        for k in range(1000):  # redraw the rare training problem that is in the test split
            rng = np.random.default_rng([self.seed, i, k])
            p = arithmetic_problem(*_draw_operands(rng, self.cfg.min_digits, self.cfg.max_digits))
            if p.prompt not in self.test_keys:
                return p
        raise RuntimeError("arithmetic: the test split covers the whole problem space; lower data.test_size")

def load_tasks(cfg):
    """-> (TrainStream, test problems) for a Config."""
    d = cfg.data
    if d.task == "math":
        test = math_problems(d.test_path, d.hf_split_test)[:d.test_size] if d.test_path else []
    else:
        test = arithmetic_test(d.test_size, d.min_digits, d.max_digits)
    return TrainStream(d, cfg.run.seed, test), test

def format_prompt(problem: Problem, tokenizer=None, prompt_format: str = "plain") -> str:
    """plain: the question as is (the tiny model); chat: the tokenizer's chat template + \\boxed{} ask."""
    if prompt_format == "plain":
        return problem.prompt
    content = f"{problem.prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
