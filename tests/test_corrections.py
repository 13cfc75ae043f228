"""Tier (a): each off-policy correction (corrections.py) against a hand-worked example, through
loss.policy_loss as the trainer calls it: the loss, its gradient, and the statistics logged by lag; the
config key that chooses one and the bounds it refuses. Pure torch, no processes.

Run: bash run.sh test tests/test_corrections.py      (< 10 s)
"""
import json
import math

import pytest
import torch

import common
import corrections
import loss as L
from conftest import REPO

# Two sequences, ratios ρ = π/μ per token (row 1's last token is padding):
#   row 0: ρ = [1, 2, 8]      s_0 = (1·2·8)^(1/3) = 16^(1/3) ≈ 2.5198
#   row 1: ρ = [0.25, 1, -]   s_1 = (0.25·1)^(1/2) = 0.5
RATIOS = [[1.0, 2.0, 8.0], [0.25, 1.0, 1.0]]
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([1.0, -2.0], dtype=torch.float64)
LAGS = torch.tensor([[0, 1, 9], [2, 0, 0]])


def run(correction, is_clamp=5.0):
    logprobs = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    old = logprobs.detach() - torch.tensor(RATIOS, dtype=torch.float64).log()
    out, st = L.policy_loss(logprobs, old, ADV, MASK, num_sequences=2, is_clamp=is_clamp, lags=LAGS,
                            correction=correction)
    out.backward()
    return out.item(), logprobs.grad, st


def expect(weights, kept):
    """loss and grad of -(1/2) Σ kept·w·A·log π with log π = -1 everywhere."""
    w = torch.tensor(weights, dtype=torch.float64) * torch.tensor(kept, dtype=torch.float64)
    grad = -(w * ADV[:, None]) / 2
    return (-(w * ADV[:, None] * -1.0).sum() / 2).item(), grad


def choose(name, **overrides):
    cfg = common.load_config([f"trainer.correction={name}", *(f"trainer.{k}={v}" for k, v in overrides.items())])
    return corrections.choose(cfg.trainer)


def test_tis_is_eq5_and_the_default():
    # w = min(5, ρ) = [1, 2, 5 | 0.25, 1]
    value, grad = expect([[1, 2, 5], [0.25, 1, 0]], [[1, 1, 1], [1, 1, 0]])
    for correction in (None, choose("tis")):
        got, g, st = run(correction)
        assert got == pytest.approx(value) and value == pytest.approx(-((1 + 2 + 5) * -1 + (-2) * (1.25) * -1) / 2)
        torch.testing.assert_close(g, grad)
        assert st["clamped_tokens"].item() == 1 and st["masked_tokens"].item() == 0


def test_seq_is_gives_every_token_its_sequences_geometric_mean():
    s0, s1 = 16 ** (1 / 3), 0.5
    value, grad = expect([[s0] * 3, [s1] * 3], [[1, 1, 1], [1, 1, 0]])
    got, g, st = run(choose("seq_is"))
    assert got == pytest.approx(value)
    torch.testing.assert_close(g, grad)
    # ESS over the five tokens of w = [s0, s0, s0, s1, s1]
    w = [s0] * 3 + [s1] * 2
    assert L.ess(st["ratio_sum"], st["ratio_sq_sum"], st["tokens"]) == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))
    # truncated at c: s_0 = 2.52 stays under 5, with c = 2 it is clamped (3 tokens)
    _, _, st2 = run(choose("seq_is", is_clamp=2.0), is_clamp=2.0)
    assert st2["clamped_tokens"].item() == 3


def test_token_mask_drops_ratios_outside_the_band():
    # band [0.5, 2]: ρ = 8 and ρ = 0.25 dropped; kept tokens weighted by their raw ratio
    value, grad = expect([[1, 2, 8], [0.25, 1, 1]], [[1, 1, 0], [0, 1, 0]])
    got, g, st = run(choose("token_mask"))
    assert got == pytest.approx(value)
    torch.testing.assert_close(g, grad)
    assert st["masked_tokens"].item() == 2 and st["tokens"].item() == 5
    # by lag: the dropped tokens had lags 9 (bucket ">8") and 2 (bucket "2")
    torch.testing.assert_close(st["bucket_masked"], torch.tensor([0.0, 0, 1, 0, 0, 1], dtype=torch.float64))


def test_seq_mask_drops_whole_sequences_by_their_geometric_mean():
    # band [0.5, 2]: s_0 = 2.52 outside (row 0 dropped whole), s_1 = 0.5 inside: eq. 5's weights there
    value, grad = expect([[1, 2, 5], [0.25, 1, 0]], [[0, 0, 0], [1, 1, 0]])
    got, g, st = run(choose("seq_mask"))
    assert got == pytest.approx(value)
    torch.testing.assert_close(g, grad)
    assert st["masked_tokens"].item() == 3
    # a wider band keeps both: eq. 5 exactly
    tis_value, _, _ = run(None)
    assert run(choose("seq_mask", mask_high=3.0))[0] == pytest.approx(tis_value)


def test_m2po_drops_the_largest_second_moments_until_the_mean_is_under_tau():
    # (log ρ)² on the five tokens: [0, ln2², ln8², ln4², 0] = [0, 0.480, 4.324, 1.922, 0]
    sq = [0, math.log(2) ** 2, math.log(8) ** 2, math.log(4) ** 2, 0]
    assert sum(sq) / 5 > 0.5  # all kept: mean 1.345
    # tau = 0.5: drop ln8² (mean of the rest 0.600 > 0.5), then ln4² (0.160 <= 0.5): two dropped
    value, grad = expect([[1, 2, 8], [0.25, 1, 1]], [[1, 1, 0], [0, 1, 0]])
    got, g, st = run(choose("m2po", m2po_tau=0.5))
    assert got == pytest.approx(value)
    torch.testing.assert_close(g, grad)
    assert st["masked_tokens"].item() == 2
    # tau = 1.0: dropping ln8² alone leaves 0.600 <= 1.0
    assert run(choose("m2po", m2po_tau=1.0))[2]["masked_tokens"].item() == 1
    # on-policy: nothing dropped
    w, kept = corrections.m2po(torch.zeros(2, 3, dtype=torch.float64), MASK, 0.04)
    assert torch.equal(kept, MASK) and torch.equal(w, torch.ones(2, 3, dtype=torch.float64))


def test_padding_never_counts():
    """Off-mask tokens (padding) hold any value: no correction keeps, weighs or counts them."""
    for name in ("tis", "seq_is", "token_mask", "seq_mask", "m2po"):
        f = choose(name)
        log_ratio = torch.tensor([[0.1, -0.2, 50.0]], dtype=torch.float64)
        w, kept = f(torch.where(torch.tensor([[True, True, False]]), log_ratio, 0.0), torch.tensor([[True, True, False]]))
        assert not kept[0, 2], name


@pytest.mark.parametrize("overrides, message", [
    (["trainer.correction=ppo"], "trainer.correction='ppo'; allowed: tis, seq_is, token_mask, seq_mask, m2po"),
    (["trainer.mask_low=1.2"], "need 0 < mask_low < 1 < mask_high"),
    (["trainer.mask_high=1.0"], "need 0 < mask_low < 1 < mask_high"),
    (["trainer.mask_low=0"], "trainer.mask_low=0.0: must be > 0"),
    (["trainer.m2po_tau=-1"], "trainer.m2po_tau=-1.0: must be > 0"),
])
def test_config_names_the_choices_and_refuses_bad_bounds(overrides, message):
    with pytest.raises(common.ConfigError) as e:
        common.load_config(overrides)
    assert message in str(e.value)


def test_every_run_of_the_staleness_sweep_is_a_valid_config(tmp_path):
    """bench/staleness_sweep.py's full tier (70 runs) and its longtail variant: each run's overrides load
    (forced lag L: sync.send_every = L + 1 under actor.max_lag = L + 1), and a forced lag the lag budget
    cannot hold is refused by name."""
    import sys
    sys.path.insert(0, str(REPO / "bench"))
    import staleness_sweep as sweep
    for task in ("arithmetic", "longtail"):
        a = sweep.argparse.Namespace(task=task, steps=120, lr=1e-4, eval_every=20)
        tier = sweep.TIERS["full"]
        for lag in tier["lags"]:
            for c in tier["corrections"]:
                over = sweep.overrides(a, lag, c, 0, tmp_path / "run")
                cfg = common.load_config([str(REPO / o) if o.endswith(".yaml") else o for o in over])
                assert (cfg.sync.send_every, cfg.actor.max_lag, cfg.trainer.correction) == (lag + 1, lag + 1, c)
    with pytest.raises(common.ConfigError, match="sync.send_every=9: forced staleness"):
        common.load_config(["sync.send_every=9", "actor.max_lag=4"])


def test_a_saved_sweep_tables_again_from_its_saved_rows(tmp_path):
    """A sweep saved with --save (each run's config, evaluations and row.json; a few KB a run) is
    enough to rebuild its table and figure in a new checkout: --report over a copy of the committed
    lr 3e-4 sweep writes the committed table again, byte for byte, and a figure."""
    import shutil
    import sys
    sys.path.insert(0, str(REPO / "bench"))
    import staleness_sweep as sweep
    saved = REPO / "results/staleness-lr3e-4"
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    for f in ("sweep.txt", "sweep.json", "sweep.png"):
        (root / f).unlink()
    sweep.main(["--tier", "quick", "--lr", "3e-4", "--seeds", "0", "1", "--root", str(root),
                "--report"])
    assert (root / "sweep.txt").read_text() == (saved / "sweep.txt").read_text()
    assert (root / "sweep.png").stat().st_size > 0
    rows = json.loads((root / "sweep.json").read_text())
    assert len(rows) == 18 and all(r["run_dir"].startswith(str(root)) for r in rows)


def test_the_sweep_compares_runs_at_the_samples_every_run_reached(tmp_path):
    """A stale run's engines evaluate only the versions they hold, so its last evaluation comes at
    fewer samples than a fresh run's: the headline table reads every run at the most samples that
    all of them have an evaluation at or past (linear between evaluations), not at its last two."""
    import sys
    sys.path.insert(0, str(REPO / "bench"))
    import staleness_sweep as sweep

    def row(lag, curve):
        return {"lag": lag, "correction": "tis", "seed": 0, "mean_lag": lag / 2,
                "first_test": curve[0][2], "last2_test": (curve[-1][2] + curve[-2][2]) / 2,
                "curve": curve}
    fresh = row(0, [[0, 0, 0.4], [1, 100, 0.5], [2, 200, 0.6], [3, 300, 0.9]])
    stale = row(32, [[0, 0, 0.4], [1, 150, 0.3]])
    rows = [fresh, stale]
    assert sweep.common_samples(rows) == 150
    assert sweep.reward_at(fresh, 150) == pytest.approx(0.55)
    assert sweep.rewards(rows, 150) == {("tis", 0): [pytest.approx(0.55)], ("tis", 32): [0.3]}
    at, last2 = sweep.pivot(rows, 150).splitlines(), sweep.pivot(rows).splitlines()
    assert at[2] == "| 0 | 0.00 | 0.550 |" and at[3] == "| 32 | 16.00 | 0.300 |"
    # the last two evaluations: the fresh run's at 250 samples on average, the stale run's at 75
    assert last2[2] == "| 0 | 0.00 | 250 | 0.750 |" and last2[3] == "| 32 | 16.00 | 75 | 0.350 |"
