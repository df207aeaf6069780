"""The smallest reward of your own: DAPO's `Answer:` line, its integer compared with the reference's.

    dapo-ray train --config workflows/configs/tiny_cpu.yaml reward.function=workflows/tasks/answer_line.py:compute_score

verl's convention (`compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`), one
reply per call; the run ships this file with its working directory (`ray job submit --working-dir .`) and
imports it on whichever node scores. The tests run it on the multinode cluster (tests/multinode/test_job_submit.py).
"""

import re

_ANSWER = re.compile(r"Answer:\s*(-?\d+)\s*$")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """+1 when the reply's last line is `Answer: N` with N the reference integer, else -1 (DAPO Eq. 7).

    >>> compute_score("synthetic", "Answer: 54", "54"), compute_score("synthetic", "Answer: 54 or 55", "54")
    ({'score': 1.0, 'acc': True, 'pred': '54'}, {'score': -1.0, 'acc': False, 'pred': ''})
    """
    lines = solution_str.strip().splitlines()
    found = _ANSWER.fullmatch(lines[-1].strip()) if lines else None
    right = found is not None and int(found.group(1)) == int(ground_truth)
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": found.group(1) if found else ""}
