"""A reward function of the user's own (`reward.function`): loaded by path or module, its convention told
from its signature, and every way a bad one can fail (raise, NaN, inf, None, text, hang, a C call past its
timer, os._exit) scored `reward.on_error`, counted and shown, with the calls after it going on. Real helper
processes (`dapo_ray/tasks/reward_helper.py`), no Ray."""

import json
import time

import pytest

from dapo_ray.config import ConfigError, load_config
from dapo_ray.tasks import ERROR_PRED, TIMEOUT_PRED, RewardSpec, judge_group, keep, reward_spec
from dapo_ray.tasks.user import RewardFunctionError, UserFunction, check_function

VERL = '''
import asyncio, ctypes, math, os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    reply = solution_str.strip()
    if reply == "raise":
        raise ValueError("the scorer broke on this reply")
    if reply == "nan":
        return float("nan")
    if reply == "inf":
        return {"score": math.inf, "acc": False}
    if reply == "none":
        return None
    if reply == "text":
        return "right"
    if reply == "loop":
        while True:
            pass
    if reply == "blocked":  # a C call the helper's watchdog cannot interrupt
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGUSR1})
        time.sleep(30)
    if reply == "alarm":  # a library that sets and cancels its own alarm (Math-Verify's timeouts do)
        signal.alarm(5)
        signal.alarm(0)
        while True:
            pass
    if reply == "exit":
        os._exit(3)
    print("a scorer that prints")  # must not disturb the helper's frames
    right = reply == ground_truth
    return {"score": 1.0 if right else 0.0, "acc": right, "pred": reply, "format": 0.5,
            "bonus": kwargs.get("bonus", 0.0), "source_seen": float(data_source == "mine"),
            "extra_seen": float((extra_info or {}).get("n", 0))}

async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return 1.0 if solution_str.strip() == ground_truth else 0.0

def plain_score(solution_str, ground_truth):  # verl's own per-task scorers take these two only
    return 1.0 if solution_str.strip() == ground_truth else -1.0

def states(reply, reference):
    return reference in reply.split()

def both(**kwargs):
    return 0.0

def neither(text, answer):
    return 0.0

not_a_function = 3
'''

TRL = '''
def accuracy(completions, ground_truth, **kwargs):
    return [1.0 if c[0]["content"].strip() == g else 0.0 for c, g in zip(completions, ground_truth)]

def text_accuracy(prompts, completions, ground_truth):
    return [1.0 if c.strip() == g else 0.0 for c, g in zip(completions, ground_truth)]

def with_gaps(completions, **kwargs):
    return [None if c[0]["content"] == "skip" else 1.0 for c in completions]

def too_short(completions, **kwargs):
    return [1.0]

def not_a_list(completions, **kwargs):
    return 1.0

def sees_prompts(prompts, completions, data_source, extra_info, **kwargs):
    return [float(p[-1]["content"] == "What is 2 + 2?" and d == "mine" and e["n"] == 4) for p, d, e in
            zip(prompts, data_source, extra_info)]
'''


@pytest.fixture
def files(tmp_path, monkeypatch):
    """The reward files in a working directory of their own, as `ray job submit --working-dir` makes it."""
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "verl_style.py").write_text(VERL)
    (tmp_path / "rewards" / "trl_style.py").write_text(TRL)
    (tmp_path / "rewards" / "broken.py").write_text("def compute_score(data_source, solution_str:\n")
    (tmp_path / "rewards" / "imports_missing.py").write_text("import no_such_package_here\n")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "scoring.py").write_text(VERL)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def row(texts, reference="17", source="mine"):
    return {"texts": texts, "ground_truth": reference, "data_source": source, "response_ids": [[1, 2]] * len(texts),
            "prompt_json": json.dumps([{"role": "user", "content": "What is 2 + 2?"}]),
            "extra_info_json": json.dumps({"n": 4})}  # fmt: skip


def spec(function, **kw):
    on_error = kw.pop("on_error", -1.0)
    filter_metric = kw.pop("filter_metric", "auto")
    return RewardSpec(function=UserFunction(function, on_error=on_error, **kw), filter_metric=filter_metric)


def test_a_verl_function_scores_each_reply_with_its_kwargs_source_and_extra_info(files):
    judged = judge_group(row(["17", "16", " 17 "]), spec("rewards/verl_style.py:compute_score", kwargs={"bonus": 2.0}))
    assert judged["scores"] == [1.0, 0.0, 1.0] and judged["acc"] == [True, False, True]
    assert judged["preds"] == ["17", "16", "17"] and judged["reward_errors"] == ["", "", ""]
    # The dict's other numbers are kept as metrics; kwargs, data_source and extra_info reached the function.
    assert judged["reward_extra"] == {"format": [0.5] * 3, "bonus": [2.0] * 3, "source_seen": [1.0] * 3,
                                      "extra_seen": [4.0] * 3}  # fmt: skip
    assert judged["filter_on"] == "acc" and keep(judged)


@pytest.mark.parametrize("reply, kind, what", [
    ("raise", "error", "ValueError: the scorer broke on this reply"),
    ("nan", "error", "nan, not a finite number"),
    ("inf", "error", "'score' inf, not a finite number"),
    ("none", "error", "None, not a number"),
    ("text", "error", "a str ('right'), not a number"),
    ("loop", "timeout", "ran past reward.timeout_s=0.5"),
    ("alarm", "timeout", "ran past reward.timeout_s=0.5"),
    ("blocked", "timeout", "ran past reward.timeout_s=0.5"),
    ("exit", "error", "process died (a crash, or it called exit)"),
])  # fmt: skip
def test_every_bad_call_scores_on_error_is_counted_and_shown_and_the_group_goes_on(files, reply, kind, what):
    fn = spec("rewards/verl_style.py:compute_score", timeout_s=0.5, on_error=-0.5)
    judged = judge_group(row(["17", reply, "17", "16"]), fn)
    assert judged["reward_errors"] == ["", kind, "", ""]
    assert judged["scores"] == [1.0, -0.5, 1.0, 0.0] and judged["acc"] == [True, False, True, False]
    assert judged["preds"][1] == (TIMEOUT_PRED if kind == "timeout" else ERROR_PRED)
    (failure,) = judged["reward_failures"]
    assert failure["kind"] == kind and failure["reply"] == reply and what in failure["detail"], failure
    if reply == "raise":  # the user's own frames, not the helper's
        assert "verl_style.py" in failure["detail"] and "reward_helper.py" not in failure["detail"]
    # The helper (killed for `blocked` and dead after `exit`) serves the next group.
    assert judge_group(row(["17"]), fn)["scores"] == [1.0]


def test_a_call_past_its_time_is_cut_inside_the_helper_which_lives_on(files):
    from dapo_ray.tasks import user_scorer

    fn = spec("rewards/verl_style.py:compute_score", timeout_s=0.5)
    judge_group(row(["17"]), fn)
    pid = user_scorer(fn.function)._helper.proc.pid
    t0 = time.monotonic()
    assert judge_group(row(["loop", "alarm", "17"]), fn)["reward_errors"] == ["timeout", "timeout", ""]
    assert time.monotonic() - t0 < 2.5  # two timeouts of 0.5 s, not two kills after the 2 s grace
    assert user_scorer(fn.function)._helper.proc.pid == pid


def test_async_verl_functions_and_verls_two_argument_scorers(files):
    assert judge_group(row(["17", "1"]), spec("rewards/verl_style.py:async_score"))["scores"] == [1.0, 0.0]
    judged = judge_group(row(["17", "1"]), spec("rewards/verl_style.py:plain_score"))
    assert judged["scores"] == [1.0, -1.0] and judged["acc"] == [True, False]


def test_a_package_module_in_the_working_directory(files):
    assert judge_group(row(["17"]), spec("mypkg.scoring:compute_score"))["acc"] == [True]


def test_a_trl_function_scores_a_group_in_one_call_with_the_rows_columns(files):
    judged = judge_group(row(["17", "16"]), spec("rewards/trl_style.py:accuracy"))
    # No `acc`: right is a score above reward.right_above, and Dynamic Sampling reads the scores' spread.
    assert judged["scores"] == [1.0, 0.0] and judged["acc"] == [True, False] and judged["filter_on"] == "score"
    assert judge_group(row(["17", "16"]), spec("rewards/trl_style.py:text_accuracy", trl_completions="text"))["scores"] == [1.0, 0.0]
    assert judge_group(row(["x", "y"]), spec("rewards/trl_style.py:sees_prompts"))["scores"] == [1.0, 1.0]


@pytest.mark.parametrize("name, errors, what", [
    ("with_gaps", ["", "error"], "at place 1 of the list, None"),
    ("too_short", ["error", "error"], "returned 1 rewards for 2 completions"),
    ("not_a_list", ["error", "error"], "returned a float, not a list"),
])  # fmt: skip
def test_a_trl_function_that_returns_the_wrong_thing(files, name, errors, what):
    judged = judge_group(row(["17", "skip"]), spec(f"rewards/trl_style.py:{name}"))
    assert judged["reward_errors"] == errors
    assert any(what in f["detail"] for f in judged["reward_failures"]), judged["reward_failures"]


def test_filter_metric_score_keeps_a_group_whose_rewards_differ_though_none_is_right(files):
    judged = judge_group(row(["16", "15"]), spec("rewards/trl_style.py:accuracy"))
    assert not keep(judged)  # both 0.0
    judged = judge_group(row(["16", "17"]), spec("rewards/verl_style.py:compute_score", filter_metric="score"))
    assert judged["filter_on"] == "score" and keep(judged)


def test_the_users_own_states_reference_check_or_the_generic_one(files):
    generic = judge_group(row(["it is 17", "17.0"]), spec("rewards/verl_style.py:compute_score"))
    assert generic["stated"] == [True, True]
    own = judge_group(row(["it is 17", "17.0"]), spec("rewards/verl_style.py:compute_score",
                                                       states_reference="rewards/verl_style.py:states"))  # fmt: skip
    assert own["stated"] == [True, False]


@pytest.mark.parametrize("function, message", [
    ("rewards/missing.py:compute_score", "no file rewards/missing.py in"),
    ("rewards/broken.py:compute_score", "SyntaxError"),
    ("rewards/imports_missing.py:compute_score", "No module named 'no_such_package_here'"),
    ("rewards/verl_style.py:compute", "has no 'compute' (functions it defines: ['async_score', 'both', 'compute_score'"),
    ("rewards/verl_style.py:not_a_function", "not_a_function in"),
    ("rewards/verl_style.py:neither", "fits neither convention"),
    ("rewards/verl_style.py:both", "fits both verl's and TRL's calls; set reward.convention"),
    ("no_such_module.rewards:f", "importing module no_such_module.rewards failed"),
])  # fmt: skip
def test_a_function_that_cannot_run_is_refused_before_the_run_naming_file_function_and_why(files, function, message):
    with pytest.raises(RewardFunctionError) as e:
        check_function(UserFunction(function))
    assert message in str(e.value) and function in str(e.value), str(e.value)


def test_a_stated_convention_that_does_not_fit(files):
    with pytest.raises(RewardFunctionError, match="reward.convention is trl, but compute_score"):
        check_function(UserFunction("rewards/verl_style.py:compute_score", convention="trl"))
    assert check_function(UserFunction("rewards/verl_style.py:both", convention="verl"))["convention"] == "verl"
    info = check_function(UserFunction("rewards/trl_style.py:accuracy"))
    assert info["convention"] == "trl" and info["where"] == str(files / "rewards" / "trl_style.py")


def test_config_keys(files):
    cfg = load_config(None, ["data.source=synthetic", "reward.function=rewards/trl_style.py:accuracy",
                             "reward.function_kwargs={scale: 2, names: [a, b]}", "reward.on_error=0.0"])  # fmt: skip
    fn = reward_spec(cfg).function
    assert fn.kwargs == {"scale": 2, "names": ["a", "b"]} and fn.on_error == 0.0 and fn.timeout_s == 10.0
    assert reward_spec(load_config(None, ["data.source=synthetic"])).function is None
    for bad, says in (("reward.function=rewards/trl_style.py", "must look like path/to/file.py:function_name"),
                      ("reward.convention=openrlhf", "one of"), ("reward.on_error=.nan", "finite"),
                      ("reward.states_reference=x.py:f", "go with reward.function")):  # fmt: skip
        with pytest.raises(ConfigError, match=says):
            load_config(None, ["data.source=synthetic", bad])


def test_the_helper_file_imports_nothing_of_the_package():
    # It starts as a script with -P: a package import there would load torch (seconds) in every helper.
    from dapo_ray.tasks import reward_helper

    source = open(reward_helper.__file__).read()
    assert "dapo_ray" not in "".join(line for line in source.splitlines() if line.startswith(("import", "from")))


def test_doctests():
    import doctest

    from dapo_ray.tasks import reward_helper

    assert doctest.testmod(reward_helper).failed == 0




def test_the_tasks_no_answer_mark_is_the_verifiers():
    from dapo_ray.algo.reward import INVALID as verifiers
    from dapo_ray.tasks import INVALID

    assert INVALID == verifiers
