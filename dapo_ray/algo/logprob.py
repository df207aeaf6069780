"""Per-token log-probs (and entropy) from hidden states, one sequence chunk of logits at a time.

Why: the policy loss needs log pi(y_t | y_<t) for every response token (the ratio of Eq. 10), and the
monitoring of section 4 needs the entropy of the same distribution. Both come from full-vocabulary
logits. At a DAPO response length (T = 20480 + prompt, ~22.5k) and the Qwen2.5 vocabulary
(V = 152064), **one** fp32 [1, T, V] logits tensor is 22.5k x 152064 x 4 B = 13.7 GB, and the unchunked
path (`loss.token_logprobs` + `loss.entropy_from_logits`: upcast, divide by temperature, logsumexp,
log_softmax, exp) holds several of them at once; the backward pass holds more.

Here the output head runs on `chunk_size` positions at a time, so the peak is a few [B, chunk, V]
tensors instead (chunk 1024 at V = 152064: 0.62 GB each), whatever T is. With grad enabled each chunk is
wrapped in non-reentrant activation checkpointing: only the chunk's [B, chunk] log-probs are kept, and
its logits are recomputed (one more head matmul per chunk) during backward. Values equal the unchunked
`token_logprobs` / `entropy_from_logits` up to float rounding (tested to 1e-5 in float32), and so do the
gradients into the hidden states and the head's parameters.

Measured (`bench/logprob_memory.py`, CPU float32, B = 1, T = 2048, H = 896, V = 152064, chunk 1024), peak
memory above the inputs: old-log-prob pass 4,782 MiB (4.0 logits tensors) -> 1,812 MiB, update pass
(forward + backward) 4,782 -> 2,943 MiB; at T = 8192 the chunked figures stay 1,812 and 2,996 MiB. The
cost: one more head matmul per chunk in backward, and up to two extra transient copies of the head's
weight gradient ([V, H]), because autograd sums the per-chunk gradients of a parameter out of place.

The head is called as a module (`head(h_BtH)`), never through `head.weight`: under DeepSpeed ZeRO-3 the
weight is partitioned and only its forward hooks gather it, in the forward and again in the recompute.

Typical use in a trainer (hidden states at positions 0..T-2 predict tokens 1..T-1):

    hidden_BTH = model.get_decoder()(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state[:, :-1]
    logp_BT, ent_BT = chunked_token_logprobs(
        hidden_BTH, model.get_output_embeddings(), ids_BT[:, 1:], temperature=1.0, with_entropy=True
    )
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def _scaled_logits(head: Callable[[torch.Tensor], torch.Tensor], h_BtH: torch.Tensor, temperature: float):
    # A [:, s:e] slice of a B > 1 batch is strided; CPU bf16 linear then takes a batched-matmul kernel
    # that rounds differently from the contiguous GEMM of the full tensor (logits off by one bf16 ulp).
    # The copy is [B, t, H], small beside the [B, t, V] logits, and made inside the checkpoint so it is
    # not kept for backward.
    logits_BtV = head(h_BtH.contiguous()).float()
    # x / 1.0 == x exactly, so skipping it changes no value and saves one [B, t, V] copy.
    return logits_BtV if temperature == 1.0 else logits_BtV / temperature


def _entropy(logits_BtV: torch.Tensor) -> torch.Tensor:
    # The same arithmetic as loss.entropy_from_logits, -sum_v p_v log p_v, minus one full-size temporary
    # (the product is taken in place). logsumexp(x) - sum_v p_v x_v would need only softmax, but its
    # cancellation costs ~5x the float32 error (2e-5 vs 4e-6 at V = 20000, logits of std 3).
    with torch.no_grad():
        logp_BtV = torch.log_softmax(logits_BtV, dim=-1)
        return -logp_BtV.exp().mul_(logp_BtV).sum(-1)


def _chunk(
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    with_entropy: bool,
    h_BtH: torch.Tensor,
    tok_Bt: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits_BtV = _scaled_logits(head, h_BtH, temperature)
    picked_Bt = logits_BtV.gather(-1, tok_Bt.unsqueeze(-1)).squeeze(-1)
    logp_Bt = picked_Bt - torch.logsumexp(logits_BtV, dim=-1)
    # Entropy comes last: in the backward recompute, checkpoint's early stop ends the function once the
    # tensors saved for logp_Bt are rebuilt, so the entropy is not computed a second time.
    ent_Bt = _entropy(logits_BtV) if with_entropy else None
    return logp_Bt, ent_Bt


def chunked_token_logprobs(
    hidden_BTH: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    tokens_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(tokens_BT[b, t] | prefix) from the hidden state that predicts it, `chunk_size` positions at a time.

    `hidden_BTH` is already shifted: `hidden_BTH[:, t]` predicts `tokens_BT[:, t]`. `head` maps
    [B, t, H] -> [B, t, V] logits (the model's `lm_head` / `get_output_embeddings()`); it is called once
    per chunk in the forward, and once more per chunk in the backward when grad is enabled.

    Logits are upcast to float32 and divided by `temperature` (the sampling temperature, so the trainer's
    log-probs match the engine's), exactly as `loss.token_logprobs` does; log-prob = picked logit -
    logsumexp. Returns `(logp_BT, entropy_BT)`, both float32; `entropy_BT` is the per-position entropy of
    the temperature-scaled distribution, computed without grad (a metric, not a loss term), or None
    unless `with_entropy`.

    Peak memory is a few [B, chunk_size, V] float32 tensors rather than several [B, T, V] ones (13.7 GB
    each at T = 22.5k, V = 152064; see the module docstring). Under `torch.no_grad()` no graph is kept.
    Example: B = 1, T = 2048, chunk_size = 1024 calls `head` on positions 0..1023, then 1024..2047.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden_BTH.dim() != 3 or tokens_BT.shape != hidden_BTH.shape[:2]:
        raise ValueError(
            f"hidden_BTH {tuple(hidden_BTH.shape)} must be [B, T, H] with tokens_BT [B, T], got "
            f"tokens_BT {tuple(tokens_BT.shape)}"
        )
    B, T = tokens_BT.shape
    if T == 0:
        empty_BT = hidden_BTH.new_zeros((B, 0), dtype=torch.float32)
        return empty_BT, (empty_BT.clone() if with_entropy else None)

    tokens_BT = tokens_BT.long()
    grad = torch.is_grad_enabled()
    logps, ents = [], []
    for s in range(0, T, chunk_size):
        h_BtH, tok_Bt = hidden_BTH[:, s : s + chunk_size], tokens_BT[:, s : s + chunk_size]
        if grad:
            # Non-reentrant: gradients reach the head's parameters (closed over, not passed as inputs)
            # and work under ZeRO-3's hooks; only the [B, t] outputs are saved for backward.
            logp_Bt, ent_Bt = checkpoint(
                _chunk, head, temperature, with_entropy, h_BtH, tok_Bt, use_reentrant=False
            )
        else:
            logp_Bt, ent_Bt = _chunk(head, temperature, with_entropy, h_BtH, tok_Bt)
        logps.append(logp_Bt)
        if ent_Bt is not None:
            ents.append(ent_Bt.detach())
    logp_BT = logps[0] if len(logps) == 1 else torch.cat(logps, dim=1)
    ent_BT = None
    if with_entropy:
        ent_BT = ents[0] if len(ents) == 1 else torch.cat(ents, dim=1)
    return logp_BT, ent_BT
