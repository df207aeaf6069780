"""What a generation round through a fresh Ray Data dataset costs, against the same calls made directly.

Each generation round of the driver builds a new Ray Data dataset (`pipeline.generate_round`: prompts ->
`generate_batch` on pooled tasks calling the Serve deployment -> `score_group`). A long-lived streaming
pipeline would save the per-round planning and task start-up. This measures that cost: the demo's
round (32 prompts, G = 16, responses up to 16 tokens, 4 calls in flight) on one vLLM-CPU replica of the
demo's tiny model, done

* through Ray Data (`generate_round`, what the driver runs), and
* directly: the same calls from a thread pool on the driver (`_call_replica`), then `score_group` in
  the driver process: no dataset, no tasks;

and prints the medians and the difference per round. Rounds alternate between the two forms, so drift
of the machine's load affects both alike.

    python bench/rollout_round.py [--rounds 30] [--prompts 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "workflows/configs/tiny_cpu.yaml"))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--in-flight", type=int, default=4)
    args = ap.parse_args()

    import ray
    from one_replica import start
    from ray import serve

    from dapo_ray.pipeline import SamplingSpec, _call_replica, generate_round, score_group, scoring_spec
    from dapo_ray.rollout.deployment import APP_NAME

    cfg, rows, handle, store = start(args.config, "weights-bench-round")
    r = cfg.rollout
    sampling = SamplingSpec(r.n, r.temperature, r.top_p, r.max_response_length)
    scoring = scoring_spec(cfg)
    per_call = max(1, args.prompts // args.in_flight)
    pool = ThreadPoolExecutor(args.in_flight)

    def direct(prompts: list[dict]) -> list[dict]:
        chunks = [prompts[i : i + per_call] for i in range(0, len(prompts), per_call)]

        def call(chunk: list[dict]) -> list[dict]:
            version, replica, outs = _call_replica(handle, [p["prompt_ids"] for p in chunk], *sampling.__dict__.values())
            return [dict(p, texts=[c["text"] for c in g], response_ids=[c["response_ids"] for c in g],
                         rollout_logprobs=[c["logprobs"] for c in g], finish_reasons=[c["finish_reason"] for c in g],
                         policy_version=version, replica=replica) for p, g in zip(chunk, outs, strict=True)]  # fmt: skip

        return [score_group(row, scoring) for rows_ in pool.map(call, chunks) for row in rows_]

    def ray_data(prompts: list[dict]) -> list[dict]:
        return generate_round(prompts, APP_NAME, sampling, scoring, per_call, args.in_flight)

    times: dict[str, list[float]] = {"ray_data": [], "direct": []}
    try:
        for i in range(args.rounds + 2):  # the first round of each form warms up and is left out
            prompts = rows[i * args.prompts % len(rows) :][: args.prompts]
            for name, fn in (("ray_data", ray_data), ("direct", direct)):
                t0 = time.perf_counter()
                out = fn(prompts)
                dt = time.perf_counter() - t0
                assert len(out) == len(prompts) and all(len(g["texts"]) == r.n for g in out)
                if i >= 2:
                    times[name].append(dt)
            print(f"round {i + 1}/{args.rounds + 2}  ray_data {times['ray_data'][-1] if i >= 2 else 0:.3f}s  "
                  f"direct {times['direct'][-1] if i >= 2 else 0:.3f}s", flush=True)  # fmt: skip
    finally:
        serve.delete(APP_NAME)
        ray.kill(store)
        ray.shutdown()
    rd, dr = statistics.median(times["ray_data"]), statistics.median(times["direct"])
    print(f"\n{args.prompts} prompts x G={r.n} per round, {args.in_flight} calls in flight, medians of {args.rounds} rounds")
    print("| form | s per round | ratio |\n|---|---|---|")
    print(f"| direct calls (baseline) | {dr:.3f} | 1.00x |")
    print(f"| Ray Data dataset per round (driver) | {rd:.3f} | {rd / dr:.2f}x |")
    print(f"per-round Ray Data cost: {rd - dr:+.3f} s ({(rd - dr) / rd:.0%} of a round)")


if __name__ == "__main__":
    main()
