"""Off-policy corrections beside the paper's (loss.truncated_is, eq. 5), chosen by `trainer.correction`.

Each has loss.truncated_is's shape: log_ratio [B,T] (log ρ = log π/μ per token, no gradient; 0 off
the mask) and mask [B,T] bool (the completion tokens) -> (w [B,T], kept [B,T] bool). loss.policy_loss
then trains  −(1/N_seq) Σ kept · w · A · log π  (eq. 5 with w in place of min(c, ρ)), and logs for
whichever runs, by lag: the ESS of w (0 on dropped tokens), the fraction clamped (w at c) and masked
(dropped), and the KL of μ to π. Notation as in loss.py; s_i = exp(mean_t log ρ_it), the geometric
mean of sequence i's token ratios.

  tis         w_t = min(c, ρ_t)                                   PipelineRL eq. 5 (the default)
  seq_is      w_t = min(c, s_i) for every token of sequence i     GSPO's sequence ratio (Zheng et
              al. 2025, "Group Sequence Policy Optimization", eq. 7), truncated as eq. 5 truncates
  token_mask  w_t = ρ_t, kept only where low <= ρ_t <= high       IcePop / masked importance
              sampling (Ling Team 2025, "Every Step Evolves", Ring-1T report; "MIS")
  seq_mask    w_t = min(c, ρ_t), sequence i kept only where low <= s_i <= high   geometric-mean
              sequence masking (verl's and SkyRL's geometric rejection, AReaL's sequence mask)
  m2po        w_t = ρ_t; the tokens of largest (log ρ)² dropped until the kept tokens' mean
              (log ρ)² <= tau                                     M2PO (Zheng et al. 2025,
              "Prosperity before Collapse", AReaL's `m2_threshold`); here per micro-batch, not per
              batch: the trainer computes the loss a micro-batch at a time

Decoupled PPO (Hilton et al. 2022; AReaL) is left out: it separates the behaviour policy μ from a
proximal policy π_prox that a PPO clip keeps π near across several gradient steps on one batch. This
trainer takes one gradient step per batch, so π_prox = π at that step, the clip never engages, and
what remains, w = sg[π_prox/μ] truncated, is eq. 5 itself.
"""
import functools

import torch

import loss


def sequence_mean(x, mask):
    """[B,T] -> [B,1]: the mean of x over each row's mask (0 for an empty row)."""
    m = mask.to(x.dtype)
    return (x * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def sequence_is(log_ratio, mask, is_clamp):
    """GSPO's sequence ratio s_i, truncated at c, for every token of the sequence."""
    s = torch.exp(sequence_mean(log_ratio, mask))  # [B,1]
    return torch.clamp(s, max=is_clamp).expand_as(log_ratio), mask


def token_mask(log_ratio, mask, low, high):
    """IcePop: the raw ratio where it lies in [low, high]; the token dropped elsewhere."""
    ratio = torch.exp(log_ratio)
    return ratio, mask & (ratio >= low) & (ratio <= high)


def sequence_mask(log_ratio, mask, low, high, is_clamp):
    """Eq. 5's weights on the sequences whose geometric-mean ratio lies in [low, high]; the others
    dropped whole."""
    s = torch.exp(sequence_mean(log_ratio, mask))  # [B,1]
    keep = (s >= low) & (s <= high)  # [B,1]
    return torch.clamp(torch.exp(log_ratio), max=is_clamp), mask & keep


def m2po(log_ratio, mask, tau):
    """M2PO: drop the tokens of largest (log ρ)², largest first, until the mean over the kept ones
    is at most tau; the kept ones get the raw ratio."""
    m2 = torch.where(mask, log_ratio * log_ratio, 0.0).reshape(-1)  # [B·T]
    order = m2.argsort(descending=True)  # on-mask tokens first (off-mask are 0)
    n = int(mask.sum())
    # suffix sums: dropping the first k of `order` leaves sum suffix[k] over n - k tokens
    suffix = m2[order].flip(0).cumsum(0).flip(0)[:n]  # [n]
    left = torch.arange(n, 0, -1, dtype=m2.dtype, device=m2.device)  # [n]
    fine = (suffix <= tau * left).nonzero()
    k = int(fine[0]) if len(fine) else n  # the fewest dropped that satisfy the bound
    keep = torch.ones_like(m2, dtype=torch.bool)
    keep[order[:k]] = False
    return torch.exp(log_ratio), mask & keep.reshape(mask.shape)


def choose(tc):
    """trainer config -> the correction's function of (log_ratio, mask)."""
    return {"tis": functools.partial(loss.truncated_is, is_clamp=tc.is_clamp),
            "seq_is": functools.partial(sequence_is, is_clamp=tc.is_clamp),
            "token_mask": functools.partial(token_mask, low=tc.mask_low, high=tc.mask_high),
            "seq_mask": functools.partial(sequence_mask, low=tc.mask_low, high=tc.mask_high,
                                          is_clamp=tc.is_clamp),
            "m2po": functools.partial(m2po, tau=tc.m2po_tau)}[tc.correction]
