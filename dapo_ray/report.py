"""`dapo-ray report RUN_DIR`: a run's monitoring figures, after the DAPO paper's (Fig. 2, 3 and 7), and a
short markdown summary, read back from the run's MLflow store.

    dapo-ray report runs/demo              # runs/demo/mlflow.db -> runs/demo/report/
    dapo-ray report --tracking-uri http://mlflow:5000 --run-name qwen2.5-32b --out report-32b

A run resumed from a checkpoint logs to a new MLflow run of the same name; the report joins them by step
(a later run wins from its first step on) and adds up their wall times, leaving out the time between them.
matplotlib and mlflow are imported when a report is made, not with this module.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapo_ray.replies import ALARM_MIN_REWARDED, alarm_up, replies_table, shapes_table


class ReportError(Exception):
    """A run or store that cannot be read; the message says what to pass instead."""


@dataclass
class Series:
    """One metric over the run, one point per step (the last value logged at that step)."""

    step: list[int]
    value: list[float]
    minutes: list[float]
    """wall-clock minutes since tracking started (MLflow metric timestamps; see `load_run`)"""


@dataclass
class RunData:
    name: str
    run_ids: list[str]
    experiment: str
    tracking_uri: str
    status: str
    params: dict[str, str]
    series: dict[str, Series]
    wall_min: float
    """tracked wall time: from each MLflow run's start to its last kept metric, summed over the runs"""
    notes: list[str] = field(default_factory=list)
    evaluations: list[dict] = field(default_factory=list)
    """what each held-out evaluation kept of its replies (`evaluations/step_*.json`), by step"""

    def param(self, key: str, default: Any = None) -> Any:
        """A logged config value, parsed back from its string (MLflow stores params as text)."""
        raw = self.params.get(key)
        if raw is None:
            return default
        for parse in (int, float):
            try:
                return parse(raw)
            except ValueError:
                pass
        return {"True": True, "False": False}.get(raw, raw)


# --- reading the run ---------------------------------------------------------------------------------


def resolve_source(run_dir: str | None, tracking_uri: str | None, run_name: str | None,
                   run_id: str | None, out: str | None) -> tuple[str, str | None, Path]:  # fmt: skip
    """(tracking URI, run name to look up or None, output directory) from the command line."""
    if run_dir is not None:
        d = Path(run_dir)
        if not d.is_dir():
            raise ReportError(f"no run directory at {d} (give a run's trainer.output_dir, e.g. runs/demo)")
        if tracking_uri is None:
            db = d / "mlflow.db"
            if not db.is_file():
                raise ReportError(f"{d} has no mlflow.db: is it a run's trainer.output_dir? For a run tracked "
                                  "elsewhere pass --tracking-uri (and --run-name or --run-id)")  # fmt: skip
            tracking_uri = f"sqlite:///{db.resolve()}"
        run_name = run_name or d.resolve().name
    elif tracking_uri is None:
        raise ReportError("give a run directory, or --tracking-uri with --run-name or --run-id")
    elif not (run_name or run_id):
        raise ReportError("with --tracking-uri and no run directory, say which run: --run-name or --run-id")
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        # Opening a missing SQLite store would create an empty one.
        raise ReportError(f"no MLflow database at {tracking_uri.removeprefix('sqlite:///')}")
    if out is None:
        out = str(Path(run_dir) / "report") if run_dir is not None else f"report-{run_name or run_id}"
    return tracking_uri, (None if run_id else run_name), Path(out)


def load_run(tracking_uri: str, run_name: str | None = None, run_id: str | None = None) -> RunData:
    """Every metric of the run named `run_name` (or the run `run_id`) through the MLflow client, and the
    replies its held-out evaluations kept (`evaluations/step_*.json`; none for a run written before them).

    Wall time comes from the metric timestamps: minutes since the MLflow run started (just before the
    evaluation before training), so evaluation time is included; with several runs of the same name, each
    run's time is added after the previous one's last kept metric."""
    import logging

    logging.getLogger("alembic").setLevel(logging.WARNING)  # schema checks on opening a SQLite store
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri)
    try:
        if run_id:
            runs = [client.get_run(run_id)]
        else:
            runs = _runs_named(client, run_name)
        experiment = client.get_experiment(runs[-1].info.experiment_id).name
        histories = [{k: client.get_metric_history(r.info.run_id, k) for k in r.data.metrics} for r in runs]
    except MlflowException as e:
        raise ReportError(f"cannot read {run_id or run_name!r} from {tracking_uri}: {e.message}") from e

    # A later run (resumed from a checkpoint) wins from its first logged step on.
    firsts = [min((m.step for h in hist.values() for m in h), default=math.inf) for hist in histories]
    points: dict[str, dict[int, tuple[float, float]]] = {}
    offset_min, used, untils = 0.0, [], []
    for i, (r, hist) in enumerate(zip(runs, histories, strict=True)):
        until = min(firsts[i + 1 :], default=math.inf)
        kept = [(k, m) for k, h in hist.items() for m in h if m.step < until]
        for k, m in sorted(kept, key=lambda km: km[1].timestamp):
            points.setdefault(k, {})[m.step] = (m.value, offset_min + (m.timestamp - r.info.start_time) / 60_000)
        if kept or r is runs[-1]:
            used.append(r)
            untils.append(until)
            offset_min += (max((m.timestamp for _, m in kept), default=r.info.start_time) - r.info.start_time) / 60_000
    evaluations, unread = [], []
    for r, until in zip(used, untils, strict=True):  # the evaluations' replies, by the same rule
        try:
            evaluations += [ev for ev in _evaluations(client, r.info.run_id) if ev["step"] < until]
        except (MlflowException, OSError) as e:
            unread.append(f"{r.info.run_id}: {e}")
    series = {}
    for k, by_step in points.items():
        steps = sorted(by_step)
        series[k] = Series(steps, [by_step[s][0] for s in steps], [by_step[s][1] for s in steps])
    notes = []
    if len(used) > 1:
        notes.append(f"joined from {len(used)} MLflow runs of this name (a resumed run starts a new one); steps a "
                     "later run redid are taken from it, and time between runs is not counted")  # fmt: skip
    if len(used) < len(runs):
        notes.append(f"{len(runs) - len(used)} earlier run(s) of this name were started over from step 0 and are left out")
    if unread:
        notes.append(f"the evaluations' replies could not be read ({'; '.join(unread)})")
    return RunData(name=runs[-1].info.run_name, run_ids=[r.info.run_id for r in used], experiment=experiment,
                   tracking_uri=tracking_uri, status=runs[-1].info.status, params=dict(runs[-1].data.params),
                   series=series, wall_min=offset_min, notes=notes,
                   evaluations=sorted(evaluations, key=lambda e: e["step"]))  # fmt: skip


def _evaluations(client, run_id: str) -> list[dict]:
    """The replies a run's held-out evaluations kept (`Tracker.log_evaluation`); [] for a run that kept none."""
    import tempfile

    if not client.list_artifacts(run_id, "evaluations"):
        return []
    with tempfile.TemporaryDirectory(prefix="dapo-report-") as tmp:
        local = Path(client.download_artifacts(run_id, "evaluations", tmp))
        return [json.loads(f.read_text()) for f in sorted(local.glob("step_*.json"))]


def _runs_named(client, name: str) -> list:
    """The runs called `name` in the experiment of the newest of them, oldest first."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    escaped = name.replace("'", "\\'")
    runs = client.search_runs(experiments, filter_string=f"attributes.run_name = '{escaped}'",
                              order_by=["attributes.start_time ASC"])  # fmt: skip
    if not runs:
        known = sorted({r.info.run_name for r in client.search_runs(experiments, max_results=200)})
        raise ReportError(f"no MLflow run named {name!r} in {client.tracking_uri}; runs there: "
                          f"{', '.join(known) or 'none'} (pass --run-name or --run-id)")  # fmt: skip
    newest = runs[-1].info.experiment_id
    return [r for r in runs if r.info.experiment_id == newest]


# --- the figures -------------------------------------------------------------------------------------

# Colours shared by every figure: the same quantity has the same colour everywhere.
C_ENTROPY, C_ACC, C_PASS = "#7b3294", "#1a9641", "#a6d96a"
C_HIGH, C_LOW, C_SOLVED, C_NONE = "#d7191c", "#2c7bb6", "#fdae61", "#999999"
PHASE_LABELS = {
    "phase/generate_s": ("waiting for the batch (generation not hidden behind training)", "#fdae61"),
    "phase/old_logprob_s": ("old log-probs (trainer forward pass)", "#abd9e9"),
    "phase/update_s": ("gradient updates", "#2c7bb6"),
    "phase/publish_s": ("publishing the new weights (trainer to object store)", "#d7191c"),
    "phase/sync_s": ("replica sync (until every replica serves them)", "#f46d43"),
    "phase/other_s": ("other (shards, checkpoints, probe check)", "#bbbbbb"),
}


def smoothing_window(n: int) -> int:
    """An odd moving-average width of about 5% of the steps (1 = no smoothing for short runs)."""
    w = max(1, min(51, round(n / 20)))
    return w if w % 2 else w + 1


def moving_average(y: list[float], w: int) -> list[float]:
    """Centred moving average over `w` points; near the ends, over the points there are."""
    import numpy as np

    y_N = np.asarray(y, dtype=float)
    if w <= 1 or len(y_N) < 3:
        return list(y_N)
    ok_N = np.isfinite(y_N)
    kernel = np.ones(w)
    total = np.convolve(np.where(ok_N, y_N, 0.0), kernel, mode="same")
    count = np.convolve(ok_N.astype(float), kernel, mode="same")
    return list(np.divide(total, count, out=np.full_like(total, np.nan), where=count > 0))


class _Plotter:
    """Figure helpers bound to one run: its step axis label, smoothing width and k of avg@k."""

    def __init__(self, run: RunData):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.Figure, self.Canvas = Figure, FigureCanvasAgg
        self.run = run
        step_s = run.series.get("timing/step_s") or run.series.get("critic/score/mean")
        self.n_steps = len(step_s.step) if step_s else 0
        self.window = smoothing_window(self.n_steps)
        prompts, n = run.param("trainer.train_batch_size"), run.param("rollout.n")
        self.step_label = f"training step ({prompts} prompts x {n} responses each)" if prompts and n else "training step"
        self.k = run.param("eval.n", "k")

    def figure(self, rows: int, cols: int, title: str, note: str, size: tuple[float, float], smoothed: bool = True,
               widths: tuple[float, ...] | None = None, note_color: str = "#444444"):  # fmt: skip
        fig = self.Figure(figsize=size, layout="constrained")
        self.Canvas(fig)  # PNGs are rendered by Agg, with no GUI backend
        fig.suptitle(f"{title} — run {self.run.name}", fontsize=13, fontweight="bold")
        smoothing = (f"Faint lines: each step's value; bold lines: moving average over {self.window} steps. "
                     if smoothed and self.window > 1 else "")  # fmt: skip
        # A figure-level x label is the one text below the panels that constrained layout makes room for.
        fig.supxlabel(textwrap.fill(smoothing + note, width=int(size[0] * 15)), fontsize=9, color=note_color)
        axes = fig.subplots(rows, cols, squeeze=False, width_ratios=widths)
        return fig, axes.ravel()

    def noisy(self, ax, key: str, label: str, color: str, scale: float = 1.0) -> bool:
        """A per-step metric, raw (faint) and smoothed (bold); False when the run did not log it."""
        s = self.run.series.get(key)
        if not s or not s.step:
            return False
        y = [v * scale for v in s.value]
        if len(s.step) < 5:  # too few points to smooth: show each one
            ax.plot(s.step, y, "o-", color=color, label=label)
            return True
        ax.plot(s.step, y, color=color, alpha=0.25, lw=0.8)
        ax.plot(s.step, moving_average(y, self.window), color=color, lw=2, label=label)
        return True

    def held_out(self, ax, x: str) -> bool:
        """avg@k and pass@k at each evaluation, against "step" or wall "minutes"."""
        avg, pas = self.run.series.get("eval/avg_at_k"), self.run.series.get("eval/pass_at_k")
        if not avg:
            missing(ax, "no held-out evaluation was logged in this run\n(eval.every = 0, or no eval data)")
            return False
        for s, label, color in ((avg, f"avg@{self.k}: mean accuracy of {self.k} samples", C_ACC),
                                (pas, f"pass@{self.k}: solved by at least one of {self.k}", C_PASS)):  # fmt: skip
            if s:
                ax.plot(getattr(s, x), [v * 100 for v in s.value], "o-", color=color, lw=2, label=label)
        if x == "minutes":
            for st, t, v in zip(avg.step, avg.minutes, avg.value, strict=True):
                ax.annotate(f"step {st}", (t, v * 100), textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_ylabel("held-out problems (%)")
        ax.legend(fontsize=8, loc="upper left")
        return True

    def step_axis(self, ax) -> None:
        ax.set_xlabel(self.step_label)
        if ax.has_data():  # steps are whole numbers, also on a run of one or two steps
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        ax.grid(alpha=0.3)

    def save(self, fig, path: Path) -> Path:
        fig.savefig(path, dpi=110)
        return path


def missing(ax, text: str) -> None:
    """An empty panel that says why it is empty."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#888888", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])


def fig_entropy(p: _Plotter, path: Path) -> Path:
    """DAPO Fig. 2: held-out accuracy and the policy's entropy, which Clip-Higher keeps from collapsing."""
    run = p.run
    lo, hi = run.param("algorithm.eps_low", "?"), run.param("algorithm.eps_high", "?")
    fig, (acc, ent) = p.figure(1, 2, "Entropy and held-out accuracy (cf. DAPO Fig. 2)",
                               f"Clip-Higher (eps_high = {hi}, eps_low = {lo}) lets unlikely tokens gain probability: "
                               "entropy should stay clearly above 0 while accuracy rises.", (12, 4.6))  # fmt: skip
    p.held_out(acc, "step")
    acc.set_title(f"Held-out accuracy (avg@{p.k}, pass@{p.k})")
    p.step_axis(acc)
    extra = [k for k in run.series if "entropy" in k and k != "actor/entropy"]  # e.g. a generation entropy
    if p.noisy(ent, "actor/entropy", "policy entropy on the sampled responses (actor/entropy)", C_ENTROPY):
        for k, color in zip(extra, ("#e66101", "#5e3c99"), strict=False):
            p.noisy(ent, k, k, color)
        ent.set_ylim(bottom=0)
        ent.legend(fontsize=8)
    else:
        missing(ent, "actor/entropy was not logged")
    ent.set_title("Entropy of the policy")
    ent.set_ylabel("entropy (nats per token)")
    p.step_axis(ent)
    return p.save(fig, path)


def fig_clip_solve_all(p: _Plotter, path: Path) -> Path:
    """DAPO Fig. 3: tokens clipped at the upper bound and their probability, and prompts every sample
    solved."""
    run = p.run
    lo, hi = run.param("algorithm.eps_low", "eps_low"), run.param("algorithm.eps_high", "eps_high")
    fig, (clip, up, solved) = p.figure(1, 3, "Clipped tokens and all-correct prompts (cf. DAPO Fig. 3)",
                                       "Left: how often the clip of the policy ratio stopped a token's update. Middle: the "
                                       "tokens stopped by the upper bound were unlikely ones, which Clip-Higher's larger bound "
                                       "lets grow. Right: a prompt whose responses are all right (or all wrong) gives zero "
                                       "advantage, hence no gradient; dynamic sampling filters it out.", (17, 4.6))  # fmt: skip
    if p.noisy(clip, "actor/clipfrac_high", f"upper bound: ratio π/π_old above 1 + {hi} (advantage > 0)", C_HIGH, 100):
        p.noisy(clip, "actor/clipfrac_low", f"lower bound: ratio π/π_old below 1 - {lo} (advantage < 0)", C_LOW, 100)
        clip.set_ylim(bottom=0)
        clip.legend(fontsize=8)
    else:
        missing(clip, "actor/clipfrac_high was not logged")
    clip.set_title("Response tokens whose update was clipped")
    clip.set_ylabel("share of response tokens (%)")
    p.step_axis(clip)
    if p.noisy(up, "actor/up_clipped_prob", f"tokens clipped at 1 + {hi}", C_HIGH, 1):
        up.set_ylim(0, 1)
        up.legend(fontsize=8)
    else:
        missing(up, "actor/up_clipped_prob was not logged\n(no token was clipped at the upper bound)")
    up.set_title("Mean probability of the up-clipped tokens")
    up.set_ylabel("probability under the policy that sampled them")
    p.step_axis(up)
    if p.noisy(solved, "rollout/solve_all_ratio", "every response correct", C_SOLVED, 100):
        p.noisy(solved, "rollout/solve_none_ratio", "every response wrong", C_NONE, 100)
        solved.set_ylim(0, 100)
        solved.legend(fontsize=8)
    else:
        missing(solved, "rollout/solve_all_ratio was not logged")
    solved.set_title(f"Generated prompts whose {run.param('rollout.n', 'n')} responses all agree")
    solved.set_ylabel("share of generated prompts (%)")
    p.step_axis(solved)
    return p.save(fig, path)


def fig_training_curves(p: _Plotter, path: Path) -> Path:
    """DAPO Fig. 7: length, reward, entropy and token probability, plus held-out accuracy, per step; its note
    is the hack alarm (`alarm_note`) where it was up."""
    run = p.run
    alarm = alarm_note(run)  # the curves may then measure a reward hack: no "healthy" reading of them
    fig, axes = p.figure(2, 3, "Training curves (cf. DAPO Fig. 7)",
                         alarm or "Healthy: reward and held-out accuracy rise together, length stays below the limit "
                         "with few truncations, entropy neither collapses to 0 nor explodes.", (15, 8.2),
                         note_color="#d7191c" if alarm else "#444444")  # fmt: skip
    limit = run.param("rollout.max_response_length")
    panels = [
        ("response_length/mean", "Mean response length", "tokens", "#2c7bb6", 1),
        ("response_length/clip_ratio", "Responses cut off at the length limit", "share of responses (%)", "#d7191c", 100),
        ("critic/score/mean", "Mean reward", "reward per response (+1 right, -1 wrong)", "#1a9641", 1),
        ("actor/entropy", "Entropy of the policy", "entropy (nats per token)", C_ENTROPY, 1),
        ("actor/mean_token_prob", "Mean probability of the sampled tokens (rollout policy)", "probability", "#e66101", 1),
    ]  # fmt: skip
    for ax, (key, title, ylabel, color, scale) in zip(axes, panels, strict=False):
        if p.noisy(ax, key, f"MLflow metric {key}", color, scale):
            ax.legend(fontsize=8)
        else:
            missing(ax, f"{key} was not logged")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        p.step_axis(ax)
    if limit and "response_length/mean" in run.series:
        axes[0].axhline(limit, color="#888888", ls="--", lw=1, label=f"limit: {limit} tokens")
        axes[0].set_ylim(0, limit * 1.08)
        axes[0].legend(fontsize=8)
    if score := run.series.get("critic/score/mean"):  # the overlong penalty can take it below -1
        axes[2].set_ylim(min(-1.1, min(score.value) - 0.1), max(1.1, max(score.value) + 0.1))
    if "actor/entropy" in run.series:
        axes[3].set_ylim(bottom=0)
    p.held_out(axes[5], "step")
    axes[5].set_title("Held-out accuracy")
    p.step_axis(axes[5])
    return p.save(fig, path)


def fig_accuracy_time(p: _Plotter, path: Path) -> Path:
    """Held-out accuracy against wall-clock minutes (from the MLflow metric timestamps)."""
    fig, (ax,) = p.figure(1, 1, "Held-out accuracy against wall-clock time",
                          "Time is read from the MLflow metric timestamps, from the start of tracking (just before the "
                          "evaluation before training); it includes evaluation. Where the curve flattens, more time buys "
                          "little.", (9, 5), smoothed=False)  # fmt: skip
    p.held_out(ax, "minutes")
    ax.set_xlabel("wall-clock time since tracking started (minutes)")
    if avg := p.run.series.get("eval/avg_at_k"):
        ax.set_xlim(0, max(avg.minutes) * 1.1 or 1)  # room for the last point's label
    ax.grid(alpha=0.3)
    return p.save(fig, path)


def fig_dynamic_sampling(p: _Plotter, path: Path) -> Path:
    """Dynamic sampling (DAPO Eq. 11): groups generated and kept, and generation rounds, per step."""
    run = p.run
    cap = run.param("algorithm.max_gen_rounds")
    off = "Dynamic sampling is off in this run: every generated group is trained. " if run.param(
        "algorithm.dynamic_sampling") is False else ""  # fmt: skip
    fig, (groups, rounds) = p.figure(1, 2, "Dynamic sampling: generate until the batch is full of useful groups",
                                     off + "A group is one prompt with its responses; it is kept when some responses are right "
                                     "and some wrong. Rounds grow as more prompts become all-right (or all-wrong).",
                                     (12, 4.6))  # fmt: skip
    if p.noisy(groups, "dynamic_sampling/generated_groups", "generated", "#999999"):
        p.noisy(groups, "dynamic_sampling/kept_groups", "kept (some right, some wrong)", "#1a9641")
        batch = run.param("trainer.train_batch_size")
        if batch:
            groups.axhline(batch, color="#2c7bb6", ls="--", lw=1, label=f"batch size: {batch} groups")
        groups.set_ylim(bottom=0)
        groups.legend(fontsize=8)
    else:
        missing(groups, "dynamic_sampling/* was not logged")
    groups.set_title("Groups (prompts) per step")
    groups.set_ylabel("groups per step")
    p.step_axis(groups)
    if p.noisy(rounds, "dynamic_sampling/rounds", "generation rounds", "#e66101"):
        part = run.series.get("dynamic_sampling/partial")
        per_step = dict(zip(run.series["dynamic_sampling/rounds"].step, run.series["dynamic_sampling/rounds"].value,
                            strict=True))  # fmt: skip
        if part and (hits := [(s, per_step.get(s, cap or 1)) for s, v in zip(part.step, part.value, strict=True) if v > 0]):
            rounds.plot(*zip(*hits, strict=True), "x", color="#d7191c", ms=8, mew=2, clip_on=False,
                        label=f"cap hit, trained on a partial batch: {len(hits)} of {len(part.step)} steps")  # fmt: skip
        if cap:
            rounds.axhline(cap, color="#888888", ls="--", lw=1, label=f"cap: {cap} rounds")
        rounds.set_ylim(0, max(cap or 0, *per_step.values()) + 0.5)
        rounds.yaxis.get_major_locator().set_params(integer=True)
        rounds.legend(fontsize=8)
    else:
        missing(rounds, "dynamic_sampling/rounds was not logged")
    rounds.set_title("Generation rounds per step")
    rounds.set_ylabel("rounds")
    p.step_axis(rounds)
    return p.save(fig, path)


def fig_step_time(p: _Plotter, path: Path) -> Path:
    """Where a step's wall time goes: the phase/* metrics, which sum to timing/step_s."""
    import numpy as np

    run = p.run
    phases = [k for k in PHASE_LABELS if k in run.series]
    steps = run.series[phases[0]].step if phases else []
    few = len(steps) < 20  # bars per step; a stacked area over a handful of points is unreadable
    if not phases:
        note = "This run did not log the phase/* split (written by an older version): only the whole step's time is shown."
    elif few:
        note = "Each bar is one step, its phases stacked."
    else:
        note = f"Coloured bands: each phase's moving average over {p.window} steps, stacked; grey line: each step's total."
    if phases:
        note += (" The phases are on the critical path and add up to the step time; 'waiting for the batch' near 0 "
                 "means generation is hidden behind the previous step's training.")  # fmt: skip
    fig, (area, bars) = p.figure(1, 2, "Where a training step's time goes", note, (15, 5.4), smoothed=not phases,
                                 widths=(3, 2))  # fmt: skip
    area.set_title("Seconds per step, by phase" if phases else "Seconds per step")
    area.set_ylabel("seconds")
    if not phases:  # runs logged before the phase split: the whole step only
        if p.noisy(area, "timing/step_s", "whole step (timing/step_s)", "#555555"):
            area.set_ylim(bottom=0)
            area.legend(fontsize=8)
        else:
            missing(area, "timing/step_s was not logged")
        p.step_axis(area)
        missing(bars, "the phase/* split was not logged in this run")
        return p.save(fig, path)

    labels, colors = [PHASE_LABELS[k][0].split(" (")[0] for k in phases], [PHASE_LABELS[k][1] for k in phases]
    if few:
        bottom = np.zeros(len(steps))
        for k, label, color in zip(phases, labels, colors, strict=True):
            y = np.clip(np.nan_to_num(_on_steps(run.series[k], steps)), 0, None)
            area.bar(steps, y, bottom=bottom, color=color, label=label, width=0.8)
            bottom += y
    else:
        ys = [np.clip(moving_average(_on_steps(run.series[k], steps), p.window), 0, None) for k in phases]
        area.stackplot(steps, ys, labels=labels, colors=colors, alpha=0.9)
        if total := run.series.get("timing/step_s"):
            area.plot(total.step, total.value, color="black", alpha=0.3, lw=0.8, label="whole step, each step")
    area.set_ylim(bottom=0)
    p.step_axis(area)
    area.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)

    split = phase_split(run)
    names = [PHASE_LABELS[k][0] for k in split][::-1]
    shares = [v["share"] * 100 for v in split.values()][::-1]
    bars.barh(names, shares, color=[PHASE_LABELS[k][1] for k in split][::-1])
    for i, v in enumerate(reversed(split.values())):
        bars.text(shares[i] + 1, i, f"{shares[i]:.0f}%  (median {v['median_s']:.2f} s)", va="center", fontsize=8)
    bars.set_xlim(0, max(shares) + 40)  # room for the labels
    bars.set_xlabel("share of all training-step time (%)")
    total = run.series.get("timing/step_s")
    bars.set_title(f"Share of the run's step time (median step {statistics.median(total.value):.2f} s)"
                   if total else "Share of the run's step time")  # fmt: skip
    bars.tick_params(axis="y", labelsize=8)
    return p.save(fig, path)


def _on_steps(s: Series, steps: list[int]) -> list[float]:
    by_step = dict(zip(s.step, s.value, strict=True))
    return [by_step.get(st, math.nan) for st in steps]


# --- the summary -------------------------------------------------------------------------------------


def alarm_points(run: RunData) -> dict[str, list[tuple[int, float]]]:
    """Where the hack alarm was up (`dapo_ray.replies.alarm_up` with the run's reward.alarm_share):
    {"held-out evaluation": [(step, share of rewarded replies not stating the reference)], "step": [...]}.
    Where the count of rewarded replies was not logged, the share alone decides."""
    share = run.param("reward.alarm_share", 0.2)
    out = {}
    for where, ratio_key, count_key in (("held-out evaluation", "eval/unstated_rewarded_ratio", "eval/rewarded_samples"),
                                        ("step", "reward/unstated_rewarded_ratio", "reward/rewarded_responses")):  # fmt: skip
        counts = _by_step(run, count_key)
        out[where] = [(st, v) for st, v in _by_step(run, ratio_key).items()
                      if alarm_up(v, counts.get(st, ALARM_MIN_REWARDED), share)]  # fmt: skip
    return out


def alarm_note(run: RunData) -> str:
    """A sentence on the hack alarm when it was up at some evaluation or step; "" when it never was."""
    points = alarm_points(run)
    if not any(points.values()):
        return ""
    at = " and ".join(f"{len(v)} {where}{'s' if len(v) > 1 else ''} (first at step {v[0][0]}: {v[0][1]:.0%})"
                      for where, v in points.items() if v)  # fmt: skip
    return (f"HACK ALARM at {at}: more than {run.param('reward.alarm_share', 0.2):.0%} of the replies the scorer "
            "rewarded did not state the reference answer. The reward may pay something other than right answers, "
            "and these curves may measure a reward hack rather than learning: read the replies (summary.md, "
            "'What the model says').")  # fmt: skip


def replies_section(run: RunData) -> list[str]:
    """"What the model says": per evaluation, the share of rewarded replies not stating the reference
    answer; the commonest reply shapes at the first and the last evaluation; every evaluation's sample of
    replies."""
    k = run.param("eval.n", "k")
    lines = ["", "## What the model says", ""]
    ratio = run.series.get("eval/unstated_rewarded_ratio")
    if not ratio:
        return lines + ["The held-out evaluations of this run kept no replies (no evaluation, or written by a "
                        "version of dapo-ray before they did)."]  # fmt: skip
    avg, count = _by_step(run, "eval/avg_at_k"), _by_step(run, "eval/rewarded_samples")
    lines += [f"Replies judged right that do not state the reference answer (`states_reference`): a reward that pays "
              f"them pays something other than right answers. The hack alarm is up above "
              f"{run.param('reward.alarm_share', 0.2):.0%} (reward.alarm_share) of at least {ALARM_MIN_REWARDED} "
              "rewarded replies.", "",
              f"| step | avg@{k} | samples judged right | of them not stating the reference |", "|---|---|---|---|"]  # fmt: skip
    for st, v in zip(ratio.step, ratio.value, strict=True):
        a = f"{avg[st]:.1%}" if st in avg else "-"
        lines.append(f"| {st} | {a} | {int(count[st]) if st in count else '-'} | {v:.1%} |")
    evals = run.evaluations
    if not evals:
        return lines + ["", "The replies themselves were not stored with this run (MLflow `evaluations/` artifacts)."]
    shown = [(evals[0], "first evaluation")] + ([(evals[-1], "last evaluation")] if len(evals) > 1 else [])
    for e, which in shown:
        lines += ["", f"### Commonest reply shapes at step {e['step']} ({which})", "",
                  "Each reply on one line, digits written N, out of all the evaluation's replies:", "",
                  shapes_table(e["shapes"])]  # fmt: skip
    for i, e in enumerate(evals):  # every evaluation's sample, in full
        which = " (first evaluation)" if i == 0 else " (last evaluation)" if i == len(evals) - 1 else ""
        lines += ["", f"### Replies at step {e['step']}{which}", "",
                  f"The first reply of each of the first {len(e['replies'])} problems:", "", replies_table(e["replies"])]  # fmt: skip
    return lines


def sources_section(run: RunData) -> list[str]:
    """Held-out accuracy per data_source (a benchmark's modules: `eval/avg_at_k/<source>`) at every
    evaluation; nothing when the eval set had one source."""
    prefix = "eval/avg_at_k/"
    sources = sorted(key.removeprefix(prefix) for key in run.series if key.startswith(prefix))
    if not sources:
        return []
    by_source = {s: _by_step(run, prefix + s) for s in sources}
    steps = sorted({st for v in by_source.values() for st in v})
    k = run.param("eval.n", "k")
    lines = ["", "## Held-out accuracy per source", "", f"avg@{k} of each data_source's problems, by step:", "",
             "| source | " + " | ".join(f"step {st}" for st in steps) + " |", "|---|" + "---|" * len(steps)]  # fmt: skip
    for s, v in by_source.items():
        lines.append(f"| {s} | " + " | ".join(f"{v[st]:.1%}" if st in v else "-" for st in steps) + " |")
    return lines


def _by_step(run: RunData, key: str) -> dict[int, float]:
    s = run.series.get(key)
    return dict(zip(s.step, s.value, strict=True)) if s else {}


def phase_split(run: RunData) -> dict[str, dict[str, float]]:
    """Per phase: its median seconds per step and its share of the summed step time."""
    sums = {k: sum(v for v in run.series[k].value if math.isfinite(v)) for k in PHASE_LABELS if k in run.series}
    total = sum(max(v, 0.0) for v in sums.values()) or 1.0
    return {k: {"median_s": statistics.median(run.series[k].value), "share": max(v, 0.0) / total}
            for k, v in sums.items()}  # fmt: skip


SWITCHES = [
    ("Clip-Higher: eps_low / eps_high (Eq. 10)", ("algorithm.eps_low", "algorithm.eps_high")),
    ("Dynamic sampling (Eq. 11): on, max rounds, at the cap", ("algorithm.dynamic_sampling", "algorithm.max_gen_rounds",
                                                               "algorithm.on_cap")),
    ("Generation beside training: max_policy_lag, carry_over", ("algorithm.max_policy_lag", "algorithm.carry_over")),
    ("Loss aggregation (Eq. 12)", ("algorithm.loss_agg_mode",)),
    ("Policy loss; advantage divided by the group std", ("algorithm.policy_loss", "algorithm.adv_std_norm")),
    ("Rollout correction: level, threshold, mode", ("algorithm.rollout_is", "algorithm.rollout_is_threshold",
                                                    "algorithm.rollout_is_mode")),
    ("Overlong filtering", ("algorithm.overlong_filter",)),
    ("Soft overlong punishment (Eq. 13): on, cache length", ("algorithm.soft_overlong", "algorithm.overlong_cache_length")),
    ("KL coefficient", ("algorithm.kl_coef",)),
    ("Reward: the built-in tasks' mode / a function of your own", ("reward.mode", "reward.function")),
    ("Model", ("rollout.model_path",)),
    ("Prompts x responses per step; most prompts per generation round", ("trainer.train_batch_size", "rollout.n",
                                                                         "trainer.gen_batch_size")),
    ("Max response length; temperature", ("rollout.max_response_length", "rollout.temperature")),
    ("Learning rate; total steps", ("trainer.lr", "trainer.total_steps")),
    ("Evaluation: samples per problem, every N steps", ("eval.n", "eval.every")),
]  # fmt: skip

FIGURES = [
    ("fig2_entropy.png", fig_entropy, "Entropy and held-out accuracy (paper Fig. 2)",
     "Clip-Higher keeps entropy from collapsing: look for entropy staying clearly above 0 while accuracy rises."),
    ("fig3_clip_solve_all.png", fig_clip_solve_all, "Clipped tokens and all-correct prompts (paper Fig. 3)",
     "Few tokens clipped at the raised upper bound; a growing share of all-correct prompts is what dynamic "
     "sampling filters out."),
    ("fig7_training_curves.png", fig_training_curves, "Training curves (paper Fig. 7)",
     "Reward and held-out accuracy should rise together, with length below the limit and entropy steady."),
    ("accuracy_vs_time.png", fig_accuracy_time, "Held-out accuracy against wall-clock time",
     "How fast the run learns in real time (MLflow metric timestamps, evaluation included); a flat tail means "
     "more time buys little."),
    ("dynamic_sampling.png", fig_dynamic_sampling, "Dynamic sampling",
     "Kept groups should reach the batch size each step; more rounds mean more prompts were all-right or all-wrong."),
    ("step_time.png", fig_step_time, "Where a step's time goes",
     "The biggest band is where to optimise; 'waiting for the batch' near 0 means generation is overlapped."),
]  # fmt: skip


def summary_markdown(run: RunData, pngs: list[tuple[str, str, str]]) -> str:
    """The run in a page: what was run, how it went, and links to the figures."""
    s = run.series
    steps = s.get("timing/step_s") or s.get("critic/score/mean")
    n_steps = len(steps.step) if steps else 0
    lines = [f"# Run report: {run.name}", ""]
    lines += [f"- MLflow: experiment `{run.experiment}`, run {', '.join(f'`{i}`' for i in run.run_ids)} "
              f"({run.status.lower()}), store `{run.tracking_uri}`"]  # fmt: skip
    lines += [f"- Note: {n}" for n in run.notes]
    total = run.param("trainer.total_steps")
    if steps:
        lines.append(f"- Steps: {n_steps} logged, last step {steps.step[-1]}" + (f" of {total}" if total else ""))
    else:
        lines.append("- Steps: none logged yet")
    step_sum = sum(s["timing/step_s"].value) / 60 if "timing/step_s" in s else None
    lines.append(f"- Wall time: {run.wall_min:.1f} min tracked (MLflow run start to its last metric)"
                 + (f"; training steps alone {step_sum:.1f} min (sum of timing/step_s)" if step_sum else ""))  # fmt: skip
    if n_steps and n_steps < 10:
        lines.append(f"- Only {n_steps} step{'s' if n_steps > 1 else ''}: too few to show trends.")
    if alarm := alarm_note(run):
        lines.append(f"- **{alarm}**")

    lines += ["", "## Key switches", "", "| | value |", "|---|---|"]
    for label, keys in SWITCHES:
        lines.append(f"| {label} | {' / '.join(run.params.get(k, '(not logged)') for k in keys)} |")

    k = run.param("eval.n", "k")
    lines += ["", "## Held-out accuracy", ""]
    avg, pas = s.get("eval/avg_at_k"), s.get("eval/pass_at_k")
    if not avg:
        lines.append("No held-out evaluation was logged in this run (eval.every = 0, or no eval data).")
    else:
        best = max(range(len(avg.value)), key=avg.value.__getitem__)
        lines.append(f"avg@{k} {avg.value[0]:.1%} at step {avg.step[0]} -> {avg.value[-1]:.1%} at step {avg.step[-1]} "
                     f"(best {avg.value[best]:.1%} at step {avg.step[best]}).")  # fmt: skip
        pass_at = dict(zip(pas.step, pas.value, strict=True)) if pas else {}
        lines += ["", f"| step | wall time | avg@{k} | pass@{k} |", "|---|---|---|---|"]
        for st, t, v in zip(avg.step, avg.minutes, avg.value, strict=True):
            p = f"{pass_at[st]:.1%}" if st in pass_at else "-"
            lines.append(f"| {st} | {t:.1f} min | {v:.1%} | {p} |")
    lines += sources_section(run)
    lines += replies_section(run)

    lines += ["", "## Dynamic sampling", ""]
    if "dynamic_sampling/generated_groups" in s:
        def tot(key: str) -> int:
            return int(sum(s[key].value)) if key in s else 0

        gen, kept = tot("dynamic_sampling/generated_groups"), tot("dynamic_sampling/kept_groups")
        text = f"Kept {kept} of {gen} generated groups ({kept / max(gen, 1):.1%}) in {tot('dynamic_sampling/rounds')} rounds"
        parts = [f"{what}: {tot(key)}" for key, what in (
            ("dynamic_sampling/filtered", "groups filtered out (all right or all wrong)"),
            ("dynamic_sampling/surplus_dropped", "surplus groups dropped"),
            ("dynamic_sampling/stale_dropped", "groups dropped as older than max_policy_lag"),
            ("dynamic_sampling/partial", "steps trained on a partial batch (cap hit)")) if key in s]  # fmt: skip
        rest = "; ".join(parts)
        lines.append(f"{text}. {rest[:1].upper()}{rest[1:]}" + ("." if parts else ""))
    else:
        lines.append("Dynamic sampling metrics were not logged in this run.")

    lines += ["", "## Step time", ""]
    if "timing/step_s" in s:
        lines.append(f"Median step {statistics.median(s['timing/step_s'].value):.2f} s.")
        lines.append("")
    split = phase_split(run)
    if split:
        lines += ["", "| phase | median per step | share of step time |", "|---|---|---|"]
        for key, v in split.items():
            lines.append(f"| {PHASE_LABELS[key][0]} | {v['median_s']:.2f} s | {v['share']:.0%} |")
    else:
        lines.append("The phase/* split was not logged in this run.")

    lines += ["", "## Figures", ""]
    for name, title, caption in pngs:
        lines += [f"### {title}", "", caption, "", f"![{title}]({name})", ""]
    return "\n".join(lines)


def write_report(run: RunData, out: Path) -> Path:
    """The figures and `summary.md` into `out`; returns the markdown's path."""
    out.mkdir(parents=True, exist_ok=True)
    plotter = _Plotter(run)
    pngs = []
    for name, draw, title, caption in FIGURES:
        draw(plotter, out / name)
        pngs.append((name, title, caption))
    md = out / "summary.md"
    md.write_text(summary_markdown(run, pngs))
    return md


# --- the command -------------------------------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    try:
        uri, name, out = resolve_source(args.run_dir, args.tracking_uri, args.run_name, args.run_id, args.out)
        run = load_run(uri, run_name=name, run_id=args.run_id)
        md = write_report(run, out)
    except ReportError as e:
        print(f"dapo-ray report: error: {e}", file=sys.stderr)
        return 1
    print(f"[report] {run.name}: {len(FIGURES)} figures and {md}")
    return 0


def add_parser(sub) -> None:
    """Register `dapo-ray report` on the CLI's subparsers."""
    rp = sub.add_parser("report", help="plot a run's metrics like the DAPO paper's figures, with a markdown summary")
    rp.add_argument("run_dir", nargs="?", help="the run's trainer.output_dir (holding mlflow.db)")
    rp.add_argument("--tracking-uri", help="an MLflow tracking URI instead of RUN_DIR/mlflow.db")
    which = rp.add_mutually_exclusive_group()
    which.add_argument("--run-name", help="MLflow run name (default: RUN_DIR's name, as the trainer names runs)")
    which.add_argument("--run-id", help="one MLflow run id")
    rp.add_argument("--out", help="output directory (default: RUN_DIR/report, else ./report-NAME)")
    rp.set_defaults(func=_report)
