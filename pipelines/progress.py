"""A console progress bar for Spark jobs, fed by Spark's status tracker.

The job runs on a worker thread under a job group; the calling thread polls the
status tracker and shows completed tasks out of the total with tqdm (on a
terminal only, unless forced).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["run_with_progress"]

T = TypeVar("T")


def _completed_tasks(sc: Any, group: str) -> tuple[int, int]:
    tracker = sc.statusTracker()
    done = total = 0
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        if job is None:
            continue
        for stage_id in job.stageIds:
            stage = tracker.getStageInfo(stage_id)
            if stage is not None:
                done += stage.numCompletedTasks
                total += stage.numTasks
    return done, total


def run_with_progress(spark: Any, description: str, planned_tasks: int,
                      job: Callable[[], T], *, enabled: bool | None = None,
                      unit: str = "task") -> T:
    """Run ``job`` (which starts Spark actions) and show its tasks' progress.

    ``enabled``: None shows the bar only when stderr is a terminal.
    """
    from tqdm import tqdm

    sc = spark.sparkContext
    group = f"kiproxy-{uuid.uuid4().hex[:8]}"
    result: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            sc.setJobGroup(group, description)
            result.append(job())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="kiproxy-spark-job", daemon=True)
    with tqdm(total=planned_tasks, desc=description, unit=unit,
              disable=None if enabled is None else not enabled) as bar:
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
            done, total = _completed_tasks(sc, group)
            if total > bar.total:
                bar.total = total
            bar.n = done
            bar.refresh()
        done, total = _completed_tasks(sc, group)
        bar.total = max(bar.total or 0, total)
        bar.n = done
        bar.refresh()
    if failure:
        raise failure[0]
    return result[0]
