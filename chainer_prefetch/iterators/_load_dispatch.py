"""Stage 3's load tasks: which ready accesses go to a loader together.

Pure bookkeeping for :class:`._scheduler.Scheduler`, which sends each task
as a :class:`._scheduler.Load` or :class:`._scheduler.LoadColumns` action.
"""
import itertools
from typing import Dict, List, Sequence, Tuple

#: Batches whose examples load at the same time: two keep every worker busy
#: across a batch boundary.
DECODE_WINDOW = 2


class LoadDispatcher:
    """Groups ready accesses into load tasks and keeps the tasks not yet answered.

    Loads run only for the batches of the *decode window*: the first
    :data:`DECODE_WINDOW` batches in flight, or ``config.decode_window`` for
    columnar batches (one task each).

    Args:
        config: The scheduler's :class:`~._scheduler.SchedulerConfig`.
        ids: The scheduler's id counter (task ids share it with batch and
            copy ids).
    """

    def __init__(self, config, ids: itertools.count):
        self._config = config
        self._ids = ids
        self.decode_window = (max(DECODE_WINDOW, config.decode_window)
                              if config.columnar else DECODE_WINDOW)
        self._tasks: Dict[int, Tuple[int, Tuple[int, ...]]] = {}  # task -> (batch, positions)

    @property
    def outstanding(self) -> int:
        """Load tasks sent and not answered."""
        return len(self._tasks)

    def local_tasks(self, ready: Sequence[int], batch_size: int,
                    waiting: int) -> List[Tuple[int, ...]]:
        """The tasks to send now for a batch's accesses ready to read locally.

        Examples read locally go several per task, one task per worker.
        While the loader processes have free task slots, everything ready
        goes at once (the workers would idle otherwise); while they are
        busy, ready examples gather until a task is worth a worker's share
        of the batch.  With ``maxtasksperchild`` a task is one example, so
        that limit keeps counting examples.  (An access read from shared
        storage is a slow read: it goes alone, in a task of its own.)

        Args:
            ready: The positions ready, in order.
            batch_size: Accesses in the batch.
            waiting: Accesses of the batch still waiting for stage 2.

        Returns:
            The positions of each task, or nothing: the ready ones wait.
        """
        config = self._config
        if not ready:
            return []
        share = -(-batch_size // config.n_processes)
        if config.maxtasksperchild is not None:
            size = 1
        elif (len(self._tasks) < config.task_slots or len(ready) >= share
              or waiting == 0):
            size = max(1, min(share, -(-len(ready) // config.n_processes)))
        else:
            return []
        return [tuple(ready[start:start + size])
                for start in range(0, len(ready), size)]

    def start(self, batch_id: int, positions: Tuple[int, ...]) -> int:
        """Registers a task loading ``positions`` of batch ``batch_id``; returns its id."""
        task_id = next(self._ids)
        self._tasks[task_id] = (batch_id, positions)
        return task_id

    def answered(self, task_id: int) -> Tuple[int, Tuple[int, ...]]:
        """The batch id and positions of the task that answered."""
        return self._tasks.pop(task_id)
