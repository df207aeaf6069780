"""Prompt datasets: parquet in the verl/DAPO schema and jsonl with problem/answer (the synthetic sums: `dapo_ray.tasks.sums`).

    rows, report = load_prompts(["data/dapo-math-17k.parquet"], template="dapo")
    print(report)   # files, rows read, duplicates dropped, bad rows, templated rows

Every loader returns `PromptRow`s (see `types.py`). A malformed row stops loading with an error that
names its file and row number (`on_bad_row="error"`), or is skipped and counted (`"skip"`).

The DAPO template
-----------------
DAPO wraps each problem in an instruction asking for a final `Answer: ...` line (the verifier reads
exactly that line). `aime-2024.parquet` carries it already; the 17k copy here holds bare problems.
With `template="dapo"` a user message that lacks the instruction is wrapped; a leading
"Solve the following math problem step by step." (a shortened prefix some copies use) is replaced by
the full template rather than repeated.

`dapo_ray.prepare` turns whole files into a de-duplicated, templated parquet with the same row rules:
the row functions here raise `RowError`, whose `reason` (one of `ROW_PROBLEMS`) is what it counts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq

from dapo_ray.types import Message, PromptRow

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
_SHORT_PREFIX = "Solve the following math problem step by step."
_INSTRUCTION_MARK = "Answer: $Answer"


class BadRowError(ValueError):
    """A data file, or a row of one, that cannot be used; the message names the file (and the row)."""


ROW_PROBLEMS = {
    "bad_record": "a jsonl line that is not valid JSON, or not a JSON object",
    "missing_problem": "no 'prompt' (or 'problem'/'question') column or field, or it is null",
    "empty_problem": "no non-empty user message, or an empty problem text",
    "bad_prompt_type": "'prompt' is not a list of {role, content} strings, or the problem is not text",
    "missing_ground_truth": "no 'reward_model.ground_truth' (or 'answer'/'ground_truth'), or it is null",
    "bad_ground_truth_type": "the ground truth or 'reward_model' has the wrong type (e.g. a bool or a list)",
    "empty_ground_truth": "the ground truth is empty or only whitespace",
}
"""Why a row cannot be used: reason -> what it means (the `reason` of a `RowError`)."""


class RowError(ValueError):
    """One raw row that cannot be used: the message says what is wrong, `reason` names the kind."""

    def __init__(self, reason: str, message: str):
        assert reason in ROW_PROBLEMS, reason
        super().__init__(message)
        self.reason = reason


@dataclass
class LoadReport:
    """What loading did, for the log."""

    files: list[str] = field(default_factory=list)
    rows_read: int = 0
    kept: int = 0
    duplicates: int = 0
    bad_rows: int = 0
    templated: int = 0
    first_bad: str = ""

    def __str__(self) -> str:
        bad = f", {self.bad_rows} bad rows skipped (first: {self.first_bad})" if self.bad_rows else ""
        return (
            f"{self.kept} prompts from {self.rows_read} rows in {len(self.files)} file(s): "
            f"{self.duplicates} duplicates dropped, {self.templated} wrapped in the DAPO template{bad}"
        )


def apply_dapo_template(problem: str) -> str:
    """Wrap a bare problem in the DAPO instruction template (see module docstring)."""
    problem = problem.strip()
    if problem.startswith(_SHORT_PREFIX):
        problem = problem[len(_SHORT_PREFIX) :].strip()
    return DAPO_PREFIX + problem + DAPO_SUFFIX


def strip_dapo_template(text: str) -> str:
    """The bare problem inside a DAPO-templated prompt (the text itself when it carries no template).

    >>> strip_dapo_template(apply_dapo_template("What is 1+1?"))
    'What is 1+1?'
    """
    text = text.strip()
    for prefix in (DAPO_PREFIX, _SHORT_PREFIX):
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    return text.removesuffix(DAPO_SUFFIX.strip()).strip()


def template_messages(messages: list[Message], mode: Literal["auto", "always", "never"]) -> bool:
    """Put the first user message in the DAPO template, in place; True if its text changed.

    `auto` wraps a message that lacks the instruction (`Answer: $Answer`) and leaves one that has it;
    `always` rebuilds every message as the exact template around its bare problem, so a templated prompt
    is normalised, never wrapped twice; `never` leaves the text.
    """
    user = next(m for m in messages if m["role"] == "user")
    if mode == "never" or (mode == "auto" and _INSTRUCTION_MARK in user["content"]):
        return False
    new = apply_dapo_template(strip_dapo_template(user["content"]))
    changed, user["content"] = new != user["content"], new
    return changed


def prompt_key(messages: list[Message]) -> str:
    """What de-duplication compares: the whole chat prompt, after templating."""
    return json.dumps(messages, sort_keys=True)


def _messages_from_verl(raw: Any) -> list[Message]:
    if hasattr(raw, "tolist"):  # numpy arrays from pandas-written files
        raw = raw.tolist()
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if raw is None:
        raise RowError("missing_problem", "'prompt' is null")
    if not isinstance(raw, list):
        raise RowError("bad_prompt_type", f"'prompt' must be a list of chat messages, got {type(raw).__name__}")
    if not raw:
        raise RowError("empty_problem", "'prompt' must be a non-empty list of chat messages, got an empty list")
    messages: list[Message] = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise RowError("bad_prompt_type",
                           f"'prompt' holds a message without string 'role' and 'content': {m!r:.80}")  # fmt: skip
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise RowError("empty_problem", "'prompt' has no non-empty user message")
    return messages


def _ground_truth(raw: Any) -> str:
    if raw is None or (isinstance(raw, float) and math.isnan(raw)):  # NaN: a null in a pandas float column
        raise RowError("missing_ground_truth", f"ground truth is missing: {raw!r}")
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)  # 5.0 from a float column is the integer answer "5"
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str):
        raise RowError("bad_ground_truth_type", f"ground truth is not text or a number: {raw!r:.80}")
    if not raw.strip():
        raise RowError("empty_ground_truth", f"ground truth is empty: {raw!r}")
    return raw.strip()


def row_from_verl(raw: dict, uid: str) -> PromptRow:
    """A verl/DAPO parquet row (`prompt`, `reward_model.ground_truth`, `data_source`) as a PromptRow."""
    if "prompt" not in raw:
        raise RowError("missing_problem", "column 'prompt' is missing")
    rm = raw.get("reward_model")
    if rm is not None and not isinstance(rm, dict):
        raise RowError("bad_ground_truth_type",
                       f"'reward_model' must be a struct with 'ground_truth', got {type(rm).__name__}")  # fmt: skip
    if rm is None or "ground_truth" not in rm:
        raise RowError("missing_ground_truth", "column 'reward_model' with field 'ground_truth' is missing")
    return {
        "uid": uid,
        "messages": _messages_from_verl(raw["prompt"]),
        "ground_truth": _ground_truth(rm["ground_truth"]),
        "data_source": str(raw.get("data_source") or ""),
        "solution": "",
        "extra_info": _extra_info(raw.get("extra_info")),
    }


def _extra_info(raw: Any) -> dict:
    """A row's `extra_info` (verl's column for what a reward function needs beside the reference: a
    problem's numbers, its tests), as a plain dict; none is {}."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RowError("bad_record", f"'extra_info' must be a mapping, got {type(raw).__name__}")
    return raw


def row_from_jsonl(raw: dict, uid: str) -> PromptRow:
    """A jsonl record with `problem` (or `question`) and `answer` (or `ground_truth`)."""
    if not isinstance(raw, dict):
        raise RowError("bad_record", f"expected a JSON object, got {type(raw).__name__}")
    problem = raw.get("problem", raw.get("question"))
    if problem is None:
        raise RowError("missing_problem", "field 'problem' (or 'question') is missing or empty")
    if not isinstance(problem, str):
        raise RowError("bad_prompt_type", f"field 'problem' (or 'question') is not text: {problem!r:.80}")
    if not problem.strip():
        raise RowError("empty_problem", "field 'problem' (or 'question') is missing or empty")
    answer = raw.get("answer", raw.get("ground_truth"))
    return {
        "uid": uid,
        "messages": [{"role": "user", "content": problem}],
        "ground_truth": _ground_truth(answer),
        "data_source": str(raw.get("data_source") or "jsonl"),
        "solution": str(raw.get("solution") or ""),
        "extra_info": _extra_info(raw.get("extra_info")),
    }


def _read_file(path: Path) -> Iterable[tuple[int, Any, Any]]:
    """(row number, raw record, converter) for every row of a parquet or jsonl file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise BadRowError(f"{path}: not a parquet file that can be read ({e})") from None
        for i, raw in enumerate(table.to_pylist()):
            yield i, raw, row_from_verl
    elif suffix in (".jsonl", ".json"):
        with open(path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as e:
                    raw = e  # reported as a bad row below, with its number
                yield i, raw, row_from_jsonl
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use .parquet or .jsonl")


def load_prompts(
    paths: Sequence[str | Path],
    template: Literal["dapo", "none"] = "dapo",
    dedupe: bool = True,
    on_bad_row: Literal["error", "skip"] = "error",
) -> tuple[list[PromptRow], LoadReport]:
    """Load, validate, template and de-duplicate prompt rows from files (see module docstring)."""
    report = LoadReport()
    seen: set[str] = set()
    rows: list[PromptRow] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise FileNotFoundError(f"prompt file not found: {path} (`dapo-ray prepare` writes prompt files; "
                                "`dapo-ray prepare-mathematics` the Mathematics Dataset's)")  # fmt: skip
        report.files.append(str(path))
        for i, raw, convert in _read_file(path):
            report.rows_read += 1
            try:
                if isinstance(raw, Exception):
                    raise RowError("bad_record", f"not valid JSON: {raw}")
                row = convert(raw, uid=f"{path.name}:{i}")
            except ValueError as e:
                msg = f"{path}: row {i}: {e}"
                if on_bad_row == "error":
                    raise BadRowError(msg) from None
                report.bad_rows += 1
                report.first_bad = report.first_bad or msg
                continue
            if template_messages(row["messages"], "auto" if template == "dapo" else "never"):
                report.templated += 1
            if dedupe:
                key = prompt_key(row["messages"])
                if key in seen:
                    report.duplicates += 1
                    continue
                seen.add(key)
            rows.append(row)
    report.kept = len(rows)
    return rows, report


def tokenize_prompts(rows: list[dict], tokenizer, max_prompt_length: int) -> list[dict]:
    """Rows with `prompt_ids` (the chat template, with the generation prompt), `uid`, `ground_truth`,
    `data_source` (which picks the task: `dapo_ray.tasks.task_for`), and the chat prompt and `extra_info` as
    JSON (`prompt_json`, `extra_info_json`: what a reward function of the user's own is passed); prompts
    longer than `max_prompt_length` tokens are left out."""
    out = []
    for r in rows:
        ids = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "input_ids") or isinstance(ids, dict):
            ids = ids["input_ids"]
        if len(ids) <= max_prompt_length:
            extra = r.get("extra_info")
            out.append({"uid": r["uid"], "prompt_ids": list(ids), "ground_truth": r["ground_truth"],
                        "data_source": r.get("data_source") or "", "prompt_json": json.dumps(r["messages"]),
                        "extra_info_json": json.dumps(extra, default=str) if extra else ""})  # fmt: skip
    return out
