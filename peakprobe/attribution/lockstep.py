"""Searches advanced in lockstep: many 1-D searches whose loss evaluations run as one batch.

Each head of a layer has its own search over x = log beta (``search``), written as plain
sequential code that calls its loss function. ``run_lockstep`` runs each search in a thread of
its own whose loss function only posts a request (the head, x, and which part of the windows)
and waits; once every search is waiting or done, the calling thread evaluates all pending
requests of the round together (``evaluate``: one batched forward per part, the heads' betas
along the batch) and hands each search its value. The searches take the same steps as they
would one after the other, on values equal up to the rounding of a larger batch; a round costs
one forward instead of one per head, and one device-to-host copy for all of them.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence

#: a search: job(key, part_sum) -> its result, where part_sum(x, part) is the loss summed over
#: that part's tokens with the key's beta at exp(x)
Job = Callable[[Hashable, Callable[[float, int], float]], object]
#: evaluate(part, [(key, x), ...]) -> the part's loss sums, one per request
Evaluate = Callable[[int, Sequence[tuple[Hashable, float]]], Sequence[float]]


def _answer(batch: dict[Hashable, tuple[float, int]], evaluate: Evaluate,
            errors: list[BaseException]) -> dict[Hashable, float]:
    """One round: every waiting search's (x, part) evaluated, one ``evaluate`` call per part.
    A failed evaluation answers NaN to all (so that every search unblocks) and is kept in
    ``errors``."""
    by_part: dict[int, list[tuple[Hashable, float]]] = defaultdict(list)
    for key, (x, part) in batch.items():
        by_part[part].append((key, x))
    answers: dict[Hashable, float] = {}
    try:
        for part, requests in sorted(by_part.items()):
            answers.update(zip((k for k, _ in requests), evaluate(part, requests), strict=True))
    except BaseException as exc:  # unblock every search, then raise
        errors.append(exc)
        return {key: math.nan for key in batch}
    return answers


def run_lockstep(keys: Iterable[Hashable], job: Job, evaluate: Evaluate) -> list:
    """``job(key, part_sum)`` for every key, their evaluations batched round by round; the
    results in the order of ``keys``. An exception in a job or in ``evaluate`` is raised here
    once every thread has stopped."""
    keys = list(keys)
    cond = threading.Condition()
    waiting: dict[Hashable, tuple[float, int]] = {}
    answers: dict[Hashable, float] = {}
    finished: set[Hashable] = set()
    results: dict[Hashable, object] = {}
    errors: list[BaseException] = []

    def part_sum_of(key: Hashable) -> Callable[[float, int], float]:
        def part_sum(x: float, part: int) -> float:
            with cond:
                waiting[key] = (float(x), int(part))
                cond.notify_all()
                cond.wait_for(lambda: key in answers)
                value = answers.pop(key)
            if math.isnan(value) and errors:
                raise RuntimeError("the batched evaluation failed")
            return value
        return part_sum

    def worker(key: Hashable) -> None:
        try:
            results[key] = job(key, part_sum_of(key))
        except BaseException as exc:  # handed to the caller after the join
            errors.append(exc)
        finally:
            with cond:
                finished.add(key)
                cond.notify_all()

    threads = [threading.Thread(target=worker, args=(key,), daemon=True) for key in keys]
    for t in threads:
        t.start()
    while True:
        with cond:
            cond.wait_for(lambda: len(waiting) + len(finished) == len(keys))
            if not waiting:
                break
            batch = dict(waiting)
            waiting.clear()
        round_ = _answer(batch, evaluate, errors)
        with cond:
            answers.update(round_)
            cond.notify_all()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[k] for k in keys]
