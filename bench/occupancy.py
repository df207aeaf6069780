"""How full a rollout replica's batch stays during today's generation rounds, engine step by engine step,
and what the same responses project to on a GPU, in rounds and in a stream.

**Measured.** One vLLM-CPU replica of the reasoning task's tiny model (`tiny_cpu_reasoning.yaml`:
responses of tens to 128 tokens) runs `--rounds` generation rounds of `gen_batch_size` prompts x G
through the driver's own path (`pipeline.generate_round`: Ray Data -> Serve -> scoring). After every
decoding step the engine records the sequences in its batch (`Engine.trace`). Per round it prints the
decoding steps, the peak and mean sequences, the occupancy (mean / peak) and the share of steps below
half the peak: a round keeps the batch full only until its shorter responses end; its longest ones then
run nearly alone.

**Projected, with a stated model.** On a GPU a decoding step is memory-bound: it reads every weight
once whatever the batch, so its time is roughly constant in the batch size up to the KV-cache limit
(vLLM's own scheduler assumes as much when it fills the batch; see e.g. the vLLM paper, Kwon et al. 2023,
Fig. 1-2: throughput grows almost linearly with the batch until memory runs out). Under that model a
rollout's time is its number of decoding steps, with `--capacity` sequences at most in flight. The
simulation draws groups (G lengths and a keep flag) from the measured rounds and fills `--batches`
train batches of `train_batch_size` kept groups two ways:

* **rounds** (today): a round of `gen_batch_size` prompts runs to its last response (the engine refills
  free slots from the round's own waiting sequences, not from the next round), and rounds repeat until
  the batch is full;
* **stream** (issue 25): a prompt is admitted whenever G slots are free; a group is scored when its own
  G responses end; the batch is cut the moment it holds `train_batch_size` kept groups, and groups
  still in flight carry on into the next batch.

It prints decoding steps per batch for both and their ratio, on the measured lengths and at the paper's
range (every length scaled so the longest possible is 20,480 tokens: the same shape, DAPO's L_max).
Under this model the ratio depends on the shape of the distribution and the capacity, not the scale.

    python bench/occupancy.py [--rounds 6] [--capacity 256] [--batches 200]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAPER_MAX = 20480


def rounds_steps(groups: list[tuple[list[int], bool]], target: int, gen_batch: int, capacity: int,
                 rng: random.Random) -> float:  # fmt: skip
    """Decoding steps to keep `target` groups, one round at a time, each of as many prompts as the driver
    asks for (`BatchFiller.prompts_for_next_round`: 1.2 x missing / keep rate, within [missing, gen_batch])."""
    rate = statistics.fmean(keep for _, keep in groups)
    kept = steps = 0
    while kept < target:
        missing = target - kept
        size = max(missing, min(gen_batch, math.ceil(1.2 * missing / rate)))
        draw = [rng.choice(groups) for _ in range(size)]
        steps += makespan([n for lengths, _ in draw for n in lengths], capacity)
        kept += sum(keep for _, keep in draw)
    return steps


def makespan(lengths: list[int], capacity: int) -> int:
    """Steps until every sequence ends with `capacity` slots, each taking the next waiting sequence when
    its own ends (continuous batching within one round)."""
    slots = [0] * min(capacity, len(lengths))
    for n in lengths:
        heapq.heapreplace(slots, slots[0] + n)
    return max(slots, default=0)


def stream_steps(groups: list[tuple[list[int], bool]], target: int, batches: int, capacity: int,
                 rng: random.Random) -> float:  # fmt: skip
    """Mean decoding steps per batch of `target` kept groups when prompts stream in as slots free up."""
    G = len(groups[0][0])
    now, cuts, kept = 0, [0], 0
    running: list[tuple[int, int]] = []  # (step its last response ends, keep) per group in flight
    free = capacity
    while len(cuts) <= batches:
        while free >= G:  # admit
            lengths, keep = rng.choice(groups)
            heapq.heappush(running, (now + max(lengths), keep))
            free -= G  # a group's slots stay reserved until its last response ends (upper bound on cost)
        now, keep = heapq.heappop(running)
        free += G
        kept += keep
        if kept >= target:
            cuts.append(now)
            kept = 0
    return statistics.fmean(b - a for a, b in zip(cuts, cuts[1:], strict=False))


def run_stream(app: str, rows: list[dict], total: int, in_flight: int, sampling, scoring,
               handle) -> tuple[list[int], float]:  # fmt: skip
    """`total` groups through `dapo_ray.stream.Stream` with `in_flight` prompts in flight, a new one sent
    whenever one comes back; the replica's trace meanwhile (sequences per step) and the wall time."""
    from dapo_ray.stream import Stream, wait_any

    stream = Stream(app, sampling, scoring)
    rows = iter([row | {"draw": f"0:{i}"} for i, row in enumerate(rows)])
    t0 = time.time()
    stream.admit([next(rows) for _ in range(in_flight)])
    for done in range(1, total + 1):
        wait_any(stream)
        if done + len(stream.in_flight) < total:
            stream.admit([next(rows)])
    t1 = time.time()
    stream.close()
    return [n for at, n in handle.trace.remote(t0).result() if at <= t1 and n > 0], t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "workflows/configs/tiny_cpu_reasoning.yaml"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--capacity", type=int, help="sequences in flight at most (the KV-cache limit; default: a "
                                                 "round's, gen_batch_size x G, so both ways have the same room)")
    ap.add_argument("--batches", type=int, default=200, help="train batches simulated per setting")
    args = ap.parse_args()

    import ray
    from one_replica import start
    from ray import serve

    from dapo_ray.pipeline import SamplingSpec, generate_round, scoring_spec
    from dapo_ray.rollout.deployment import APP_NAME

    cfg, rows, handle, store = start(args.config, "weights-bench-occupancy")
    r, t = cfg.rollout, cfg.trainer
    sampling = SamplingSpec(r.n, r.temperature, r.top_p, r.max_response_length)
    concurrency = 2 * r.max_replicas
    generate_round(rows[: t.gen_batch_size], APP_NAME, sampling, scoring_spec(cfg), max(1, t.gen_batch_size // concurrency),
                   concurrency)  # warm-up  # fmt: skip

    groups: list[tuple[list[int], bool]] = []
    all_rounds: list[int] = []  # sequences per step over every round
    rounds_wall = 0.0
    print(f"\nmeasured: {args.rounds} rounds of {t.gen_batch_size} prompts x G={r.n}, max_response_length "
          f"{r.max_response_length}, one vLLM-CPU replica ({args.config})")  # fmt: skip
    print(f"{'round':>5} {'steps':>6} {'peak':>5} {'mean':>6} {'occupancy':>9} {'steps < peak/2':>14} {'longest':>7} "
          f"{'mean len':>8} {'wall s':>6}")  # fmt: skip
    for i in range(args.rounds):
        prompts = rows[(i + 1) * t.gen_batch_size : (i + 2) * t.gen_batch_size]
        t0 = time.time()
        out = generate_round(prompts, APP_NAME, sampling, scoring_spec(cfg), max(1, len(prompts) // concurrency),
                             concurrency)  # fmt: skip
        t1 = time.time()
        trace = [n for at, n in handle.trace.remote(t0).result() if at <= t1 and n > 0]
        lengths = [len(ids) for g in out for ids in g["response_ids"]]
        groups += [([len(ids) for ids in g["response_ids"]], bool(g["keep"])) for g in out]
        all_rounds += trace
        rounds_wall += t1 - t0
        peak = max(trace)
        print(f"{i + 1:>5} {len(trace):>6} {peak:>5} {statistics.fmean(trace):>6.1f} "
              f"{statistics.fmean(trace) / peak:>8.1%} {sum(n < peak / 2 for n in trace) / len(trace):>13.1%} "
              f"{max(lengths):>7} {statistics.fmean(lengths):>8.1f} {t1 - t0:>6.2f}")  # fmt: skip
    stream_trace, stream_wall = run_stream(APP_NAME, rows[(args.rounds + 1) * t.gen_batch_size :],
                                           args.rounds * t.gen_batch_size, t.gen_batch_size, sampling,
                                           scoring_spec(cfg), handle)  # fmt: skip
    print(f"\nthe same number of groups ({args.rounds * t.gen_batch_size}), all rounds against the stream "
          f"({t.gen_batch_size} prompts in flight, each replaced the moment its group ends):")  # fmt: skip
    print(f"{'':>7} {'steps':>6} {'peak':>5} {'mean':>6} {'occupancy':>9} {'steps < peak/2':>14} {'wall s':>6}")
    for label, trace, wall in (("rounds", all_rounds, rounds_wall), ("stream", stream_trace, stream_wall)):
        peak = max(trace)
        print(f"{label:>7} {len(trace):>6} {peak:>5} {statistics.fmean(trace):>6.1f} {statistics.fmean(trace) / peak:>8.1%}"
              f" {sum(n < peak / 2 for n in trace) / len(trace):>13.1%} {wall:>6.2f}")  # fmt: skip
    serve.delete(APP_NAME)
    ray.shutdown()

    keep_rate = statistics.fmean(k for _, k in groups)
    capacity = args.capacity or t.gen_batch_size * r.n
    print(f"\nprojected decoding steps per train batch of {t.train_batch_size} kept groups (keep rate "
          f"{keep_rate:.0%} measured), memory-bound GPU model, {capacity} sequences in flight at most:")  # fmt: skip
    print(f"{'lengths':>34} {'rounds':>9} {'stream':>9} {'rounds / stream':>15}")
    scale = PAPER_MAX / r.max_response_length
    for label, pool in (("measured", groups),
                        (f"scaled x{scale:.0f} (longest 20,480)", [([round(n * scale) for n in ls], k) for ls, k in groups])):  # fmt: skip
        rng = random.Random(0)
        by_rounds = statistics.fmean(rounds_steps(pool, t.train_batch_size, t.gen_batch_size, capacity, rng)
                                     for _ in range(args.batches))  # fmt: skip
        by_stream = stream_steps(pool, t.train_batch_size, args.batches, capacity, random.Random(0))
        print(f"{label:>34} {by_rounds:>9.0f} {by_stream:>9.0f} {by_rounds / by_stream:>14.2f}x")


if __name__ == "__main__":
    main()
