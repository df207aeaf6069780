"""The policy as the trainer sees it: a HF causal LM whose forward returns per-token log-probs (and
entropy) of the input's own next tokens, never the full [B, T, V] logits.

DeepSpeed wraps this module, so its forward runs inside the engine (ZeRO-3 gathers each submodule's
parameters as it runs) and `engine(ids, att, temperature)` is the whole log-prob computation. The
vocabulary projection runs chunk by chunk along the sequence (`algo.logprob`): at 22.5k tokens and a
152k vocabulary one float32 logits tensor would be 13.7 GB.
"""

from __future__ import annotations

import math

import torch

from dapo_ray.algo.logprob import chunked_token_logprobs


def head_chunks(largest_micro_tokens: int, chunk_tokens: int) -> int:
    """How many chunks every forward splits the output head into, so that the largest micro-batch's
    chunk holds about `chunk_tokens` tokens (responses x positions) of logits.
    Example: 24576 tokens a micro-batch at most, 1024 a chunk -> 24 chunks."""
    return max(1, math.ceil(largest_micro_tokens / chunk_tokens))


class PolicyLM(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, n_chunks: int = 1, share_prompts: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.n_chunks = n_chunks
        self.share_prompts = share_prompts

    def forward(
        self, ids_BL: torch.Tensor, att_BL: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
        first_target: int = 0, prefix_B: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logp_BT, entropy_BT or None) with T = L - 1: position t scores token t + 1 under the
        temperature-scaled distribution (the one the engine sampled from).

        `first_target`: the head runs only from this position on (the micro-batch's first response
        token, `Micro.first_target`); earlier positions, prompt only, get 0. The loss never reads them,
        and the head (vocabulary projection, log-softmax, entropy, and their backward) is about a fifth
        of a short-response step: SmolLM2's 46-token chat prompt and 20-token replies, 16 of them on one
        thread, take 6.1 s forward and backward instead of 7.7.

        The head runs in exactly `n_chunks` calls whatever the shape: ceil((T - first_target) / n_chunks)
        positions each, the hidden states padded with zeros to n_chunks of them (fewer than n_chunks
        positions of padding, on which only the head runs, dropped after). Under ZeRO-3 each call gathers the head's weight, a
        collective; DeepSpeed records the order in which modules run in one pass (its prefetch trace),
        checks that it is the same on every rank, and drops the trace (back to fetching on demand) when a
        later pass departs from it. A fixed count makes every forward, and its backward recompute, alike
        on every rank and for every micro-batch, whatever its rows and length.

        No KV cache of whole rows: `use_cache` defaults to the model config's (true for Qwen2) and transformers turns it
        off only for gradient checkpointing in training; a no-grad pass would build one (~6 GB at 32B and
        22.5k tokens) for nothing.

        `prefix_B`, with `share_prompts`: each row's prompt but its last token (`Micro.prefix_B`); the
        decoder then runs once on each distinct prefix and once on every row's remainder, attending to
        its prefix's keys and values (`_shared_prefix_hidden`). The result is the same function, computed
        on fewer tokens: a group's G responses share one prompt, and SmolLM2's 46-token chat prompt is
        two thirds of a 66-token row."""
        if self.share_prompts and prefix_B is not None:
            return self._forward_shared(ids_BL, att_BL, prefix_B, temperature, with_entropy)
        out = self.lm.get_decoder()(input_ids=ids_BL, attention_mask=att_BL, use_cache=False)
        T = ids_BL.shape[1] - 1
        if not 0 <= first_target < max(T, 1):
            raise ValueError(f"first_target {first_target} must lie in [0, {T})")
        hidden_BTH = out.last_hidden_state[:, first_target:-1]
        logp_BT, ent_BT = self._head(hidden_BTH, ids_BL[:, first_target + 1 :], temperature, with_entropy)
        # Back to [B, T]: zeros before first_target (a pad, so the gradient flows through unchanged).
        widen = (first_target, 0)
        logp_BT = torch.nn.functional.pad(logp_BT, widen)
        return logp_BT, None if ent_BT is None else torch.nn.functional.pad(ent_BT, widen)

    def _head(self, hidden_BRH: torch.Tensor, tokens_BR: torch.Tensor, temperature: float, with_entropy: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Log-probs (and entropy) of `tokens_BR` from the hidden states that predict them, in exactly
        `n_chunks` calls of the output head (padding the positions to a multiple of it)."""
        n = hidden_BRH.shape[1]
        chunk = max(1, math.ceil(n / self.n_chunks))
        pad = chunk * self.n_chunks - n
        if pad:
            hidden_BRH = torch.nn.functional.pad(hidden_BRH, (0, 0, 0, pad))
            tokens_BR = torch.nn.functional.pad(tokens_BR, (0, pad))
        logp, ent = chunked_token_logprobs(
            hidden_BRH, self.lm.get_output_embeddings(), tokens_BR,
            temperature=temperature, chunk_size=chunk, with_entropy=with_entropy,
        )  # fmt: skip
        return logp[:, :n], None if ent is None else ent[:, :n]

    def _forward_shared(self, ids_BL: torch.Tensor, att_BL: torch.Tensor, prefix_B: torch.Tensor, temperature: float,
                        with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """`forward` with each distinct prompt prefix run once. Row b's targets from position prefix_B[b]
        on come from the rest pass; earlier positions (prompt only, never trained) get 0."""
        B, L = ids_BL.shape
        hidden_BRH, rest_BR, start_B = _shared_prefix_hidden(self.lm.get_decoder(), ids_BL, att_BL, prefix_B)
        R = hidden_BRH.shape[1]
        # Position start + j predicts token start + j + 1: the targets are the rest shifted by one.
        tokens_BR = torch.nn.functional.pad(rest_BR[:, 1:], (0, 1))
        logp_BR, ent_BR = self._head(hidden_BRH, tokens_BR, temperature, with_entropy)
        # Back to [B, L - 1]: position start_B[b] + j of row b. Columns past L - 1 (padding) are dropped.
        cols_BR = start_B[:, None] + torch.arange(R, device=ids_BL.device)

        def place(x_BR: torch.Tensor) -> torch.Tensor:
            wide = x_BR.new_zeros(B, L - 1 + R).scatter(1, cols_BR, x_BR)
            return wide[:, : L - 1]

        return place(logp_BR), None if ent_BR is None else place(ent_BR)


def _shared_prefix_hidden(decoder: torch.nn.Module, ids_BL: torch.Tensor, att_BL: torch.Tensor,
                          prefix_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The decoder's last hidden states of each row's tokens from prefix_B[b] on, with its first
    prefix_B[b] tokens run once per distinct prefix.

    Two passes, whatever the rows (ZeRO-3 wants every forward alike): (1) the distinct prefixes,
    right-padded to the longest (at least one position), building a KV cache with its graph; (2) every
    row's rest (right-padded to the longest), its position ids continuing its own prefix, attending to
    the cache rows of its prefix (copied per row, `reorder_cache`), whose padding the attention mask
    hides. The gradient flows through the cache into the prefix pass once per distinct prefix.

    Returns (hidden [B, R, H], the rest's token ids [B, R] (padding 0), prefix_B)."""
    device = ids_BL.device
    n_B = att_BL.sum(dim=1)
    index: dict[tuple[int, ...], int] = {}  # distinct prefix -> its row in the prefix pass
    rows = [index.setdefault(tuple(ids[:s]), len(index)) for ids, s in zip(ids_BL.tolist(), prefix_B.tolist(), strict=True)]
    P = max(1, max(len(k) for k in index))
    pre_ids = torch.zeros(len(index), P, dtype=ids_BL.dtype, device=device)
    pre_att = torch.zeros(len(index), P, dtype=att_BL.dtype, device=device)
    for key, u in index.items():
        pre_ids[u, : len(key)] = torch.tensor(key, dtype=ids_BL.dtype)
        pre_att[u, : len(key)] = 1
    cache = decoder(input_ids=pre_ids, attention_mask=pre_att, use_cache=True).past_key_values
    row_u = torch.tensor(rows, device=device)
    cache.reorder_cache(row_u)
    start_B = prefix_B.to(device=device, dtype=torch.long)
    R = max(1, int((n_B - start_B).max()))
    pos_BR = start_B[:, None] + torch.arange(R, device=device)
    real_BR = pos_BR < n_B[:, None]
    rest_BR = ids_BL.gather(1, pos_BR.clamp(max=ids_BL.shape[1] - 1)).masked_fill(~real_BR, 0)
    att = torch.cat([pre_att[row_u], real_BR.to(att_BL.dtype)], dim=1)
    out = decoder(input_ids=rest_BR, attention_mask=att, position_ids=pos_BR, past_key_values=cache, use_cache=False)
    return out.last_hidden_state, rest_BR, start_B
