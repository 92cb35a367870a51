"""Synthetic evaluations: S-NIAH-1/2/3, MQAR, parity, S3/S5, and the formal languages (parity check,
modular arithmetic) of the negative-eigenvalue paper.

Every task is a frozen dataclass that yields ``Batch(input_ids, targets, loss_mask)``
deterministically from a seed (see ``base.py``). Tasks are named by a spec string,
``name`` or ``name:field=value,field=value``::

    task = from_spec("mqar:seq_len=128,n_pairs=16")
    batch = task.batch(32, seed=(0, step))
"""

from __future__ import annotations

from dataclasses import fields

from fastweight.tasks.base import Batch, Task
from fastweight.tasks.mqar import MQAR
from fastweight.tasks.niah import SNiah1, SNiah2, SNiah3
from fastweight.tasks.formal import ModularArithmetic, ParityCheck
from fastweight.tasks.state_tracking import S3, S5, Parity
from fastweight.tasks.text import tokenizer

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (SNiah1, SNiah2, SNiah3, MQAR, Parity, S5, S3, ParityCheck,
                                                           ModularArithmetic)}


def from_spec(spec: str) -> Task:
    """``"name"`` or ``"name:field=value,..."`` -> the task (integer fields; a float field, such as
    MQAR's ``power_a``, takes a decimal)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"`spec` must be a task name like 'mqar' or 'mqar:seq_len=128', got {spec!r}")
    name, _, args = spec.partition(":")
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} in spec {spec!r}; known: {', '.join(TASKS)}")
    cls = TASKS[name]
    known = {f.name: float if isinstance(f.default, float) else int for f in fields(cls)}
    kwargs = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            raise ValueError(f"bad argument {item!r} in task spec {spec!r}; {name} takes {sorted(known)}")
        try:
            kwargs[key] = known[key](value)
        except ValueError:
            raise ValueError(f"task argument {key!r} must be {'a number' if known[key] is float else 'an int'}, "
                             f"got {value!r}") from None
    return cls(**kwargs)


__all__ = ["Batch", "Task", "TASKS", "from_spec", "tokenizer", "SNiah1", "SNiah2", "SNiah3", "MQAR",
           "Parity", "S5", "S3", "ParityCheck", "ModularArithmetic"]
