"""`dapo-ray report`: figures and summary from small MLflow SQLite runs written with the real metric names
(through MlflowClient with set timestamps, and through the trainer's own Tracker)."""

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_ray import cli
from dapo_ray.metrics import METRICS, Tracker, end_failed_run
from dapo_ray.report import FIGURES, alarm_note, load_run, resolve_source

PHASES = {"phase/generate_s": 0.2, "phase/old_logprob_s": 0.3, "phase/update_s": 1.0, "phase/publish_s": 0.1,
          "phase/sync_s": 0.3, "phase/other_s": 0.1}  # fmt: skip
PARAMS = {"algorithm.eps_low": 0.2, "algorithm.eps_high": 0.28, "algorithm.dynamic_sampling": True,
          "algorithm.max_gen_rounds": 4, "trainer.train_batch_size": 16, "rollout.n": 16, "eval.n": 8,
          "rollout.max_response_length": 24, "trainer.total_steps": 40}  # fmt: skip
T0 = 1_700_000_000_000  # ms


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite file with its tables made (a few seconds, once); each test copies it."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def new_db(empty_store):
    def copy(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(empty_store, path))

    return copy


def step_metrics(step: int) -> dict[str, float]:
    """One step's metrics: steady phases (2.0 s a step), 30 groups generated and 18 kept in 1 or 2 rounds."""
    return {
        "critic/score/mean": -0.6 + step / 40, "actor/entropy": 0.3 - step / 400, "actor/mean_token_prob": 0.9,
        "actor/clipfrac_high": 0.004, "actor/clipfrac_low": 0.02, "rollout/solve_all_ratio": step / 100,
        "rollout/solve_none_ratio": 0.3, "response_length/mean": 12.0, "response_length/clip_ratio": 0.01,
        "dynamic_sampling/generated_groups": 30, "dynamic_sampling/kept_groups": 18, "dynamic_sampling/filtered": 12,
        "dynamic_sampling/rounds": 2 if step % 5 == 0 else 1, "dynamic_sampling/partial": float(step == 7),
        "timing/step_s": 2.0, **PHASES,
    } | ({"actor/up_clipped_prob": 0.15} if step % 3 else {})  # fmt: skip


def eval_metrics(step: int) -> dict[str, float]:
    return {"eval/avg_at_k": 0.1 + step / 100, "eval/pass_at_k": 0.5 + step / 200, "eval/rewarded_samples": 13,
            "eval/unstated_rewarded_ratio": 0.0}  # fmt: skip


def write_run(db: Path, name: str, steps: range, eval_every: int, start_ms: int = T0, step_ms: int = 3000) -> str:
    """A run as the driver logs one, with metric timestamps `step_ms` apart; returns its id."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("dapo-ray-test")
    exp_id = exp.experiment_id if exp else client.create_experiment("dapo-ray-test")
    run_id = client.create_run(exp_id, run_name=name, start_time=start_ms).info.run_id
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in PARAMS.items()])
    t = start_ms + 1000
    metrics = [Metric(k, v, t, 0) for k, v in eval_metrics(0).items()] if eval_every and steps.start == 1 else []
    for step in steps:
        t += step_ms
        metrics += [Metric(k, v, t, step) for k, v in step_metrics(step).items()]
        if eval_every and step % eval_every == 0:
            metrics += [Metric(k, v, t + 500, step) for k, v in eval_metrics(step).items()]
    for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
        client.log_batch(run_id, metrics=metrics[i : i + 1000])
    client.set_terminated(run_id, end_time=t + 1000)
    return run_id


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    return struct.unpack(">II", data[16:24])


def report(run_dir: Path, *extra: str) -> Path:
    assert cli.main(["report", str(run_dir), *extra]) == 0
    return run_dir / "report"


def test_metric_names_are_the_registered_ones():
    assert set(step_metrics(1)) | set(eval_metrics(0)) <= set(METRICS)


def test_report_of_a_run_directory(tmp_path, new_db):
    run_dir = tmp_path / "demo"
    write_run(new_db(run_dir / "mlflow.db"), "demo", range(1, 41), eval_every=10)
    out = report(run_dir)

    for name, *_ in FIGURES:
        w, h = png_size(out / name)
        assert w >= 900 and h >= 500 and (out / name).stat().st_size > 20_000, name
    md = (out / "summary.md").read_text()
    assert "# Run report: demo" in md
    assert "Steps: 40 logged, last step 40 of 40" in md
    # 1 s to the first evaluation, 40 steps 3 s apart, the last evaluation 0.5 s later: 121.5 s.
    assert "Wall time: 2.0 min tracked" in md and "training steps alone 1.3 min" in md
    assert "| Clip-Higher: eps_low / eps_high (Eq. 10) | 0.2 / 0.28 |" in md
    assert "avg@8 10.0% at step 0 -> 50.0% at step 40 (best 50.0% at step 40)" in md
    assert "| 20 | 1.0 min | 30.0% | 60.0% |" in md  # 1 s + 20 x 3 s + 0.5 s
    assert "## What the model says" in md and "| 20 | 30.0% | 13 | 0.0% |" in md
    assert "The replies themselves were not stored with this run" in md  # no evaluations/ artifacts: still a report
    assert "HACK ALARM" not in md
    assert "Kept 720 of 1200 generated groups (60.0%) in 48 rounds" in md
    assert "filtered out (all right or all wrong): 480;" in md and "trained on a partial batch (cap hit): 1." in md
    assert "Median step 2.00 s." in md
    assert "| gradient updates | 1.00 s | 50% |" in md
    for name, *_ in FIGURES:
        assert f"]({name})" in md


@pytest.mark.parametrize("steps", [0, 1])
def test_a_short_run_without_evaluation_written_by_the_tracker(tmp_path, new_db, steps):
    run_dir = tmp_path / "short"
    uri = f"sqlite:///{new_db(run_dir / 'mlflow.db')}"
    tracker = Tracker(True, uri, "dapo-ray-test", "short", PARAMS)
    for step in range(1, steps + 1):
        tracker.log(step_metrics(step), step=step)
    tracker.close()
    out = report(run_dir)

    for name, *_ in FIGURES:
        png_size(out / name)
    md = (out / "summary.md").read_text()
    assert "No held-out evaluation was logged in this run" in md
    if steps:
        assert "Only 1 step: too few to show trends." in md and "Kept 18 of 30 generated groups" in md
    else:
        assert "Steps: none logged yet" in md


def test_a_run_whose_reward_pays_restated_questions_raises_the_alarm(tmp_path, new_db, monkeypatch):
    """The replies of the evaluations (Tracker.log_evaluation) in summary.md, and the hack alarm in place of
    the training curves' "healthy" note: from step 5 on, most rewarded replies restate the question."""
    import dapo_ray.report as report_module

    def said(step: int, reply: str, states: bool) -> dict:
        sample = [{"uid": f"p:{i}", "problem": f"What is {i} + 3?", "ground_truth": str(i + 3), "reply": reply.format(i, i + 3),
                   "pred": str(i + 3), "acc": True, "states_reference": states} for i in range(10, 13)]  # fmt: skip
        shape = "Answer: N" if states else "N + N = ?"
        return {"step": step, "k": 8, "avg_at_k": 0.5, "unstated_rewarded_ratio": 0.0 if states else 0.9,
                "rewarded_samples": 40, "shapes": [{"shape": shape, "share": 0.9, "count": 90}], "replies": sample}  # fmt: skip

    run_dir = tmp_path / "hacked"
    tracker = Tracker(True, f"sqlite:///{new_db(run_dir / 'mlflow.db')}", "dapo-ray-test", "hacked", PARAMS)
    for step in range(0, 11):
        hacked = step >= 5
        if step:
            tracker.log(step_metrics(step) | {"reward/rewarded_responses": 100,
                                              "reward/unstated_rewarded_ratio": 0.6 if hacked else 0.0}, step=step)  # fmt: skip
        if step % 5 == 0:
            record = said(step, "{0} + 3 = ?<|im_end|>" if hacked else "Answer: {1}", not hacked)
            tracker.log(eval_metrics(step) | {"eval/unstated_rewarded_ratio": record["unstated_rewarded_ratio"],
                                              "eval/rewarded_samples": 40}, step=step)  # fmt: skip
            tracker.log_evaluation(record, step=step)
    tracker.close()

    run = load_run(f"sqlite:///{run_dir / 'mlflow.db'}", run_name="hacked")
    assert [e["step"] for e in run.evaluations] == [0, 5, 10]
    # The run's page shows one table of the replies, each evaluation's appended with its step.
    from mlflow import MlflowClient

    table = MlflowClient(run.tracking_uri).download_artifacts(run.run_ids[0], "evaluations/replies.json", str(tmp_path))
    table = json.loads(Path(table).read_text())
    assert [row[table["columns"].index("step")] for row in table["data"]] == [0, 0, 0, 5, 5, 5, 10, 10, 10]
    note = alarm_note(run)
    assert note.startswith("HACK ALARM at 2 held-out evaluations (first at step 5: 90%) and 6 steps (first at step 5: "
                           "60%): more than 20% of the replies the scorer rewarded did not state the reference answer")  # fmt: skip
    notes = []
    figure = report_module._Plotter.figure
    monkeypatch.setattr(report_module._Plotter, "figure", lambda self, r, c, title, note, *a, **kw: (
        notes.append((title, note)), figure(self, r, c, title, note, *a, **kw))[1])  # fmt: skip
    md = (report(run_dir) / "summary.md").read_text()
    assert dict(notes)["Training curves (cf. DAPO Fig. 7)"] == note

    top = md.split("## Key switches")[0]
    assert f"- **{note}**" in top
    section = md.split("## What the model says")[1].split("## Dynamic sampling")[0]
    assert "| 5 | 15.0% | 40 | 90.0% |" in section
    assert "### Commonest reply shapes at step 0 (first evaluation)" in section
    assert "### Commonest reply shapes at step 10 (last evaluation)" in section and "| 90.0% | 90 | N + N = ? |" in section
    assert "### Replies at step 10 (last evaluation)" in section
    assert "| What is 10 + 3? | 13 | 10 + 3 = ?&lt;\\|im_end\\|> | 13 | right | no |" in section
    assert "| What is 12 + 3? | 15 | Answer: 15 | 15 | right | yes |" in section  # step 0's sample


def test_a_resumed_run_is_joined_by_step(tmp_path, new_db):
    db = new_db(tmp_path / "mlflow.db")
    write_run(db, "demo", range(1, 16), eval_every=10)  # checkpoint at step 10, stopped at 15
    write_run(db, "demo", range(11, 21), eval_every=10, start_ms=T0 + 3_600_000)  # resumed an hour later
    run = load_run(f"sqlite:///{db}", run_name="demo")

    assert len(run.run_ids) == 2 and "joined from 2 MLflow runs" in run.notes[0]
    assert run.series["timing/step_s"].step == list(range(1, 21))
    assert run.series["eval/avg_at_k"].step == [0, 10, 20]
    # The first run counts up to its step 10 (31.5 s), the second from its start to step 20 (31.5 s).
    assert run.wall_min == pytest.approx(63 / 60)
    assert run.series["eval/avg_at_k"].minutes[-1] == pytest.approx(63 / 60)


def test_a_run_by_id_from_a_tracking_uri(tmp_path, new_db):
    db = new_db(tmp_path / "store.db")
    write_run(db, "first", range(1, 6), eval_every=0)
    run_id = write_run(db, "second", range(1, 6), eval_every=5)
    uri, name, out = resolve_source(None, f"sqlite:///{db}", None, run_id, None)
    assert (name, out) == (None, Path(f"report-{run_id}"))
    run = load_run(uri, run_id=run_id)
    assert run.name == "second" and run.run_ids == [run_id] and run.series["eval/avg_at_k"].step == [0, 5]


def test_unknown_directory_store_or_run_is_a_clear_error(tmp_path, new_db, capsys):
    assert cli.main(["report", str(tmp_path / "nope")]) == 1
    assert "no run directory at" in capsys.readouterr().err

    assert cli.main(["report", str(tmp_path)]) == 1
    assert "has no mlflow.db" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()

    write_run(new_db(tmp_path / "mlflow.db"), "other", range(1, 3), eval_every=0)
    assert cli.main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"no MLflow run named {tmp_path.name!r}" in err and "other" in err

    assert cli.main(["report", "--tracking-uri", f"sqlite:///{tmp_path / 'missing.db'}", "--run-name", "x"]) == 1
    assert "no MLflow database at" in capsys.readouterr().err


def test_importing_the_module_loads_neither_matplotlib_nor_mlflow():
    code = "import sys, dapo_ray.report; print(sorted(m for m in ('matplotlib', 'mlflow', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_artifacts_stay_beside_the_store_not_in_the_working_directory(tmp_path, new_db, monkeypatch):
    """A job's working directory is its uploaded checkout: MLflow's default artifact root (./mlruns) would
    write the config, report and model there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run_dir = tmp_path / "run"
    uri = f"sqlite:///{new_db(run_dir / 'mlflow.db')}"
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")

    tracker = Tracker(True, uri, "dapo-ray-test", "artifacts", PARAMS, config_yaml="a: 1\n")
    tracker.log_artifacts(str(tmp_path / "model"), "final_model")
    run_id = tracker.run.info.run_id
    tracker.close()

    assert list(cwd.iterdir()) == []
    stored = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()}
    assert any(s.startswith("mlartifacts/") and s.endswith(f"{run_id}/artifacts/config.yaml") for s in stored)
    assert any(s.endswith(f"{run_id}/artifacts/final_model/config.json") for s in stored), stored


def test_a_run_that_raised_is_marked_failed_and_the_next_one_starts(tmp_path, new_db):
    from mlflow import MlflowClient

    uri = f"sqlite:///{new_db(tmp_path / 'mlflow.db')}"
    crashed = Tracker(True, uri, "dapo-ray-test", "crashed", PARAMS)
    crashed.log(step_metrics(1), step=1)
    crashed.flush()
    end_failed_run()  # what the driver does when the loop raises
    again = Tracker(True, uri, "dapo-ray-test", "again", PARAMS)
    again.close()

    client = MlflowClient(uri)
    assert client.get_run(crashed.run.info.run_id).info.status == "FAILED"
    assert client.get_run(again.run.info.run_id).info.status == "FINISHED"
