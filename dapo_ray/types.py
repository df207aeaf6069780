"""Column names and row types shared by every stage.

A prompt row travels: data -> rollout (adds responses) -> reward (adds scores) -> filter/advantage ->
trainer. Each stage documents which of these columns it needs and which it adds.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class Message(TypedDict):
    role: str
    content: str


class PromptRow(TypedDict):
    """One training or evaluation problem, as every loader returns it."""

    uid: str
    """Stable id: `<source>:<row>` for files, `synthetic-<split>:<i>` for generated problems."""
    messages: list[Message]
    """The chat prompt (one user message for DAPO data)."""
    ground_truth: str
    """Reference answer, as text."""
    data_source: str
    """The dataset's own `data_source` (e.g. "math_dapo"), or "synthetic"."""
    solution: str
    """A reference response, when known (synthetic problems: used for the supervised warm-up)."""
    extra_info: NotRequired[dict]
    """verl's `extra_info` column: what a reward function needs beside the reference ({} when none)."""


# Column names (Ray Data stages refer to these, never to string literals of their own).
UID = "uid"
MESSAGES = "messages"
GROUND_TRUTH = "ground_truth"
DATA_SOURCE = "data_source"
SOLUTION = "solution"
