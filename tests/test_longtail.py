"""The long-tailed task (tasks.py, data.task=longtail), its overlay, and the band logic of the
warm-start build (scripts/make_tiny_model.py).

    PYTHONPATH=. .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_longtail.py

Tier (a): the generator and grader on hand-worked examples; the length distribution of the task's
targets on a fixed seeded sample (no model); the fixed, disjoint test split; configs/longtail.yaml.
The band logic runs for real, on the arithmetic task with a budget of a few steps (~30 s in all):
what the build does when accuracy lands inside, below and above the band. The built model's own
length statistics: the build marks it COMPLETE only when they show the tail (has_long_tail, tested
on hand-made statistics here; a build sampling 1,024 completions takes ~11 min).
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import tasks
from scripts import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
OVERLAY = str(REPO / "configs" / "longtail.yaml")


# --- the generator and the grader -----------------------------------------------------------------

def test_problem_hand_worked():
    p = tasks.longtail_problem("k", [3, 5, 8])
    assert p.prompt == "k=3 l=5 m=8\n"
    assert p.target == "k=3: 0+3=3\nl=5: 3+5=8\nm=8: 8+8=16\n#16"
    assert (p.answer, p.task) == ("16", "longtail")
    two = tasks.longtail_problem("x", [9, 9])
    assert (two.prompt, two.answer) == ("x=9 y=9\n", "18")
    assert two.target == "x=9: 0+9=9\ny=9: 9+9=18\n#18"


@pytest.mark.parametrize("completion,status", [
    ("k=3: 0+3=3\nl=5: 3+5=8\nm=8: 8+8=16\n#16", "correct"),
    ("#16", "correct"),  # only the final answer is graded, exactly
    ("k=3: 0+3=3\nl=5: 3+5=8\nm=8: 8+8=15\n#15", "wrong"),
    ("#16\n#15", "wrong"),  # the last answer counts
    ("k=3: 0+3=3\nl=5: 3+5=8\nm=8: 8+8=16", "no_answer"),
    ("#16 done", "no_answer"),
])
def test_grader(completion, status):
    reward, got = tasks.score(completion, "16", "longtail")
    assert got == status
    assert reward == (1.0 if status == "correct" else 0.0)


def test_generated_problems_are_worked_correctly():
    """Every target adds up line by line, over the prompt's terms in order, to the answer."""
    train, test = tasks.load_tasks(common.load_config([OVERLAY]))
    for p in [train.get(i) for i in range(300)] + test:
        terms = [chunk.split("=") for chunk in p.prompt.split()]
        names = [name for name, _ in terms]
        assert names == [chr(ord(names[0]) + i) for i in range(len(names))]
        lines = p.target.splitlines()
        assert lines[-1] == f"#{p.answer}" and len(lines) == len(terms) + 1
        total = 0
        for line, (name, value) in zip(lines, terms):
            head, body = line.split(": ")
            assert head == f"{name}={value}"
            assert body == f"{total}+{value}={total + int(value)}"
            total += int(value)
        assert total == int(p.answer) == sum(int(v) for _, v in terms)


# --- lengths of the targets: a long tail, most of the mass short ---------------------------------

def test_target_lengths_long_tailed():
    cfg = common.load_config([OVERLAY])
    train, test = tasks.load_tasks(cfg)
    tok = make_tiny_model.make_tokenizer()
    # In tokens, as the engine counts a completion: the target and its EOS.
    lengths = np.array([len(tok(train.get(i).target)["input_ids"]) + 1 for i in range(2000)])
    p50, p90 = np.percentile(lengths, [50, 90])
    assert p90 >= 3 * p50, (p50, p90)
    assert lengths.max() >= 8 * p50, (p50, lengths.max())
    assert (lengths <= 2 * p50).mean() >= 0.6  # most of the mass short
    # No target is cut by the overlay's max_tokens; prompt + completion fit the model's positions.
    longest = tasks.longtail_problem("a", [9] * 26)
    assert len(tok(longest.target)["input_ids"]) + 1 <= cfg.actor.max_tokens
    room = make_tiny_model.BUILDS["longtail"]["max_pos"]
    assert len(tok(longest.prompt)["input_ids"]) + cfg.actor.max_tokens <= room
    assert max(len(tok(p.target)["input_ids"]) + 1 for p in test) <= cfg.actor.max_tokens


# --- the test split: fixed, distinct, disjoint from training --------------------------------------

def test_test_split_fixed_and_disjoint():
    cfg = common.load_config([OVERLAY])
    train, test = tasks.load_tasks(cfg)
    other_train, other_test = tasks.load_tasks(common.load_config([OVERLAY, "run.seed=7"]))
    assert test == other_test  # whatever run.seed is
    assert test == tasks.longtail_test(cfg.data.test_size)
    assert len({p.prompt for p in test}) == len(test) == cfg.data.test_size
    train_items = [train.get(i) for i in range(3000)]
    assert not {p.prompt for p in train_items} & {p.prompt for p in test}
    # One-addition problems are ~40% of the draws and a small space (25 first letters x 81 pairs):
    # the training stream redraws those in the test split instead of skipping the short problems.
    assert np.mean([p.prompt.count("=") == 2 for p in train_items]) > 0.25
    assert tasks.load_tasks(cfg)[0].get(17) == train_items[17]  # addressable by cursor (resume)
    assert [other_train.get(i) for i in range(20)] != train_items[:20]


# --- the overlay --------------------------------------------------------------------------------

def test_overlay_loads():
    cfg = common.load_config([OVERLAY])
    assert cfg.data.task == "longtail" and cfg.model.path == "assets/tiny-longtail"
    assert cfg.actor.max_tokens >= 320
    assert cfg.actor.eval_temperature == 1.0  # the policy as RL samples it (the overlay says why)
    assert common.load_config().data.task == "arithmetic"  # the embedded demo stays as it is
    with pytest.raises(common.ConfigError, match="data.task"):
        common.load_config(["data.task=longtails"])


def test_long_tail_criterion():
    """The build marks a longtail model COMPLETE only when its own samples at temperature 1 show the
    tail (make_tiny_model.has_long_tail): the warm start's measured statistics pass, a narrow or
    a tail-less distribution does not."""
    measured = {"p50": 40.0, "p90": 131.0, "max": 384}  # configs/longtail.yaml's comment
    assert make_tiny_model.has_long_tail(measured)
    assert not make_tiny_model.has_long_tail({**measured, "p90": 100.0})  # 2.5x the median
    assert not make_tiny_model.has_long_tail({**measured, "max": 300})  # 7.5x
    assert not make_tiny_model.has_long_tail({"p50": 30.0, "p90": 40.0, "max": 45})  # arithmetic-like


# --- the warm-start build's band logic ------------------------------------------------------------

def test_band_step():
    band = (0.35, 0.45)
    assert make_tiny_model.band_step(0.35, band) == "stop"
    assert make_tiny_model.band_step(0.45, band) == "stop"
    assert make_tiny_model.band_step(0.34, band) == "save"
    assert make_tiny_model.band_step(0.46, band) == "rewind"


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _build(tmp_path, band, max_steps):
    """A real arithmetic build on a budget of a few steps, evaluated on 8 test problems."""
    logs = []
    info = make_tiny_model.warm_start(tmp_path, task="arithmetic", band=band, max_steps=max_steps,
                                      eval_every=2, test_size=8, threads=1, log=logs.append)
    # Only a model inside the band is marked COMPLETE: run.sh builds any other again.
    assert (tmp_path / "COMPLETE").exists() == info["in_band"]
    assert json.loads((tmp_path / "warmstart.json").read_text()) == info
    return info, logs


def _weights(model_dir):
    from safetensors.torch import load_file
    return load_file(str(Path(model_dir) / "model.safetensors"))


def test_band_inside_stops_at_first_evaluation(tmp_path, restore_threads):
    # Any accuracy is inside [0, 1]: the first evaluation (step 2: near the band) ends the build.
    info, logs = _build(tmp_path, (0.0, 1.0), max_steps=50)
    assert (info["steps"], info["in_band"], info["rewinds"]) == (2, True, 0)
    assert len(logs) == 1


def test_band_below_trains_until_budget(tmp_path, restore_threads):
    # A random model scores ~0, far below [0.99, 1]: evaluations are sparse (every 25 steps), each
    # one saved as the state to rewind to, and the budget ends the build outside the band, with no
    # COMPLETE (a 600 s budget on a busy machine once left a 0.3% model marked complete).
    info, logs = _build(tmp_path, (0.99, 1.0), max_steps=30)
    assert (info["steps"], info["in_band"], info["rewinds"]) == (30, False, 0)
    assert sum("greedy test accuracy" in line for line in logs) == 1
    assert "budget spent" in logs[-1]


def test_band_above_rewinds(tmp_path, restore_threads):
    # Every accuracy is above [-1, -0.5]: each evaluation rewinds to the last state below the band
    # (here the random initial model) and evaluates every step after; the budget ends the build
    # with the rewound model, whose weights equal a fresh init from the same seed.
    info, _ = _build(tmp_path, (-1.0, -0.5), max_steps=5)
    assert info["rewinds"] == 4  # steps 2 (eval_every), then 3, 4, 5 (every step after a rewind)
    assert (info["steps"], info["in_band"], info["greedy_test_accuracy"]) == (5, False, 0.0)
    max_pos = make_tiny_model.BUILDS["arithmetic"]["max_pos"]
    fresh = make_tiny_model.random_model_dir(tmp_path / "fresh", seed=0, max_pos=max_pos)
    built, init = _weights(tmp_path), _weights(fresh)
    assert built.keys() == init.keys()
    assert all(torch.equal(built[k], init[k]) for k in built)
