# Tier (a): the math of loss.py on hand-worked examples (CPU, < 5 s).
# Run: bash run.sh test tests/test_loss.py    or    .venv/bin/python -m pytest tests/test_loss.py
import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loss as L  # noqa: E402

torch.set_num_threads(1)


def logp(logits, tokens, temperature):
    """(2) on full logits [B,T,V] -> [B,T]: the plain definition the tests compare against."""
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None])[..., 0]


# --- (1) advantages -------------------------------------------------------------------------------
def test_group_advantages_hand_made():
    # group 1: mean 0.25 -> r - 0.25; group 2: all equal -> no signal, all zero.
    adv = L.group_advantages(torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([-0.25, 0.75, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))
    # numpy and list inputs give the same float32 tensor; group_size=2 splits differently.
    for rewards in (np.array([1, 0, 0, 0]), [1.0, 0.0, 0.0, 0.0]):
        torch.testing.assert_close(L.group_advantages(rewards, 2), torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_group_advantages_no_std_division():
    rewards = [0.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    # plain r - mean (the paper's code): a GRPO std division would give -0.25/0.433 = -0.577; all-equal stays 0
    torch.testing.assert_close(L.group_advantages(rewards, 4), torch.tensor([-0.25, -0.25, -0.25, 0.75] + [0.0] * 4))


def test_group_advantages_bad_n_raises():
    with pytest.raises(ValueError, match=r"7.*group_size=3"):
        L.group_advantages(torch.zeros(7), 3)


# --- (4)-(5) the loss on a hand-worked example ----------------------------------------------------
def hand_example():
    # B=2, T=3. Row 1's last token is padding (mask 0). c = 5.
    # ratios rho = pi/mu = [[1, 2, 10], [0.5, 1, -]] -> w = min(5, rho) = [[1, 2, 5], [0.5, 1, 0]]
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -7.0]], requires_grad=True)
    log_rho = torch.tensor([[0.0, math.log(2), math.log(10)], [math.log(0.5), 0.0, 0.0]])
    old_logprobs = logprobs.detach() - log_rho
    advantages = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logprobs, old_logprobs, advantages, mask


def test_policy_loss_hand_worked_value_grad_and_stats():
    logprobs, old_logprobs, advantages, mask = hand_example()
    lags = torch.tensor([[0, 1, 4], [9, 0, 3]])
    loss, st = L.policy_loss(logprobs, old_logprobs, advantages, mask, num_sequences=2, is_clamp=5.0, lags=lags)
    # L = -(1/2) [ 1*(1*-1 + 2*-2 + 5*-0.5) + (-0.5)*(0.5*-3 + 1*-1) ] = -(1/2) [-7.5 + 1.25] = 3.125
    assert loss.item() == pytest.approx(3.125, abs=1e-6)
    # dL/dlogprobs = -(1/2) w A m (w has no gradient):
    #   row 0: -(1/2)*[1, 2, 5]*1 = [-0.5, -1, -2.5];  row 1: -(1/2)*[0.5, 1, 0]*(-0.5) = [0.125, 0.25, 0]
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -1.0, -2.5], [0.125, 0.25, 0.0]]))
    # sums over the 5 masked tokens; w after the clamp
    assert st["tokens"].item() == 5
    assert st["ratio_sum"].item() == pytest.approx(1 + 2 + 5 + 0.5 + 1, abs=1e-5)  # 9.5
    assert st["ratio_sq_sum"].item() == pytest.approx(1 + 4 + 25 + 0.25 + 1, abs=1e-4)  # 31.25
    assert st["clamped_tokens"].item() == 1
    assert st["logprob_sum"].item() == pytest.approx(-7.5, abs=1e-6)
    assert st["old_logprob_sum"].item() == pytest.approx(-7.5 - math.log(10), abs=1e-5)
    # k3 = rho - 1 - log rho: 0 + (1 - ln2) + (9 - ln10) + (-0.5 + ln2) + 0 = 9.5 - ln10
    assert st["kl_sum"].item() == pytest.approx(9.5 - math.log(10), abs=1e-5)
    # ESS = 9.5^2 / (5 * 31.25) = 0.5776
    assert L.ess(st["ratio_sum"], st["ratio_sq_sum"], st["tokens"]) == pytest.approx(0.5776, abs=1e-5)
    assert "entropy_sum" not in st
    assert all(not v.requires_grad and v.dtype == torch.float64 for v in st.values())
    # lags [[0,1,4],[9,0,-]] -> buckets "0","1","3-4" | ">8","0"
    torch.testing.assert_close(st["bucket_tokens"], torch.tensor([2.0, 1, 0, 1, 0, 1], dtype=torch.float64))
    torch.testing.assert_close(st["bucket_ratio_sum"], torch.tensor([2.0, 2, 0, 5, 0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(st["bucket_clamped"], torch.tensor([0.0, 0, 0, 1, 0, 0], dtype=torch.float64))


@pytest.mark.parametrize("log_rho_offset, clamped", [(-1e-3, False), (1e-3, True)])
def test_clamp_engages_exactly_above_is_clamp(log_rho_offset, clamped):
    c = 5.0
    rho = math.exp(math.log(c) + log_rho_offset)
    logprobs = torch.tensor([[-2.0]], dtype=torch.float64, requires_grad=True)
    old = logprobs.detach() - math.log(rho)
    loss, st = L.policy_loss(logprobs, old, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 1), 1, is_clamp=c)
    loss.backward()
    w = c if clamped else rho  # dL/dlogprob = -w * A
    assert logprobs.grad.item() == pytest.approx(-w * 2.0, rel=1e-9)
    assert st["clamped_tokens"].item() == int(clamped)
    assert st["ratio_sum"].item() == pytest.approx(w, rel=1e-9)


def test_masked_tokens_contribute_nothing():
    logprobs, old_logprobs, advantages, mask = hand_example()
    loss1, st1 = L.policy_loss(logprobs, old_logprobs, advantages, mask, 2)
    (g1,) = torch.autograd.grad(loss1, logprobs)
    # change the padding token's logprob and behaviour logprob (a huge ratio there)
    logprobs2 = logprobs.detach().clone()
    logprobs2[1, 2] = -0.01
    logprobs2.requires_grad_(True)
    old2 = old_logprobs.clone()
    old2[1, 2] = -50.0
    loss2, st2 = L.policy_loss(logprobs2, old2, advantages, mask, 2)
    (g2,) = torch.autograd.grad(loss2, logprobs2)
    assert loss2.item() == loss1.item()
    torch.testing.assert_close(g2, g1, rtol=0, atol=0)
    for k in st1:
        assert st1[k].item() == st2[k].item(), k


# --- on-policy == REINFORCE ----------------------------------------------------------------------
def test_on_policy_gradient_is_plain_reinforce():
    g = torch.Generator().manual_seed(0)
    B, T, V = 4, 5, 7
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    tokens = torch.randint(V, (B, T), generator=g)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 4 + [0], [1] * 1 + [0] * 4])
    advantages = torch.tensor([0.5, -0.25, 1.0, -1.25])
    logprobs = logp(logits, tokens, 1.0)
    loss, st = L.policy_loss(logprobs, logprobs.detach(), advantages, mask, num_sequences=B)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    reinforce = -(advantages[:, None] * logprobs * mask).sum() / B  # -(1/B) sum_i A_i sum_t log pi
    (expected,) = torch.autograd.grad(reinforce, logits)
    torch.testing.assert_close(grad, expected)
    assert grad.abs().sum() > 0
    assert L.ess(st["ratio_sum"], st["ratio_sq_sum"], st["tokens"]) == 1.0
    assert st["kl_sum"].item() == 0.0 and st["clamped_tokens"].item() == 0


# --- micro-batch invariance -----------------------------------------------------------------------
def test_micro_batch_split_invariance():
    g = torch.Generator().manual_seed(1)
    B, T, V = 8, 6, 11
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(V, (B, T), generator=g)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 3])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B,T]
    # behaviour logprobs off by up to ~±2 nats so that some tokens clamp
    old_logprobs = logp(logits, tokens, 0.7) + 2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64)
    lags = torch.randint(0, 12, (B, T), generator=g)
    num_sequences = B  # sequences in the whole step, whatever the split

    def run(split):
        leaf = logits.clone().requires_grad_(True)
        total, stats = 0.0, {}
        for idx in torch.arange(B).split(split):
            t_mb = int(lengths[idx].max())  # each micro-batch padded only to its own longest sequence
            lp = logp(leaf[idx, :t_mb], tokens[idx, :t_mb], 0.7)
            loss, st = L.policy_loss(lp, old_logprobs[idx, :t_mb], advantages[idx], mask[idx, :t_mb],
                                     num_sequences, entropy=entropy[idx, :t_mb], lags=lags[idx, :t_mb])
            loss.backward()
            total += loss.item()
            stats = {k: stats.get(k, 0) + v for k, v in st.items()}
        return total, leaf.grad, stats

    ref_loss, ref_grad, ref_st = run(8)
    assert ref_st["clamped_tokens"].item() > 0  # the clamp is exercised
    for split in (1, 4):
        loss, grad, st = run(split)
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
        for k in ref_st:
            torch.testing.assert_close(st[k], ref_st[k], rtol=0, atol=1e-6)
        assert L.ess(st["ratio_sum"], st["ratio_sq_sum"], st["tokens"]) == pytest.approx(
            L.ess(ref_st["ratio_sum"], ref_st["ratio_sq_sum"], ref_st["tokens"]), abs=1e-6)


# --- (6) ESS --------------------------------------------------------------------------------------
def test_ess_matches_direct_computation():
    g = torch.Generator().manual_seed(2)
    w = torch.rand(3, 10, generator=g, dtype=torch.float64) * 3 + 0.01  # weights in (0.01, 3.01), below c
    logprobs = -torch.rand(3, 10, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[2, 6:] = False
    _, st = L.policy_loss(logprobs, logprobs - w.log(), torch.ones(3, dtype=torch.float64), mask, 3)
    wm = w[mask]
    direct = (wm.sum() ** 2 / (wm.numel() * (wm**2).sum())).item()
    assert L.ess(st["ratio_sum"], st["ratio_sq_sum"], st["tokens"]) == pytest.approx(direct, rel=1e-9)
    assert direct < 0.95  # random weights: clearly off-policy
    assert L.ess(0.0, 0.0, 0) == 1.0 and L.ess(0.0, 0.0, 5) == 1.0


def test_ess_is_at_most_one_when_rounding_would_lift_it():
    """All w = 1 in fp32, summed over many tokens: Σw and Σw² round apart (a CI run logged ESS
    1.000000004 at lag 0). ESS <= 1 exactly, as (6) promises."""
    w = torch.ones(1000, dtype=torch.float32) * (1 + 1e-7)
    assert (w.sum().double() ** 2 / (1000 * (w**2).sum().double())).item() > 1  # rounding lifts it
    assert L.ess(w.sum(), (w**2).sum(), 1000) == 1.0
    assert L.ess(3.0000001, 3.0, 3) == 1.0


# --- (2)-(3) logprobs and entropy ---------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_match_categorical(temperature):
    """(2), (3) and d(2)/d(hidden, weight) == torch.distributions on the full logits."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(8, 5, generator=g), torch.randn(9, 5, generator=g) * 2  # [N,D], [V,D]
    tokens, up = torch.randint(9, (8,), generator=g), torch.randn(8, generator=g)  # [N], upstream gradient
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ours, ent = L.completion_logprobs(h1, w1, tokens, temperature, chunk=3)
    dist = torch.distributions.Categorical(logits=(h2 @ w2.t()) / temperature)
    torch.testing.assert_close(ours, dist.log_prob(tokens))
    torch.testing.assert_close(ent, dist.entropy().detach())
    (ours * up).sum().backward()
    (dist.log_prob(tokens) * up).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


def test_completion_logprobs_bf16_computed_in_float32():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    weight = (torch.randn(300, 32, generator=g) * 0.7).to(torch.bfloat16)
    tokens = torch.randint(300, (16,), generator=g)
    ours, _ = L.completion_logprobs(hidden, weight, tokens, 0.7)
    ref = torch.distributions.Categorical(logits=(hidden @ weight.t()).float() / 0.7).log_prob(tokens)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)  # a bf16 logsumexp is off by ~1e-2


def test_entropy_sum_in_stats():
    logprobs, old_logprobs, advantages, mask = hand_example()
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    _, st = L.policy_loss(logprobs, old_logprobs, advantages, mask, 2, entropy=entropy)
    assert st["entropy_sum"].item() == pytest.approx(15.0)  # the padding token's 100 is excluded


# --- lag buckets (paper Fig. 7) -------------------------------------------------------------------
def test_lag_bucket_index_hand_made():
    lags = torch.tensor([[0, 1, 2, 3, 4, 5], [8, 9, 10, 1000, 2, 0]])
    expected = torch.tensor([[0, 1, 2, 3, 3, 4], [4, 5, 5, 5, 2, 0]])
    assert torch.equal(L.lag_bucket_index(lags), expected)
    assert len(L.LAG_BUCKET_LABELS) == len(L.LAG_BUCKET_EDGES)
    assert L.LAG_BUCKET_LABELS[3] == "3-4" and L.LAG_BUCKET_LABELS[-1] == ">8"


def test_bucket_sums_add_up_to_totals():
    g = torch.Generator().manual_seed(6)
    B, T = 5, 7
    logprobs = -torch.rand(B, T, generator=g) * 3
    old_logprobs = logprobs - 2.5 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    lags = torch.randint(0, 15, (B, T), generator=g)
    _, st = L.policy_loss(logprobs, old_logprobs, torch.randn(B, generator=g), mask, B, lags=lags)
    assert st["clamped_tokens"].item() > 0
    assert (st["bucket_tokens"] > 0).sum() >= 4  # several buckets are populated
    for bucket_key, total_key in [("bucket_tokens", "tokens"), ("bucket_ratio_sum", "ratio_sum"),
                                  ("bucket_ratio_sq_sum", "ratio_sq_sum"), ("bucket_kl_sum", "kl_sum"),
                                  ("bucket_clamped", "clamped_tokens")]:
        assert st[bucket_key].shape == (len(L.LAG_BUCKET_LABELS),)
        assert st[bucket_key].sum().item() == pytest.approx(st[total_key].item(), rel=1e-9, abs=1e-9), bucket_key
    # and the tokens land in the bucket of their own lag
    assert st["bucket_tokens"][5].item() == ((lags >= 9) & mask).sum().item()


# --- (2)-(3) at completion positions, chunked (no [N,V] logits alive at once) ---------------------------
@pytest.mark.parametrize("temperature,chunk", [(1.0, 5), (0.7, 3), (0.7, 0)])
def test_completion_logprobs_chunked_equal_unchunked(temperature, chunk):
    """Values and gradients (hidden and lm_head weight) equal the plain full-logits computation."""
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(11, 8, generator=g), torch.randn(17, 8, generator=g) * 0.7  # [N,D], [V,D]
    targets, up = torch.randint(17, (11,), generator=g), torch.randn(11, generator=g)  # [N]
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = L.completion_logprobs(h1, w1, targets, temperature, chunk=chunk)
    dist = torch.distributions.Categorical(logits=(h2 @ w2.t()) / temperature)  # the full [N,V] logits
    ref = dist.log_prob(targets)
    torch.testing.assert_close(lp, ref)
    torch.testing.assert_close(ent, dist.entropy().detach())
    (lp * up).sum().backward()
    (ref * up).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


def test_nucleus_mask_is_vllms_rule_and_renormalises():
    """top_p: the kept set is the smallest top set whose mass reaches top_p (vLLM's rule), π renormalises
    over it, and the gradient is that of log_softmax over the kept logits only."""
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))  # probabilities 0.5, 0.3, 0.15, 0.05
    assert L.nucleus_mask(z, 0.8).tolist() == [[True, True, False, False]]  # 0.5+0.3 reaches 0.8
    assert L.nucleus_mask(z, 0.81).tolist() == [[True, True, True, False]]
    assert L.nucleus_mask(z, 0.1).tolist() == [[True, False, False, False]]  # never empty
    hidden = torch.eye(4, requires_grad=True)  # hidden @ W.T = rows of W: position i sees logits z
    weight = z.t().repeat(1, 4).clone().requires_grad_(True)  # [V=4, D=4]
    lp, ent = L.completion_logprobs(hidden, weight, torch.tensor([0, 1, 0, 1]), 1.0, top_p=0.8, chunk=3)
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.625, 0.375, 0.625, 0.375])))  # 0.5/0.8, 0.3/0.8
    torch.testing.assert_close(ent, torch.full((4,), -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))))
    lp.sum().backward()
    ref_h = hidden.detach().clone().requires_grad_(True)
    ref = torch.log_softmax(ref_h @ weight.detach()[:2].t(), -1).gather(-1, torch.tensor([[0], [1], [0], [1]]))
    ref.sum().backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad)


def test_sampled_token_outside_the_nucleus_is_kept_finite():
    """An off-policy token outside π's nucleus: log π stays finite (the token joins the kept set)."""
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp, _ = L.completion_logprobs(torch.eye(4)[:1], z.t().repeat(1, 4), torch.tensor([3]), 1.0, top_p=0.8)
    assert torch.isfinite(lp).all() and lp.item() == pytest.approx(math.log(0.05 / 0.85), rel=1e-5)
