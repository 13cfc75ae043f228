"""The PipelineRL objective (arXiv 2509.19128) as pure torch functions: advantages, loss, diagnostics.

Notation (shapes: B sequences, T completion tokens, V vocab):
  π(y_t)   current policy: softmax(logits / temperature), the temperature the actor sampled with
  μ(y_t)   behaviour policy: the logprob the actor recorded when it sampled y_t (`old_logprobs`)
  A_i      advantage of sequence i, broadcast to its tokens; m_it the completion-token mask
  c        IS truncation (`is_clamp`, 5 in the paper);  sg[.] stop-gradient
  N_seq    `num_sequences`: sequences in the whole optimizer step (all micro-batches, all ranks)

  (1) A_i   = r_i − mean_{j in group(i)} r_j              [÷ (std_group + eps), off by default]
  (2) log π(y_t) = logits_t[y_t]/temperature − logsumexp(logits_t/temperature)
  (3) H_t   = −Σ_v π(v) log π(v)                          (entropy, a diagnostic only)
  (4) w_it  = min(c, sg[π(y_it) / μ(y_it)])               truncated importance weight
  (5) L     = −(1/N_seq) Σ_i Σ_t m_it · w_it · A_i · log π(y_it)      paper eq. 5
  (6) ESS   = (Σ w)² / (N_tok Σ w²)  over all N_tok masked tokens of a step, w from (4)   paper eq. 6
  (7) KL(μ‖π) ≈ Σ_t k3,  k3 = ρ − 1 − log ρ  with ρ = π/μ (unclamped), y_t ~ μ   (Schulman's k3)

Dividing by N_seq (not by tokens, not per micro-batch) makes (5) additive: the trainer sums the
losses and gradients of its micro-batches and ranks (no averaging) and gets the step's loss.
For the same reason every statistic `policy_loss` returns is a SUM, combined at the end by `ess` etc.
"""
import torch

# Token-lag buckets for the diagnostics by lag (paper Fig. 7): bucket i = [edge_i, edge_{i+1}).
LAG_BUCKET_EDGES = [0, 1, 2, 3, 5, 9]
LAG_BUCKET_LABELS = ["0", "1", "2", "3-4", "5-8", ">8"]


def group_advantages(rewards, group_size, normalize_std=False, eps=1e-6):
    """(1) rewards [N] (tensor, numpy array or list), laid out group after group -> float32 tensor [N].

    Std normalisation (GRPO) is off by default, as in the paper's released code; it uses the
    population std (ddof=0), so a group of one gives 0 rather than NaN.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)  # [N]
    n = rewards.numel()
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"group_advantages: {n} rewards do not split into groups of group_size={group_size}")
    grouped = rewards.view(-1, group_size)  # [N/group_size, group_size]
    advantages = grouped - grouped.mean(dim=1, keepdim=True)  # (1) [N/group_size, group_size]
    if normalize_std:
        advantages = advantages / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)  # (1)
    return advantages.reshape(-1)  # [N]


def token_logprobs(logits, tokens, temperature):
    """(2) logits [B,T,V], tokens [B,T] (long) -> log π(tokens) [B,T] float32, differentiable.

    Memory: log_softmax would materialise a full [B,T,V] output to keep B·T entries of it. Here the
    only [B,T,V] tensor autograd keeps is `scaled` (saved by logsumexp); when the logits are already
    float32 and temperature is 1 that is the logits themselves, no copy. We upcast bf16 logits to
    float32 (one [B,T,V] copy) because a bf16 logsumexp is off by ~1e-2 nats, an error that goes
    straight into the IS ratio (4). Very large B·T·V still needs chunking over T by the caller.
    """
    scaled = logits.float()  # [B,T,V]
    if temperature != 1.0:
        scaled = scaled / temperature  # [B,T,V] (2) the actor sampled from softmax(logits/temperature)
    picked = scaled.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [B,T]
    return picked - torch.logsumexp(scaled, dim=-1)  # (2) [B,T]


def entropy_from_logits(logits, temperature):
    """(3) logits [B,T,V] -> entropy of softmax(logits/temperature) [B,T]; callers may use no_grad."""
    scaled = logits.float() / temperature  # [B,T,V]
    logp = torch.log_softmax(scaled, dim=-1)  # [B,T,V]
    return -(logp.exp() * logp).sum(dim=-1)  # (3) [B,T]


def lag_bucket_index(lag):
    """lag [B,T] long -> bucket index [B,T] long into LAG_BUCKET_LABELS; the last bucket is open-ended.

    A negative lag (impossible unless versions are mislabelled) lands in bucket "0".
    """
    inner_edges = torch.tensor(LAG_BUCKET_EDGES[1:], dtype=lag.dtype, device=lag.device)  # [K-1]
    return torch.bucketize(lag, inner_edges, right=True)  # [B,T]: i such that edge_i <= lag < edge_{i+1}


def policy_loss(logprobs, old_logprobs, advantages, mask, num_sequences, is_clamp=5.0, entropy=None, lags=None):
    """(4)-(5) truncated-IS REINFORCE. Returns (loss, stats).

    logprobs [B,T] (π, with grad), old_logprobs [B,T] (μ), advantages [B], mask [B,T] (bool or 0/1).
    num_sequences: sequences in the whole optimizer step, counted over all micro-batches and all
    ranks (STYLE rule 6) -- so per-micro-batch losses and gradients add up to the step's.
    entropy [B,T] (optional) adds `entropy_sum`; lags [B,T] long (optional) adds per-bucket sums.

    stats: detached 0-dim float64 tensors (1-D of length len(LAG_BUCKET_LABELS) for `bucket_*`), all
    SUMS over masked tokens, so they add across micro-batches and ranks without a host sync here
    (float64 because token counts of a large step pass float32's exact-integer range, 2^24):
      tokens, ratio_sum, ratio_sq_sum (of w from (4), i.e. AFTER the clamp: the weights the loss
      used, which is what ESS (6) measures), clamped_tokens (raw ratio > is_clamp), logprob_sum,
      old_logprob_sum, kl_sum (7), [entropy_sum], [bucket_tokens, bucket_ratio_sum,
      bucket_ratio_sq_sum, bucket_kl_sum, bucket_clamped].
    Masked tokens may hold any finite values: they touch neither the loss, its gradient nor the stats.
    """
    m = mask.bool()  # [B,T]
    log_ratio = torch.where(m, logprobs.detach() - old_logprobs, 0.0)  # [B,T] log π/μ; 0 off-mask
    ratio = torch.exp(log_ratio)  # [B,T] (4) raw IS ratio π/μ, no gradient (sg)
    weight = torch.clamp(ratio, max=is_clamp)  # [B,T] (4) truncated IS weight
    per_token = torch.where(m, weight * advantages[:, None] * logprobs, 0.0)  # [B,T] (5) summand
    loss = -per_token.sum() / num_sequences  # (5) normalised by the step's sequence count, not tokens

    with torch.no_grad():
        f64 = torch.float64
        clamped = ratio > is_clamp  # [B,T] (4) the truncation engaged; never off-mask (ratio = 1)
        kl = ratio - 1.0 - log_ratio  # [B,T] (7) k3, 0 off-mask since ratio = 1 there

        def msum(x):  # sum over masked tokens, in float64
            return torch.where(m, x.to(f64), 0.0).sum()

        stats = {
            "tokens": m.to(f64).sum(),
            "ratio_sum": msum(weight),  # (6) Σ w, w after the clamp
            "ratio_sq_sum": msum(weight * weight),  # (6) Σ w²
            "clamped_tokens": msum(clamped),
            "logprob_sum": msum(logprobs.detach()),
            "old_logprob_sum": msum(old_logprobs),
            "kl_sum": msum(kl),  # (7)
        }
        if entropy is not None:
            stats["entropy_sum"] = msum(entropy.detach())
        if lags is not None:
            bucket = lag_bucket_index(lags).reshape(-1)  # [B·T]
            k = len(LAG_BUCKET_LABELS)

            def bsum(x):  # per-bucket sum over masked tokens; scatter_add avoids a host sync
                vals = torch.where(m, x.to(f64), 0.0).reshape(-1)  # [B·T]
                return torch.zeros(k, dtype=f64, device=vals.device).scatter_add_(0, bucket, vals)  # [K]

            stats["bucket_tokens"] = bsum(torch.ones_like(weight))
            stats["bucket_ratio_sum"] = bsum(weight)
            stats["bucket_ratio_sq_sum"] = bsum(weight * weight)
            stats["bucket_kl_sum"] = bsum(kl)
            stats["bucket_clamped"] = bsum(clamped)
    return loss, stats


def ess(ratio_sum, ratio_sq_sum, tokens):
    """(6) ESS = (Σw)² / (N Σw²) in (0, 1] from summed stats (floats or 0-dim tensors) -> float.

    Returns 1.0 when there are no tokens or Σw² = 0 (nothing was off-policy that we could measure).
    """
    ratio_sum, ratio_sq_sum, tokens = float(ratio_sum), float(ratio_sq_sum), float(tokens)
    if tokens == 0 or ratio_sq_sum == 0:
        return 1.0
    return ratio_sum * ratio_sum / (tokens * ratio_sq_sum)  # (6)
