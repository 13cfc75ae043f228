"""The PipelineRL objective (arXiv 2509.19128) as pure torch functions: advantages, loss,
diagnostics.

Notation (shapes: B sequences, T completion tokens, V vocab):
  π(y_t)   current policy: softmax(logits / temperature), the temperature the actor sampled with
  μ(y_t)   behaviour policy: the logprob the actor recorded when it sampled y_t (`old_logprobs`)
  A_i      advantage of sequence i, broadcast to its tokens; m_it the completion-token mask
  c        IS truncation (`is_clamp`, 5 in the paper);  sg[.] stop-gradient
  N_seq    `num_sequences`: sequences in the whole optimizer step (all micro-batches, all ranks)

  (1) A_i   = r_i − mean_{j in group(i)} r_j
            (no ÷ std_group: the paper's code; GRPO's is a fork)
  (2) log π(y_t) = z_t[y_t] − logsumexp_{v in K_t} z_t[v],  z_t = logits_t / temperature,
      K_t the kept tokens: all, or with top-p the nucleus as vLLM's sampler cuts it (the actor's μ
      is renormalised over it)
  (3) H_t   = −Σ_{v in K_t} π(v) log π(v)                 (entropy, a diagnostic only)
  (4) w_it  = min(c, sg[π(y_it) / μ(y_it)])               truncated importance weight
  (5) L     = −(1/N_seq) Σ_i Σ_t m_it · w_it · A_i · log π(y_it)      paper eq. 5
  (6) ESS   = (Σ w)² / (N_tok Σ w²)  over all N_tok masked tokens of a step, w from (4)
            paper eq. 6
  (7) KL(μ‖π) ≈ Σ_t k3,  k3 = ρ − 1 − log ρ  with ρ = π/μ (unclamped), y_t ~ μ
            (Schulman's k3)

Other corrections than (4) (corrections.py, `trainer.correction`) replace w_it, and may drop
tokens from (5): their weight is 0 there; they count in N_tok of (6) and in the KL, not in (5).

Dividing by N_seq (not tokens, not per micro-batch) makes (5) additive: the trainer sums the losses,
gradients and statistics (all SUMS) of its micro-batches and ranks. (2), (3) run in float32: a bf16
logsumexp's error goes straight into (4) (docs/RESULTS.md, "Figures behind the code's comments").
"""
import functools

import torch

# Token-lag buckets for the diagnostics by lag (paper Fig. 7): bucket i = [edge_i, edge_{i+1}).
LAG_BUCKET_EDGES = [0, 1, 2, 3, 5, 9]
LAG_BUCKET_LABELS = ["0", "1", "2", "3-4", "5-8", ">8"]

def group_advantages(rewards, group_size):
    """(1) rewards [N] (tensor, numpy array or list), laid out group after group -> float32
    tensor [N]."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)  # [N]
    n = rewards.numel()
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"group_advantages: {n} rewards do not split into groups of "
                         f"group_size={group_size}")
    grouped = rewards.view(-1, group_size)  # [N/group_size, group_size]
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)  # (1) [N]

def nucleus_mask(scaled, top_p):
    """(2) scaled logits [N,V] (already ÷ temperature) -> bool [N,V], True inside the top-p nucleus
    by vLLM 0.32's rule (`apply_top_k_top_p_pytorch`): sort ascending, drop each token whose
    cumulative probability (itself included) is <= 1 - top_p, never the most likely. μ is
    renormalised over it, so π must be
    (docs/DESIGN.md, "Nucleus sampling and the behaviour logprobs")."""
    sorted_z, order = scaled.sort(dim=-1)  # [N,V] ascending
    drop_sorted = sorted_z.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p  # [N,V]
    drop_sorted[:, -1] = False  # at least one token
    # [N,V] back in vocab order
    return ~torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)

def _scaled(hidden, weight, targets, temperature, top_p):
    """-> logits / temperature [n,V] in float32 (-inf outside the nucleus) and the kept mask [n,V].
    The sampled token is always kept: one an older μ sampled can fall outside π's nucleus, where
    log π would be -inf."""
    z = (hidden @ weight.t()).float() / temperature  # [n,V] (2) in float32
    keep = torch.ones_like(z, dtype=torch.bool)  # [n,V]
    if top_p < 1.0:
        keep = nucleus_mask(z, top_p).scatter_(-1, targets[:, None], True)  # [n,V]
        z = z.masked_fill(~keep, float("-inf"))  # [n,V]
    return z, keep

class _CompletionLogprobs(torch.autograd.Function):
    """(2), (3) a chunk of positions at a time, with no [N,V] tensor alive in forward or backward:
    backward recomputes each chunk's logits from the saved hidden states and per-position
    logsumexp, for the exact gradient of (2):
    d log π(y)/dz_v = ([v = y] - π(v)) / temperature over the kept tokens."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, top_p, chunk):
        logprobs = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)  # [N]
        entropy = torch.empty_like(logprobs)  # [N]
        lse = torch.empty_like(logprobs)  # [N] logsumexp of each position's kept scaled logits
        # n = chunk positions at a time
        for s in (slice(lo, lo + chunk) for lo in range(0, len(targets), chunk)):
            z, keep = _scaled(hidden[s], weight, targets[s], temperature, top_p)  # [n,V]
            lse[s] = torch.logsumexp(z, dim=-1)  # [n]
            logp = z - lse[s, None]  # [n,V] (2) over the kept tokens, -inf elsewhere
            logprobs[s] = logp.gather(-1, targets[s, None]).squeeze(-1)  # [n]
            entropy[s] = -torch.where(keep, logp.exp() * logp, 0.0).sum(-1)  # [n] (3)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.top_p, ctx.chunk = temperature, top_p, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):  # [N], entropy is a diagnostic only
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)  # [N,D]
        # [V,D] accumulated over chunks in fp32
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        for s in (slice(lo, lo + ctx.chunk) for lo in range(0, len(targets), ctx.chunk)):
            y, g = targets[s], grad_logprobs[s]  # [n] each
            z, _ = _scaled(hidden[s], weight, y, ctx.temperature, ctx.top_p)  # [n,V] recomputed
            dz = -(z - lse[s, None]).exp() * g[:, None]  # [n,V] -π(v)·g (0 where dropped)
            dz.scatter_add_(-1, y[:, None], g[:, None])  # [n,V] + [v = y]·g
            dz = (dz / ctx.temperature).to(weight.dtype)  # [n,V] through z = logits / temperature
            grad_hidden[s] = dz @ weight  # [n,D]
            grad_weight += (dz.t() @ hidden[s]).float()  # [V,D]
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None

def completion_logprobs(hidden, weight, targets, temperature, top_p=1.0, chunk=1024):
    """(2), (3) at completion positions only: hidden [N,D] (the final hidden states that predict
    each completion token), lm_head weight [V,D], targets [N] -> log π [N] (differentiable) and
    entropy [N]. Peak memory is that of `chunk` x V logits, not N x V (chunk <= 0: all N at
    once)."""
    chunk = chunk if chunk > 0 else max(len(targets), 1)
    return _CompletionLogprobs.apply(hidden, weight, targets.long(), float(temperature),
                                     float(top_p), chunk)

def lag_bucket_index(lag):
    """lag [B,T] long -> bucket index [B,T] into LAG_BUCKET_LABELS (last open-ended; a negative
    lag: "0")."""
    inner_edges = torch.tensor(LAG_BUCKET_EDGES[1:], dtype=lag.dtype, device=lag.device)  # [K-1]
    # [B,T]: i such that edge_i <= lag < edge_{i+1}
    return torch.bucketize(lag, inner_edges, right=True)

def truncated_is(log_ratio, mask, is_clamp=5.0):
    """(4) the token weights of eq. 5: log_ratio [B,T] (log π/μ, no gradient), mask [B,T] bool ->
    w [B,T] = min(c, π/μ), and every token kept (mask unchanged). The other corrections have this
    shape (corrections.py)."""
    return torch.clamp(torch.exp(log_ratio), max=is_clamp), mask

def policy_loss(logprobs, old_logprobs, advantages, mask, num_sequences, is_clamp=5.0, entropy=None,
                lags=None, correction=None):
    """(4)-(5) truncated-IS REINFORCE -> (loss, stats). logprobs [B,T] (π, with grad),
    old_logprobs [B,T] (μ), advantages [B], mask [B,T] (bool or 0/1; masked tokens may hold any
    finite values), num_sequences N_seq of (5); entropy [B,T] adds `entropy_sum`, lags [B,T] long
    the `bucket_*` sums ([len(LAG_BUCKET_LABELS)] each); correction: (log_ratio, mask) -> (w,
    kept) in place of (4) (corrections.choose; None: (4) with is_clamp). stats: detached float64
    SUMS that add across micro-batches and ranks with no host sync (float64: a step's token count
    can pass float32's exact integers, 2^24)."""
    m = mask.bool()  # [B,T]
    log_ratio = torch.where(m, logprobs.detach() - old_logprobs, 0.0)  # [B,T] log π/μ; 0 off-mask
    ratio = torch.exp(log_ratio)  # [B,T] (4) raw IS ratio π/μ, no gradient (sg)
    correction = correction or functools.partial(truncated_is, is_clamp=is_clamp)
    weight, kept = correction(log_ratio, m)  # [B,T] each: (4), or another correction's
    weight = torch.where(kept, weight, 0.0)  # [B,T] (4) truncated IS weight; 0 where dropped
    per_token = torch.where(kept, weight * advantages[:, None] * logprobs, 0.0)  # [B,T] (5) summand
    # ÷ N_seq: the step's sequences over all micro-batches and ranks
    loss = -per_token.sum() / num_sequences  # (5)

    with torch.no_grad():
        # [B,T] each. ratio_sum, ratio_sq_sum: Σ w, Σ w² of (6); clamped_tokens: the truncation
        # engaged (w at c), masked_tokens: dropped by the correction, neither ever off-mask;
        # kl_sum: 0 off-mask (ratio = 1 there).
        summands = {"tokens": m, "ratio_sum": weight, "ratio_sq_sum": weight * weight,  # (6)
                    "clamped_tokens": kept & (weight >= is_clamp), "masked_tokens": m & ~kept,
                    "logprob_sum": logprobs.detach(), "old_logprob_sum": old_logprobs,
                    "kl_sum": ratio - 1.0 - log_ratio}  # (7) k3
        if entropy is not None:
            summands["entropy_sum"] = entropy.detach()  # (3)
        # [B,T] each, in float64 and 0 off-mask
        summands = {k: torch.where(m, x.to(torch.float64), 0.0) for k, x in summands.items()}
        stats = {k: x.sum() for k, x in summands.items()}
        if lags is not None:  # per lag bucket; scatter_add avoids a host sync
            bucket = lag_bucket_index(lags).reshape(-1)  # [B·T]
            for name, k in (("bucket_tokens", "tokens"), ("bucket_ratio_sum", "ratio_sum"),
                            ("bucket_ratio_sq_sum", "ratio_sq_sum"), ("bucket_kl_sum", "kl_sum"),
                            ("bucket_clamped", "clamped_tokens"),
                            ("bucket_masked", "masked_tokens")):
                flat = summands[k].reshape(-1)  # [B·T]
                # [K] one sum per lag bucket
                stats[name] = flat.new_zeros(len(LAG_BUCKET_LABELS)).scatter_add_(0, bucket, flat)
    return loss, stats

def ess(ratio_sum, ratio_sq_sum, tokens):
    """(6) ESS = (Σw)² / (N Σw²) in (0, 1] from summed stats (floats or 0-dim tensors) -> float;
    1.0 when there are no tokens or Σw² = 0 (nothing was off-policy that we could measure). At
    most 1 (Cauchy-Schwarz), clipped so: with all w = 1 the sums' rounding can land just above 1."""
    w, w2, n = float(ratio_sum), float(ratio_sq_sum), float(tokens)  # Σw, Σw², N
    return min(1.0, w * w / (n * w2)) if n and w2 else 1.0  # (6)
