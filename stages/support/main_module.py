"""Worker processes that start without the stage's main module.

    with main_module_hidden():        # while "spawn" starts the processes
        ...

"spawn" (multiprocessing's, and that of a Dask LocalCluster's nannies) makes each new process import the parent's
`__main__` again, so that a function defined there unpickles. For `python -m stages.reproduce` that is MLflow,
matplotlib and the rest of the stage: about 170 MB and 1.5 s of CPU in every worker, for jobs that live in
stages.support.seed_task. multiprocessing decides from the main module's `__spec__` and `__file__`
(multiprocessing.spawn.get_preparation_data); both are hidden while the processes start, and put back.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Processes spawned inside the block do not import the main module; those spawned later do again."""
    main = sys.modules["__main__"]
    hidden: dict[str, Any] = {name: vars(main)[name] for name in ("__spec__", "__file__") if name in vars(main)}
    main.__spec__ = None
    vars(main).pop("__file__", None)
    try:
        yield
    finally:
        vars(main).update(hidden)
