"""Issue 34's routing task at the token level: chapter 9's controlled experiment
(:mod:`mini_moe.subtasks`, eight sub-tasks whose right routing is known) with the routing controls
(a router with its weights frozen at initialisation, the hash router) and the confound split
(Token Choice without noise or auxiliary loss, against Expert Choice, which has neither).

Usage, from the repository root after ``make venv`` (each command resumes; one per core):

    taskset -c 0 .venv/bin/python mini_moe/results/subtasks_controls.py lr_pilot SEED [SEED ...]

``lr_pilot`` (exploratory, seeds 0 and 1, never reused): every arm at the learning rates of
:data:`LEARNING_RATES`, trained to the stopping rule of :data:`TRAINING` (validation FVU), into
``subtasks-controls-lr-pilot-MACHINE.json``. The first pilot group, every control at 3e-3 on seeds
0-2, was run by the CLI (``python -m mini_moe subtasks``; see the results README).
"""

from __future__ import annotations

import os
import pathlib
import sys

from mini_moe import subtasks

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
RESULTS = pathlib.Path(__file__).resolve().parent

#: The arms: the learned routers, their frozen twins, the hash router, Token Choice with neither
#: noise nor auxiliary loss (Expert Choice has neither), and the dense layer of equal parameters.
ARMS = ("softmax_token_choice", "softmax_token_choice_frozen", "softmax_expert_choice",
        "softmax_expert_choice_frozen", "hash", "softmax_token_choice_plain", "dense_wide")
#: The learning-rate grid, and how every run trains: to the stopping rule on validation FVU
#: (1 % within 1,000 steps), at most 20,000 steps, uniform sub-task frequencies, c = 1.
LEARNING_RATES = (1e-3, 3e-3, 1e-2)
TRAINING = dict(steps=20000, patience=1000)


def lr_pilot(seeds) -> None:
    out = RESULTS / f"subtasks-controls-lr-pilot-{MACHINE}.json"
    command = f"taskset -c N .venv/bin/python mini_moe/results/subtasks_controls.py lr_pilot {' '.join(map(str, seeds))}"
    for lr in LEARNING_RATES:
        subtasks.run_experiment(out, routers=ARMS, frequencies=("uniform",), seeds=seeds, command=command,
                                learning_rate=lr, **TRAINING)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "lr_pilot":
        sys.exit(__doc__)
    lr_pilot([int(s) for s in sys.argv[2:]])
