"""Overlong reward shaping (DAPO section 3.4).

Two independent switches:

* **Overlong filtering** masks truncated samples (the engine stopped at the length limit, not at EOS)
  out of the loss, so a reasonable but unfinished answer is not punished for its length alone.
* **Soft overlong punishment** (Eq. 13) adds a length penalty to the correctness reward:

      R_length(y) = 0                                  if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                  = -1                                 if L_max < |y|

  Paper: L_max = 20480, L_cache = 4096, so penalties start after 16384 tokens. Example: |y| = 18432 is
  half-way into the cache, so R_length = -0.5. Like verl, we also allow a `penalty_factor` that scales
  the penalty (1.0 in the paper).
"""

from __future__ import annotations

from collections.abc import Sequence


def soft_overlong_penalty(length: int, max_length: int, cache_length: int, penalty_factor: float = 1.0) -> float:
    """Eq. 13 for one response of `length` tokens. Returns a value in [-penalty_factor, 0].

    >>> soft_overlong_penalty(18432, max_length=20480, cache_length=4096)
    -0.5
    """
    if cache_length <= 0 or cache_length > max_length:
        raise ValueError(f"cache_length must be in (0, max_length={max_length}], got {cache_length}")
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length > max_length:
        return -1.0 * penalty_factor
    return (expected - length) / cache_length * penalty_factor


def overlong_filter_mask(truncated: Sequence[bool]) -> list[float]:
    """Per-sample loss weight for overlong filtering: 0.0 for a truncated sample, 1.0 otherwise."""
    return [0.0 if t else 1.0 for t in truncated]
