"""Evaluation of a model on a prompt set: avg@k, best@k (= pass@k) and maj@k, overall and per problem.

    dapo-ray eval --config workflows/configs/dapo_qwen2.5_32b.yaml --model /models/ckpt \
        --files data/aime-2024.parquet                 # 30 problems x 32 samples, as in the paper

The samples go through the training path: the rollout deployment on Ray Serve (serving the model
directory as loaded: its weight store never gets a version), one `pipeline.generate_round` per batch of
problems (Ray Data -> Serve -> the config's verifier), the config's `eval` sampling (k = `eval.n`,
temperature 1.0 and top-p 0.7 in the paper, section 4.1). The training loop's periodic evaluation
(`driver.evaluate`) calls `sample_and_score` and `summarize` from here too.

For a problem with k samples, c of them judged correct:

* avg@k = c / k, averaged over problems: the paper's AIME metric (its avg@32);
* best@k = pass@k = 1 if c > 0 (with exactly k samples drawn this is also the unbiased pass@k
  estimator of Chen et al. 2021);
* maj@k = 1 if the most frequent extracted answer (the verifier's `pred`) is correct. Unparsable
  answers (`[INVALID]`) do not vote, and a problem with none parsable scores 0; a tie between m answers,
  j of them correct, scores j / m, the expected score of breaking the tie at random (the usual
  "first one seen" rule would make the score depend on sampling order).

Worked example, k = 4, ground truth 13: answers `13, 12, 12, [INVALID]` give avg 0.25, best 1, maj 0
(12 has two votes); `13, 12, [INVALID], [INVALID]` give maj 0.5 (13 and 12 tie with one vote each).

Every evaluation also keeps what the model says (dapo_ray/replies.py): the commonest reply shapes, the
first reply of the first `eval.log_replies` problems, and the share of the samples judged right whose reply
never writes the reference answer, which raises the hack alarm above `reward.alarm_share`.

The aggregation functions at the top are plain Python; Ray, vLLM and transformers are imported inside
the functions that run the stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dapo_ray.replies import (
    alarm_message,
    alarm_up,
    replies_record,
    replies_table,
    reply_lines,
    shapes_table,
    unstated_rewarded_ratio,
)

INVALID = "[INVALID]"
"""The verifier's `pred` when it found no answer (`algo.reward.INVALID`, a test checks they agree). Not
imported from there: `dapo_ray.algo` loads torch, and every `dapo-ray` command imports this module."""

# --- aggregation (pure) --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Vote:
    """The majority vote over one problem's extracted answers."""

    answers: tuple[str, ...]
    """The most frequent parsable answers (several on a tie), in order of first appearance; () if none."""
    votes: int
    """Samples that gave each of them."""
    score: float
    """Share of `answers` judged correct: 1 or 0, or on a tie the expected score of a random pick."""


def majority_vote(preds: Sequence[str], acc: Sequence[bool]) -> Vote:
    """Vote over `preds` (the verifier's extracted answers), `[INVALID]` excluded; an answer counts as
    correct when the verifier accepted a sample that gave it.

    >>> majority_vote(["13", "12", "12", "[INVALID]"], [True, False, False, False])
    Vote(answers=('12',), votes=2, score=0.0)
    >>> majority_vote(["13", "12", "[INVALID]", "[INVALID]"], [True, False, False, False])
    Vote(answers=('13', '12'), votes=1, score=0.5)
    """
    counts = Counter(p for p in preds if p != INVALID)  # insertion-ordered: first appearance first
    if not counts:
        return Vote((), 0, 0.0)
    top = max(counts.values())
    answers = tuple(p for p, c in counts.items() if c == top)
    right = {p for p, a in zip(preds, acc, strict=True) if a}
    return Vote(answers, top, sum(a in right for a in answers) / len(answers))


@dataclass(frozen=True)
class ProblemResult:
    """One problem's k samples, verified."""

    uid: str
    """The prompt row's id (`<file>:<row>`, `synthetic-eval:<i>`)."""
    problem: str
    """The first words of the problem text (empty when not known)."""
    ground_truth: str
    acc: tuple[bool, ...]
    """Per sample: judged correct by the verifier."""
    preds: tuple[str, ...]
    """Per sample: the verifier's extracted answer, `[INVALID]` when none was found."""
    texts: tuple[str, ...]
    """Per sample: the reply as the model wrote it (`dapo_ray.replies` shows them)."""
    lengths: tuple[int, ...]
    """Per sample: response tokens."""
    truncated: tuple[bool, ...]
    """Per sample: stopped at the length limit."""
    data_source: str = ""
    """The row's `data_source` (`mathematics_dataset/numbers__gcd`): `by_source` groups on it."""
    stated: tuple[bool, ...] = ()
    """Per sample: the reply writes the reference answer (its task's check: the hack alarm's); empty: not
    judged, read with the generic check (`replies.stated_of`)."""
    reward_errors: int = 0
    """Samples the user's reward function could not score (errors and timeouts)."""

    @property
    def k(self) -> int:
        return len(self.acc)

    @property
    def correct(self) -> int:
        return sum(self.acc)

    @property
    def vote(self) -> Vote:
        return majority_vote(self.preds, self.acc)

    def to_dict(self) -> dict:
        vote = self.vote
        return {"uid": self.uid, "problem": self.problem, "ground_truth": self.ground_truth, "k": self.k,
                "correct": self.correct, "majority": list(vote.answers), "majority_votes": vote.votes,
                "maj_score": vote.score, "no_answer": self.preds.count(INVALID), "answers": list(self.preds),
                "response_length_mean": statistics.fmean(self.lengths), "truncated": sum(self.truncated),
                "data_source": self.data_source}  # fmt: skip


def summarize(results: Sequence[ProblemResult]) -> dict[str, float]:
    """avg@k, pass@k (= best@k) and maj@k over problems (see the module docstring), the share of samples
    with no parsable answer, the mean response length and the share truncated, and the share of the
    samples judged right whose reply does not state the reference answer (`dapo_ray.replies`: the hack
    alarm's) with how many were judged right."""
    samples = [(n, t, p) for r in results for n, t, p in zip(r.lengths, r.truncated, r.preds, strict=True)]
    judged = all(r.stated for r in results)
    unstated, rewarded = unstated_rewarded_ratio([t for r in results for t in r.texts],
                                                 [r.ground_truth for r in results for _ in r.texts],
                                                 [a for r in results for a in r.acc],
                                                 [s for r in results for s in r.stated] if judged else None)  # fmt: skip
    return {
        "avg_at_k": statistics.fmean(r.correct / r.k for r in results),
        "pass_at_k": statistics.fmean(r.correct > 0 for r in results),
        "maj_at_k": statistics.fmean(r.vote.score for r in results),
        "no_answer_ratio": statistics.fmean(p == INVALID for _, _, p in samples),
        "response_length_mean": statistics.fmean(n for n, _, _ in samples),
        "truncated_ratio": statistics.fmean(t for _, t, _ in samples),
        "unstated_rewarded_ratio": unstated,
        "rewarded_samples": rewarded,
        "reward_errors": sum(r.reward_errors for r in results),
        "problems": len(results),
        "samples": len(samples),
    }


def by_source(results: Sequence[ProblemResult]) -> dict[str, dict[str, float]]:
    """avg@k, pass@k and problems per `data_source` (the benchmark's modules), in name order."""
    groups: dict[str, list[ProblemResult]] = {}
    for r in results:
        groups.setdefault(r.data_source, []).append(r)
    return {source: {"avg_at_k": statistics.fmean(r.correct / r.k for r in rs),
                     "pass_at_k": statistics.fmean(r.correct > 0 for r in rs), "problems": len(rs)}
            for source, rs in sorted(groups.items())}  # fmt: skip


def source_table(per_source: dict[str, dict[str, float]], k: int, baseline: dict[str, float] | None = None) -> str:
    """`by_source` as a markdown table; with `baseline` (source -> accuracy), a column for it too."""
    extra = " | echo baseline" if baseline is not None else ""
    lines = [f"| source | problems | avg@{k} | pass@{k}{extra} |", "|---|---|---|---|" + ("---|" if extra else "")]
    for source, s in per_source.items():
        echo = f" | {baseline[source]:.1%}" if baseline is not None and source in baseline else " | -" if extra else ""
        lines.append(f"| {source or '-'} | {s['problems']} | {s['avg_at_k']:.1%} | {s['pass_at_k']:.1%}{echo} |")
    return "\n".join(lines)


def first_words(text: str, max_chars: int = 48) -> str:
    """The start of a problem on one line, without the DAPO instruction template."""
    from dapo_ray.data import strip_dapo_template

    flat = " ".join(strip_dapo_template(text).split())
    return flat if len(flat) <= max_chars else flat[: max_chars - 3].rsplit(" ", 1)[0] + "..."


def markdown_table(results: Sequence[ProblemResult], limit: int | None = None) -> str:
    """The per-problem table: id, first words, ground truth, correct out of k, majority answer (votes),
    samples with no parsable answer. With `limit`, only the first `limit` problems."""

    def cell(s: str, width: int = 60) -> str:
        s = s.replace("|", "\\|").replace("\n", " ")
        return s if len(s) <= width else s[: width - 3] + "..."

    lines = ["| id | problem | ground truth | correct | majority (votes) | no answer |", "|---|---|---|---|---|---|"]
    for r in results[:limit]:
        vote = r.vote
        majority = f"{' / '.join(cell(a, 20) for a in vote.answers)} ({vote.votes})" if vote.answers else "-"
        lines.append(f"| {cell(r.uid, 32)} | {cell(r.problem)} | {cell(r.ground_truth, 20)} | {r.correct}/{r.k} | "
                     f"{majority} | {r.preds.count(INVALID)} |")  # fmt: skip
    return "\n".join(lines)


def headline(summary: dict[str, float], k: int) -> str:
    """`avg@k 12.3%  best@k (pass@k) 40.0%  maj@k 23.3%` and the sample statistics."""
    return (f"avg@{k} {summary['avg_at_k']:.1%}  best@{k} (pass@{k}) {summary['pass_at_k']:.1%}  "
            f"maj@{k} {summary['maj_at_k']:.1%}  |  no answer {summary['no_answer_ratio']:.1%} of samples, "
            f"mean length {summary['response_length_mean']:.1f} tokens, truncated {summary['truncated_ratio']:.1%}, "
            f"reference not stated in {summary['unstated_rewarded_ratio']:.1%} of the {summary['rewarded_samples']} "
            "judged right")  # fmt: skip


# --- sampling and scoring on the stack -----------------------------------------------------------------


def eval_sampling(cfg):
    """The `eval` section as a SamplingSpec: k = eval.n, its temperature and top-p, and its length limit
    (eval.max_response_length, else the rollout's L_max)."""
    from dapo_ray.pipeline import SamplingSpec

    e = cfg.eval
    return SamplingSpec(e.n, e.temperature, e.top_p, e.max_response_length or cfg.rollout.max_response_length)


def problem_result(group: dict) -> ProblemResult:
    """A scored row of `generate_round` (`pipeline.score_group`: verdicts, what the scorer read, whether each
    reply states the reference) as a ProblemResult."""
    return ProblemResult(uid=group["uid"], problem=group.get("problem", ""), ground_truth=group["ground_truth"],
                         acc=tuple(bool(a) for a in group["acc"]), preds=tuple(group["preds"]),
                         texts=tuple(group["texts"]), lengths=tuple(len(ids) for ids in group["response_ids"]),
                         truncated=tuple(bool(t) for t in group["truncated"]),
                         data_source=group.get("data_source") or "", stated=tuple(bool(s) for s in group["stated"]),
                         reward_errors=sum(bool(e) for e in group["reward_errors"]))  # fmt: skip


def sample_and_score(rows: list[dict], app: str, sampling, scoring, concurrency: int,
                     progress: Callable[[list[ProblemResult]], None] | None = None) -> list[ProblemResult]:  # fmt: skip
    """k responses per problem through `generate_round` (Ray Data -> the Serve deployment `app` -> the
    verifier), as ProblemResults in the order of `rows` (each needs uid, prompt_ids, ground_truth).

    Without `progress`: one round of at most 32 problems per call, as the training loop evaluates. With
    it: rounds of `concurrency` calls, at least four, and `progress(results so far)` after each; the
    verdicts and reply texts are kept between rounds, not the token ids and log-probs."""
    from dapo_ray.pipeline import generate_round

    per_call = min(32, math.ceil(len(rows) / (concurrency * (4 if progress else 1))))
    size = per_call * concurrency if progress else len(rows)
    results: list[ProblemResult] = []
    for start in range(0, len(rows), size):
        groups = generate_round(rows[start : start + size], app, sampling, scoring, prompts_per_call=per_call,
                                max_concurrency=concurrency)  # fmt: skip
        results += [problem_result(g) for g in groups]
        if progress:
            progress(results)
    order = {r["uid"]: i for i, r in enumerate(rows)}
    return sorted(results, key=lambda r: order[r.uid])


# --- the eval set -----------------------------------------------------------------------------------------


def load_eval_set(cfg, tokenizer) -> tuple[str, list[dict], int]:
    """(set name, problems, prompts dropped as too long). The problems are `eval.files` when given
    (de-duplicated by prompt, as training loads them: aime-2024.parquet's 960 rows are 30 problems), else
    the synthetic task's held-out problems; each row has uid, prompt_ids (the chat template, as in
    training), ground_truth and the problem's first words. Prompts longer than data.max_prompt_length
    tokens are dropped, as in training."""
    from dapo_ray.config import ConfigError
    from dapo_ray.data import load_prompts, tokenize_prompts
    from dapo_ray.progress import log
    from dapo_ray.tasks.sums import synthetic_rows

    d = cfg.data
    if cfg.eval.files:
        rows, report = load_prompts(cfg.eval.files, d.template, dedupe=True, on_bad_row=d.on_bad_row)
        log(f"eval data: {report}")
        name = "+".join(Path(f).stem for f in cfg.eval.files)
    elif d.source == "synthetic":
        _, rows = synthetic_rows(dataclasses.asdict(d.synthetic), d.template)
        name = "synthetic-held-out"
    else:
        raise ConfigError("nothing to evaluate: give --files (or eval.files), or a config with data.source: synthetic")
    out = with_problems(tokenize_prompts(rows, tokenizer, d.max_prompt_length), rows)
    if len(out) < len(rows):
        log(f"dropped {len(rows) - len(out)} of {len(rows)} prompts longer than data.max_prompt_length="
            f"{d.max_prompt_length} tokens")  # fmt: skip
    return name, out, len(rows) - len(out)


def with_problems(tokenized: list[dict], rows: list[dict]) -> list[dict]:
    """`tokenized` rows (`data.tokenize_prompts`) with the first words of their problem, the last user
    message of the row of `rows` with the same uid (the question asked, after any worked examples): what the
    per-problem table and the replies show."""
    problems = {r["uid"]: first_words([m["content"] for m in r["messages"] if m["role"] == "user"][-1], 100)
                for r in rows}  # fmt: skip
    return [p | {"problem": problems[p["uid"]]} for p in tokenized]


def with_target(cfg, model: str | None = None, files: Sequence[str] = (), k: int | None = None):
    """`cfg` with the model directory (rollout.model_path), eval files (eval.files) and k (eval.n) of
    the command line, when given; validated again."""
    from dapo_ray.config import validate

    if model:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, model_path=model))
    if files or k is not None:
        e = cfg.eval
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(e, files=tuple(files) or e.files,
                                                                n=e.n if k is None else k))  # fmt: skip
    validate(cfg)
    return cfg


def default_out(model_path: str, set_name: str) -> Path:
    """Beside the model: `<model>/eval/<set name>.json`."""
    return Path(model_path) / "eval" / f"{set_name}.json"


# --- the command ------------------------------------------------------------------------------------------


def evaluate_model(cfg, out: str | Path | None = None) -> dict:
    """Evaluate rollout.model_path on the eval set (see `load_eval_set`) with the `eval` sampling; print
    progress and the results; write the report as JSON to `out` (default: `default_out`) and the
    per-problem table as markdown beside it. Starts (or joins) Ray, deploys the rollout replicas, and
    removes what it started. Returns the report."""
    import uuid

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from dapo_ray.config import ConfigError
    from dapo_ray.pipeline import scoring_spec
    from dapo_ray.progress import log
    from dapo_ray.ray_cluster import absolute_paths, init_ray
    from dapo_ray.rollout.deployment import APP_NAME, deploy_rollout
    from dapo_ray.tasks.task import scorer_name
    from dapo_ray.weights import create_store

    t_start = time.time()
    cfg = absolute_paths(cfg)
    r, e = cfg.rollout, cfg.eval
    tokenizer = AutoTokenizer.from_pretrained(r.model_path)
    name, rows, dropped = load_eval_set(cfg, tokenizer)
    if not rows:
        raise ConfigError(f"no problem of {name} fits in data.max_prompt_length={cfg.data.max_prompt_length} tokens")
    out = Path(out) if out else default_out(r.model_path, name)
    sampling, scoring = eval_sampling(cfg), scoring_spec(cfg)

    started_ray = not ray.is_initialized()
    init_ray(cfg)
    if APP_NAME in serve.status().applications:
        raise RuntimeError(f"the Serve application {APP_NAME!r} already runs on this cluster (a training run?); "
                           "evaluate on another cluster or once it has finished")  # fmt: skip
    store_name = f"weights-eval-{uuid.uuid4().hex[:8]}"
    store = create_store(store_name)  # never published to: the replicas serve the directory as loaded
    try:
        log(f"deploying {r.num_replicas} vLLM rollout replica(s) of {r.model_path}")
        deploy_rollout(r, cfg.data.max_prompt_length + sampling.max_tokens, store_name, cfg.trainer.seed)
        log(f"evaluating {name}: {len(rows)} problems x {e.n} samples, temperature {e.temperature}, top-p {e.top_p}, "
            f"at most {sampling.max_tokens} tokens, scored by {scorer_name(cfg.reward)}")  # fmt: skip
        t_gen = time.time()

        def progress(done: list[ProblemResult]) -> None:
            log(f"{len(done)}/{len(rows)} problems, avg@{e.n} {summarize(done)['avg_at_k']:.1%} so far "
                f"({time.time() - t_gen:.0f}s)")  # fmt: skip

        results = sample_and_score(rows, APP_NAME, sampling, scoring, r.max_replicas * 2, progress)
        generate_s = time.time() - t_gen
    finally:
        serve.delete(APP_NAME)
        ray.kill(store)
        if started_ray:
            ray.shutdown()

    summary = summarize(results)
    said = replies_record(results, e.log_replies)
    per_source = by_source(results)
    report = {
        "set": name, "model": r.model_path, "files": list(e.files), "k": e.n, "temperature": e.temperature,
        "top_p": e.top_p, "max_response_length": sampling.max_tokens, "reward_mode": cfg.reward.mode, "reward_function": cfg.reward.function,
        "dropped_long_prompts": dropped, **summary, "generate_s": generate_s, "seconds": time.time() - t_start,
        "per_source": per_source, **said, "per_problem": [p.to_dict() for p in results],
    }  # fmt: skip
    sources = f"Per source:\n\n{source_table(per_source, e.n)}\n\n" if len(per_source) > 1 else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    table = out.with_suffix(".md")
    shapes = f"Commonest reply shapes (digits as N), of all {summary['samples']} replies:\n\n{shapes_table(said['shapes'])}"
    table.write_text(f"# {name}: {r.model_path}\n\n{headline(summary, e.n)}\n\n{sources}{markdown_table(results)}\n\n{shapes}\n\n"
                     f"The first reply of each of the first {len(said['replies'])} problems:\n\n"
                     f"{replies_table(said['replies'])}\n")  # fmt: skip
    shown = 100
    print(f"\n{name}: {len(results)} problems x {e.n} samples ({report['seconds']:.0f}s in all, "
          f"{generate_s:.0f}s sampling)\n{headline(summary, e.n)}\n\n{sources}{markdown_table(results, shown)}")  # fmt: skip
    if len(results) > shown:
        print(f"... {len(results) - shown} more problems in {table}")
    print(f"\n{shapes}")
    if e.print_replies and said["replies"]:
        print("\nFirst replies:\n" + "\n".join(f"  {line}" for line in reply_lines(said["replies"], e.print_replies)))
    if alarm_up(summary["unstated_rewarded_ratio"], summary["rewarded_samples"], cfg.reward.alarm_share):
        print("\n" + alarm_message(summary["unstated_rewarded_ratio"], summary["rewarded_samples"], "on this set",
                                   str(table)))  # fmt: skip
    print(f"\nwritten: {out}, {table}")
    return report


def _split_files(files: list[str], overrides: list[str]) -> tuple[list[str], list[str]]:
    """`--files a.parquet eval.top_p=1.0`: argparse gives both to --files; a `key=value` that is not an
    existing file is an override."""
    moved = [f for f in files if "=" in f and not Path(f).exists()]
    return [f for f in files if f not in moved], moved + overrides


def _main(args: argparse.Namespace) -> int:
    import sys

    from dapo_ray.config import load_config
    from dapo_ray.data import BadRowError

    files, overrides = _split_files(args.files or [], args.overrides)
    cfg = with_target(load_config(args.config, overrides), model=args.model, files=files, k=args.k)
    try:
        evaluate_model(cfg, out=args.out)
    except (FileNotFoundError, BadRowError) as e:
        print(f"dapo-ray eval: error: {e}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    """Register `dapo-ray eval` on the CLI's subparsers."""
    from dapo_ray.config import DEFAULT_CONFIG

    p = sub.add_parser("eval", help="avg@k, best@k and maj@k of a model directory on a prompt set (Serve + Ray Data)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config file (its eval section: k, sampling)")
    p.add_argument("--model", help="HF model directory to evaluate (default: rollout.model_path)")
    p.add_argument("--files", nargs="+",
                   help="parquet (DAPO schema) or jsonl prompt files (default: eval.files, else the synthetic "
                        "held-out set of data.synthetic)")  # fmt: skip
    p.add_argument("--k", type=int, help="samples per problem (default: eval.n)")
    p.add_argument("--out", help="the JSON report to write (default: <model>/eval/<set name>.json); the "
                                 "per-problem table goes beside it as .md")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. eval.top_p=1.0")
    p.set_defaults(func=_main)
