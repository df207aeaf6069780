"""PolicyLM, the trainer's forward: no KV cache, and the same number of output-head calls whatever the
micro-batch's shape (ZeRO-3 gathers the head at each call and wants every pass alike)."""

import pytest
import torch

from dapo_ray.algo.loss import token_logprobs
from dapo_ray.config import load_config
from dapo_ray.trainer.loop import logprob_chunks
from dapo_ray.trainer.policy import PolicyLM, head_chunks


@pytest.fixture(scope="module")
def lm():
    from transformers import Qwen2ForCausalLM

    from dapo_ray.tiny_model import tiny_config

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_config(vocab_size=97, hidden=32, layers=2)).eval()


def _batch(B: int, L: int, seed: int = 0):
    ids = torch.randint(1, 97, (B, L), generator=torch.Generator().manual_seed(seed))
    att = torch.ones_like(ids)
    att[0, L // 2 :] = 0  # a shorter first row, as padding makes
    return ids, att


def test_no_kv_cache_in_a_no_grad_forward(lm):
    seen = []
    hook = lm.get_decoder().register_forward_hook(lambda mod, args, kwargs, out: seen.append(out), with_kwargs=True)
    try:
        ids, att = _batch(2, 9)
        with torch.no_grad():
            PolicyLM(lm)(ids, att)
            # What the decoder does when not told (eval mode, config.use_cache true): it builds a cache.
            default = lm.get_decoder()(input_ids=ids, attention_mask=att)
    finally:
        hook.remove()
    assert lm.config.use_cache and default.past_key_values is not None
    assert seen[0].past_key_values is None


@pytest.mark.parametrize("shape", [(1, 2), (1, 5), (3, 9), (2, 40), (4, 33)])
@pytest.mark.parametrize("n_chunks", [1, 3, 8])
def test_the_head_runs_n_chunks_times_whatever_the_shape(lm, shape, n_chunks):
    calls = []
    hook = lm.get_output_embeddings().register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[1]))
    ids, att = _batch(*shape)
    policy = PolicyLM(lm, n_chunks)
    try:
        with torch.no_grad():
            logp, ent = policy(ids, att, temperature=0.7, with_entropy=True)
        assert len(calls) == n_chunks and len(set(calls)) == 1  # equal chunks, padded
        calls.clear()
        logp_grad, _ = policy(ids, att, temperature=0.7)
        logp_grad.sum().backward()
        assert len(calls) == 2 * n_chunks  # the forward, and each chunk's recompute in backward
    finally:
        hook.remove()
        lm.zero_grad(set_to_none=True)
    # The values of one unchunked head over the real positions (padding changes nothing).
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1]
    want = token_logprobs(logits, ids[:, 1:], temperature=0.7)
    assert logp.shape == ent.shape == (shape[0], shape[1] - 1)
    torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp_grad.detach(), want, rtol=1e-5, atol=1e-5)


def test_chunks_are_sized_for_the_largest_micro_batch():
    assert head_chunks(24576, 1024) == 24 and head_chunks(1000, 1024) == 1 and head_chunks(1025, 1024) == 2
    base = ["data.source=synthetic", "data.max_prompt_length=100", "rollout.max_response_length=900",
            "algorithm.overlong_cache_length=100"]
    fixed = load_config(overrides=[*base, "trainer.micro_batch_size=4", "trainer.logprob_chunk_size=500"])
    assert logprob_chunks(fixed) == 8  # 4 responses x 1000 tokens
    budget = load_config(overrides=[*base, "trainer.micro_batch_tokens=3000", "trainer.logprob_chunk_size=500"])
    assert logprob_chunks(budget) == 6
    small = load_config(overrides=[*base, "trainer.micro_batch_tokens=600", "trainer.logprob_chunk_size=500"])
    assert logprob_chunks(small) == 2  # a 1000-token response still goes alone


@pytest.mark.parametrize("first_target", [0, 1, 5, 7])
def test_the_head_runs_from_the_first_response_position_only(lm, first_target):
    """Positions from `first_target` on score exactly as the whole sequence does (values and the
    gradient), earlier ones get 0, and the head still runs n_chunks times, on fewer positions."""
    ids, att = _batch(3, 9)
    policy = PolicyLM(lm, 2)
    logp_full, ent_full = policy(ids, att, with_entropy=True)
    logp_full[:, first_target:].sum().backward()
    want_grad = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    rows = []
    hook = lm.get_output_embeddings().register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[1]))
    try:
        logp, ent = policy(ids, att, with_entropy=True, first_target=first_target)
        assert len(rows) == 2 and rows[0] == -(-(8 - first_target) // 2)
        logp.sum().backward()
        for name, grad in want_grad.items():
            torch.testing.assert_close(dict(lm.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-6)
    finally:
        hook.remove()
        lm.zero_grad(set_to_none=True)
    assert logp.shape == ent.shape == (3, 8)
    assert not logp[:, :first_target].any() and not ent[:, :first_target].any()
    torch.testing.assert_close(logp[:, first_target:], logp_full[:, first_target:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[:, first_target:], ent_full[:, first_target:], rtol=1e-5, atol=1e-5)


def test_first_target_out_of_range_is_refused(lm):
    ids, att = _batch(1, 5)
    with pytest.raises(ValueError, match="first_target 4 must lie in"):
        PolicyLM(lm)(ids, att, first_target=4)


def test_a_micro_batch_starts_its_head_at_the_shortest_trained_prompt():
    from dapo_ray.trainer.batch import DUMMY, pad_micro

    def sample(n_prompt, n_resp, weight=1.0):
        return {"input_ids": list(range(1, n_prompt + n_resp + 1)), "n_prompt": n_prompt, "weight": weight,
                "advantage": 1.0, "rollout_logprobs": [-1.0] * n_resp, "token_versions": [0]}  # fmt: skip

    m = pad_micro([sample(6, 3), sample(4, 5), sample(2, 1, weight=0.0), DUMMY], 0)
    assert m.first_target == 3  # the 4-token prompt; the zero-weight one and the dummy are not trained
    assert not m.mask_BT[:, : m.first_target].any() and m.mask_BT[1, 3] == 1
    assert pad_micro([DUMMY, DUMMY], 0).first_target == 0


def test_eager_attention_scores_as_sdpa_does(tmp_path):
    """`trainer.attn_implementation` reaches the trainer's model, and eager attention gives the log-probs
    (and gradients) of the default fused kernel, padding included."""
    from transformers import Qwen2ForCausalLM

    from dapo_ray.tiny_model import tiny_config
    from dapo_ray.trainer.zero import load_causal_lm

    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_config(vocab_size=97, hidden=32, layers=2)).save_pretrained(tmp_path)
    ids, att = _batch(3, 12)
    out = {}
    for impl in ("sdpa", "eager"):
        lm = load_causal_lm(str(tmp_path), torch.float32, {"zero_optimization": {"stage": 1}}, impl)
        assert lm.config._attn_implementation == impl
        logp, _ = PolicyLM(lm)(ids, att, first_target=2)
        (logp * att[:, 1:]).sum().backward()
        out[impl] = (logp.detach() * att[:, 1:], lm.model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(out["eager"][0], out["sdpa"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["eager"][1], out["sdpa"][1], rtol=1e-4, atol=1e-6)


def _grouped_micro(V: int, seed: int = 0):
    """Rows as a trainer micro-batch holds them: two prompts of different lengths, several responses each
    (one empty), and a dummy."""
    from dapo_ray.trainer.batch import DUMMY, pad_micro

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (7, 4)]
    samples = []
    for p, r in [(0, 6), (0, 3), (1, 8), (0, 1), (1, 2), (1, 0)]:
        resp = torch.randint(1, V, (r,), generator=g).tolist()
        samples.append({"input_ids": prompts[p] + resp, "n_prompt": len(prompts[p]), "weight": 1.0 if r else 0.0,
                        "advantage": 1.0, "rollout_logprobs": [-1.0] * r, "token_versions": [0] * r})  # fmt: skip
    return pad_micro([*samples, DUMMY], 0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_shared_prompts_score_as_whole_rows(tmp_path, impl):
    """share_prompts: the decoder runs each distinct prompt once and every row's rest against its cached
    keys and values; trained positions get the log-probs, entropies and parameter gradients of whole rows."""
    from transformers import Qwen2ForCausalLM

    from dapo_ray.tiny_model import tiny_config
    from dapo_ray.trainer.zero import load_causal_lm

    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_config(vocab_size=97, hidden=32, layers=2)).save_pretrained(tmp_path)
    lm = load_causal_lm(str(tmp_path), torch.float32, {"zero_optimization": {"stage": 1}}, impl).train()
    m = _grouped_micro(97)
    out = {}
    for share in (False, True):
        lm.zero_grad(set_to_none=True)
        batches = []
        hook = lm.get_decoder().register_forward_hook(lambda mod, args, kw, o, seen=batches: seen.append(
            kw["input_ids"].shape), with_kwargs=True)  # fmt: skip
        try:
            logp, ent = PolicyLM(lm, 2, share)(m.ids_BL, m.att_BL, 0.7, with_entropy=True, first_target=m.first_target,
                                               prefix_B=m.prefix_B)  # fmt: skip
            (logp * m.mask_BT).sum().backward()
        finally:
            hook.remove()
        grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
        out[share] = (logp.detach() * m.mask_BT, ent * m.mask_BT, grads, batches)
    whole, shared = out[False], out[True]
    assert logp.shape == m.mask_BT.shape and whole[0].abs().sum() > 0
    torch.testing.assert_close(shared[0], whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[1], whole[1], rtol=1e-5, atol=1e-5)
    assert shared[2].keys() == whole[2].keys()
    for name, grad in whole[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=1e-4, atol=1e-6)
    # Whole rows: one pass of 7 rows. Shared: the 3 distinct prefixes (two prompts and the dummy's empty
    # one) padded to the longest prompt less its last token, then 7 rests of at most 9 tokens.
    assert whole[3] == [(7, 13)] and shared[3] == [(3, 6), (7, 9)]


def test_a_shared_forward_without_prefixes_is_the_plain_one(lm):
    """A micro-batch without `prefix_B` (as built before it existed) runs whole rows."""
    ids, att = _batch(2, 9)
    torch.testing.assert_close(PolicyLM(lm, 1, True)(ids, att)[0], PolicyLM(lm, 1)(ids, att)[0])
