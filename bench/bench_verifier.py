"""Scoring throughput of tasks.ScorePool: 1 worker vs N workers on the same realistic mix, side by side.

    .venv/bin/python bench/bench_verifier.py [--workers 2] [--items 800] [--rounds 2]

The mix: half arithmetic completions (the task's worked solutions; 60% correct, 30% wrong, 10% without a
final answer), half math (\\boxed{} answers in equivalent or different LaTeX forms, GSM8K-style plain
numbers, a few without an answer; random numbers, so math_verify's parse cache rarely hits). Each pool
is warmed up first (worker start-up is not timed); the pools alternate rounds, on fresh items each
round, so that other load on the machine hits both alike. Prints items/s and the ratio.
Not a test: the ratio depends on free cores; on 2 cores busy with other work it stays near 1.
"""
import argparse
import os
import sys
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks  # noqa: E402
from tests.conftest import score_many  # noqa: E402
from tasks import ScorePool  # noqa: E402

# Math templates filled with random numbers, so that math_verify's parse cache does not make repeats free.
MATH = [  # (completion, gold) as functions of two random integers p, q
    lambda p, q: (f"We get $x = \\frac{{{p}}}{{{q}}}$, so the answer is \\boxed{{\\dfrac{{{p}}}{{{q}}}}}.",
                  f"\\frac{{{2 * p}}}{{{2 * q}}}"),
    lambda p, q: (f"Simplifying, \\boxed{{{p}\\sqrt{{2}}}}", f"\\sqrt{{{2 * p * p}}}"),
    lambda p, q: (f"The solution set is \\boxed{{[{p}, {p + q})}}", f"[{p},{p + q})"),
    lambda p, q: (f"The roots are \\boxed{{\\{{-{p}, {q}\\}}}}", f"\\{{{q},-{p}\\}}"),
    lambda p, q: (f"Thus the area is \\boxed{{{p}\\pi}}.", f"{p + 1}\\pi"),
    lambda p, q: (f"so the probability is \\boxed{{{p / 100}}}", f"\\frac{{{p}}}{{100}}"),
    lambda p, q: (f"She pays {p}*{q} = {p * q} dollars in total.", f"{p * q}"),
    lambda p, q: (f"In total {p * 1000 + q:,} apples were sold.", f"{p * 1000 + q}"),
    lambda p, q: (f"He has {p} marbles left.", f"{q}"),
    lambda p, q: ("I am not sure how to finish this problem.", f"\\frac{{{p}}}{{{q}}}"),
]


def make_items(n, seed=0):
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        if rng.random() < 0.5:
            a, b = (int(x) for x in rng.integers(0, 10_000, size=2))
            text, answer = tasks.arithmetic_problem(a, b).target, str(a + b)
            u = rng.random()
            if u < 0.3:
                text = text.rsplit(tasks.ANSWER_MARK, 1)[0] + f"{tasks.ANSWER_MARK}{a + b + 1}"
            elif u < 0.4:
                text = text.rsplit(tasks.ANSWER_MARK, 1)[0]
            items.append((text, answer, "arithmetic"))
        else:
            p, q = (int(x) for x in rng.integers(1, 100, size=2))
            text, answer = MATH[int(rng.integers(len(MATH)))](p, q)
            items.append((text, answer, "math"))
    return items


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--items", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    items = make_items(args.items)
    pools = {1: ScorePool(1, timeout_s=10, max_chars=20_000),
             args.workers: ScorePool(args.workers, timeout_s=10, max_chars=20_000)}
    try:
        for pool in pools.values():  # warm up: every worker started and has parsed once
            score_many(pool, make_items(4 * args.workers, seed=1))
        seconds = {w: 0.0 for w in pools}
        statuses = Counter()
        for r in range(args.rounds):
            for w, pool in pools.items():
                t0 = time.perf_counter()
                results = score_many(pool, items[r::args.rounds])  # fresh items each round
                seconds[w] += time.perf_counter() - t0
                if w == 1:
                    statuses.update(status for _, status in results)
                assert pool.restarts == 0, "a worker timed out: the numbers would include restarts"
        rate = {w: len(items) / s for w, s in seconds.items()}
        print(f"mix of {len(items)} items: {dict(statuses)}")
        for w in pools:
            print(f"{w} worker(s): {rate[w]:8.1f} items/s")
        print(f"ratio {args.workers} workers / 1 worker: {rate[args.workers] / rate[1]:.2f}x "
              f"(cores available: {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f})")
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    main()
