"""chunked_token_logprobs equals the full-logits path (loss.token_logprobs / entropy_from_logits) in
values and gradients, whatever the chunking, and keeps no graph under no_grad."""


import pytest
import torch
from torch import nn

from dapo_ray.algo import logprob
from dapo_ray.algo.logprob import chunked_token_logprobs
from dapo_ray.algo.loss import entropy_from_logits, token_logprobs

B, T, H, V = 3, 37, 16, 50
CHUNKS = [1, 5, 8, 36, 37, 64]  # 5, 8 do not divide T; 37 == T; 64 > T


def setup(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(H, V, bias=True).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=dtype))  # logits of a few units, peaky
        head.bias.copy_(torch.randn(V, generator=g, dtype=dtype))
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    return head, hidden, tokens


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_values_and_entropy_equal_full_logits(chunk_size, temperature):
    head, hidden, tokens = setup()
    with torch.no_grad():
        logits = head(hidden)
        want_logp = token_logprobs(logits, tokens, temperature)
        want_ent = entropy_from_logits(logits, temperature)
        logp, ent = chunked_token_logprobs(
            hidden, head, tokens, temperature=temperature, chunk_size=chunk_size, with_entropy=True
        )
    assert logp.shape == ent.shape == (B, T)
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [5, 37, 64])
def test_values_with_grad_enabled_equal_no_grad(chunk_size):
    # The checkpointed path (grad on) returns the same numbers and a detached entropy.
    head, hidden, tokens = setup()
    hidden.requires_grad_(True)
    logp, ent = chunked_token_logprobs(
        hidden, head, tokens, temperature=0.7, chunk_size=chunk_size, with_entropy=True
    )
    with torch.no_grad():
        want_logp, want_ent = chunked_token_logprobs(hidden, head, tokens, temperature=0.7, with_entropy=True)
    assert logp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)


def _grads(logp, hidden, head):
    # A loss that weighs every position differently, like the policy loss with advantages and a mask.
    w = torch.linspace(-1.0, 2.0, logp.numel(), dtype=logp.dtype).view_as(logp)
    params = [hidden, head.weight, head.bias]
    return torch.autograd.grad((logp * w).sum(), params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_gradients_equal_full_logits(dtype, chunk_size, temperature):
    head, hidden, tokens = setup(dtype)
    hidden.requires_grad_(True)
    want = _grads(token_logprobs(head(hidden), tokens, temperature), hidden, head)
    logp, _ = chunked_token_logprobs(hidden, head, tokens, temperature=temperature, chunk_size=chunk_size)
    got = _grads(logp, hidden, head)
    for name, g, w in zip(("hidden", "weight", "bias"), got, want, strict=True):
        torch.testing.assert_close(g.to(w.dtype), w, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_head_is_called_per_chunk_and_recomputed_in_backward(monkeypatch):
    # Peak memory is one chunk's logits: the head never sees more than chunk_size positions, and the
    # logits are rebuilt in backward (one more head call per chunk) rather than kept from the forward.
    head, hidden, tokens = setup()
    seen, entropies = [], []
    head.register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
    entropy = logprob._entropy
    monkeypatch.setattr(logprob, "_entropy", lambda x: entropies.append(x.shape[1]) or entropy(x))
    hidden.requires_grad_(True)
    logp, _ = chunked_token_logprobs(hidden, head, tokens, chunk_size=16, with_entropy=True)
    assert seen == entropies == [16, 16, 5]
    logp.sum().backward()
    assert sorted(seen) == sorted([16, 16, 5] * 2)
    assert entropies == [16, 16, 5]  # checkpoint's early stop: the recompute ends before the entropy


def test_backward_keeps_no_logits():
    # Every tensor autograd saves outside the per-chunk checkpoints is small: no [B, t, V] logits.
    head, hidden, tokens = setup()
    hidden.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        logp, _ = chunked_token_logprobs(hidden, head, tokens, chunk_size=8, with_entropy=True)
    assert not [s for s in saved if V in s], saved
    logp.sum().backward()  # and the recompute still produces the gradients
    assert hidden.grad is not None and head.weight.grad is not None


def test_no_grad_keeps_no_graph():
    head, hidden, tokens = setup()
    hidden.requires_grad_(True)
    with torch.no_grad():
        logp, ent = chunked_token_logprobs(hidden, head, tokens, chunk_size=8, with_entropy=True)
    assert not logp.requires_grad and logp.grad_fn is None
    assert not ent.requires_grad and ent.grad_fn is None


def test_with_entropy_false_returns_none():
    head, hidden, tokens = setup()
    _, ent = chunked_token_logprobs(hidden, head, tokens, chunk_size=8)
    assert ent is None
    with torch.no_grad():
        assert chunked_token_logprobs(hidden, head, tokens, chunk_size=8, with_entropy=False)[1] is None


def test_bfloat16_head_is_upcast_like_token_logprobs():
    # bf16 logits are upcast before the temperature and the logsumexp, as token_logprobs does. The
    # reference takes the same per-chunk head calls: which bf16 GEMM kernel runs (and so the last bit of
    # a logit) may depend on the number of rows, and that is not what this test is about.
    head, hidden, tokens = setup()
    head, hidden = head.to(torch.bfloat16), hidden.to(torch.bfloat16)
    with torch.no_grad():
        logits = torch.cat([head(hidden[:, s : s + 8].contiguous()) for s in range(0, T, 8)], dim=1)
        want_logp = token_logprobs(logits, tokens, 0.5)
        want_ent = entropy_from_logits(logits, 0.5)
        logp, ent = chunked_token_logprobs(
            hidden, head, tokens, temperature=0.5, chunk_size=8, with_entropy=True
        )
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)


def test_empty_and_bad_arguments():
    head, hidden, tokens = setup()
    logp, ent = chunked_token_logprobs(hidden[:, :0], head, tokens[:, :0], with_entropy=True)
    assert logp.shape == ent.shape == (B, 0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(hidden, head, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="tokens_BT"):
        chunked_token_logprobs(hidden, head, tokens[:, 1:])
