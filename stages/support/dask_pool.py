"""The reproduce stage's Dask executor: batches of seeds as tasks on a Dask cluster.

    with dask_pool(workers=0) as pool:           # DASK_SCHEDULER_ADDRESS, else a LocalCluster
        for index, result in pool.as_completed(train_seeds, graph_tensors, jobs):
            ...                                  # `train_seeds(graph_tensors, *job)`, as each task finishes

The same interface as stages.support.local_pool.WorkerPool.as_completed, the `local` executor.

- **Which cluster.** Dask's own setting names the scheduler: the environment variable
  `DASK_SCHEDULER_ADDRESS` (Dask's config key `scheduler-address`). Without it, a `LocalCluster` on
  127.0.0.1 with `workers` single-threaded worker processes (0: one per core), whose dashboard is at
  http://127.0.0.1:8787/status (`GAT_DASK_DASHBOARD` sets another address, `off` turns it off).
- **A LocalCluster starts early and keeps quiet.** `starting_dask_pool` starts it in a thread, so that its
  workers' start (a process each, importing torch: seconds) overlaps the stage's own set-up. Its
  housekeeping is set for a few long CPU-bound tasks on a machine whose every core trains
  (LOCAL_CLUSTER_CONFIG): with Dask's defaults, made for many short tasks, the stage took 12-18% more CPU
  time than with the `local` executor for the same seeds, and 0-3% more with these. A value the user set in
  Dask's config wins.
- **An unreachable scheduler** is a one-line error naming the address after CONNECT_S seconds, and a
  scheduler without workers one after WORKERS_S.
- **The scheduler needs none of the project's code.** Each task reaches it as the standard library's
  functions and bytes that only a worker unpickles (`_unpickled_on_worker`), so `dask scheduler` runs as
  installed. A worker imports the project's code as the venv has it installed (`make`: in editable mode), from
  any folder and without PYTHONPATH; one that cannot (started from another environment, where the project is
  not installed) is a one-line error naming it, and so is a scheduler that cannot read a task.
- **The graph travels once** to each worker: it is the result of one task that the batches depend on, so a
  worker fetches it from a peer for its first batch and keeps it. Not `scatter`: scattered data can't be
  recomputed, and a worker that dies with the last replica would take every batch still to run with it.
- **Stopping.** A LocalCluster's workers are killed as the block ends (they hold nothing: every result is in,
  or the stage is stopping), not closed gracefully, which took seconds. On any exception in the block
  (SIGTERM, Ctrl-C, a failed task), the tasks are cancelled first.
  A running task is in a thread that Dask can't kill, so the task polls, once per epoch, whether the
  scheduler still wants it (its state on the worker turns `cancelled` when the stage cancels it or its
  client goes away, the stage killed outright included) and stops itself (gat.seeds.Abandoned).
- **A worker that dies** (SIGKILL, out of memory) is Dask's business: the scheduler runs its tasks again
  elsewhere. A task is pure and the stage process alone logs, so a rerun changes nothing but the time.
- **A cluster that goes away mid-run** is a one-line error, not a traceback nor a hang: a scheduler that dies
  cancels every task at once (the client loses its connection), and a scheduler left without workers for
  WORKERS_S seconds fails the run (Dask itself would wait for a worker forever). Either way the run is FAILED
  and nothing is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import os
import pickle
import signal
import threading
import time
import uuid
import warnings
from concurrent.futures import CancelledError
from types import TracebackType
from typing import Any, Callable, Iterator, NoReturn, Sequence

import cloudpickle
import dask
import distributed
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import WorkerPlugin

from stages.support.certificates import certificate_problem, certificate_refused
from stages.support.main_module import main_module_hidden
from stages.support.params import fail

# What to do about a worker that cannot import the project's code.
START_WORKERS = ("start every worker with the .venv of a checkout where `make` installed the project "
                 "(`source .venv/bin/activate && dask worker ...`), as the README's Dask sections show.")
# How long a scheduler may take to answer before the stage gives up with an error that names it.
CONNECT_S = 10.0
# How long to wait for a scheduler's first worker, and for a worker again once all are gone mid-run.
WORKERS_S = 60.0
# How often, while no batch finishes, the stage looks whether the scheduler still has workers.
WATCH_S = 5.0
# Where a LocalCluster serves its dashboard; the environment variable sets another address, or `off`.
DASHBOARD_ENV = "GAT_DASK_DASHBOARD"
DEFAULT_DASHBOARD = "127.0.0.1:8787"
# How long to wait for a LocalCluster's workers to close; they hold nothing worth saving.
CLOSE_S = 10.0
# A LocalCluster's settings where Dask's defaults suit many short tasks, not a few long CPU-bound ones on cores
# that all train: they took CPU from training (measured on 8 seeds of cora: the stage's CPU time, its workers'
# included, 12-18% above the `local` executor's with Dask's defaults, 0-3% with these).
LOCAL_CLUSTER_CONFIG: dict[str, Any] = {
    # The statistical profiler samples each worker's task thread every 10 ms, taking the GIL from training
    # (the dashboard's Profile page is empty without it).
    "distributed.worker.profile.enabled": False,
    # Every server's event-loop health check, every 20 ms: a thread wake-up and the GIL in each worker.
    # The profiler and this tick are what Dask's own tests turn down (distributed.utils_test).
    "distributed.admin.tick.interval": "500ms",
    # CPU/memory samples for the dashboard (500 ms) and each worker's memory-limit check (100 ms).
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.memory.monitor-interval": "500ms",
    # One batch at a time per single-threaded worker (Dask's 1.1 queues a second one on it): as with the local
    # executor, a free worker takes the next batch, and none waits behind another worker's long one at the end.
    "distributed.scheduler.worker-saturation": 1.0,
    # MALLOC_TRIM_THRESHOLD_=65536 in the workers' environment also turns off glibc's adaptive mmap threshold:
    # torch's temporaries over 128 KiB are then mapped and unmapped afresh, about 3x the page faults of a
    # `local` worker (None: Dask leaves the variable unset; one set in the environment still applies).
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
}


def scheduler_address() -> tuple[str, str] | None:
    """(the scheduler's address, where it was set), or None for a LocalCluster."""
    address = dask.config.get("scheduler-address", None)
    if not address:
        return None
    where = "DASK_SCHEDULER_ADDRESS" if os.environ.get("DASK_SCHEDULER_ADDRESS") else "Dask's `scheduler-address`"
    return str(address), where


def _still_wanted() -> Callable[[], bool]:
    """In a task: a function that says whether this task has been cancelled (its key released on the worker)."""
    worker = distributed.get_worker()
    key = worker.get_current_task()

    def cancelled() -> bool:
        task = worker.state.tasks.get(key)  # read from the task's thread; the event loop's thread writes it
        return task is None or task.state == "cancelled"

    return cancelled


def run_task(function: Callable[..., Any], job: tuple[Any, ...], shared: Any) -> Any:
    """What a Dask worker runs: `function(shared, *job, should_stop=...)`."""
    return function(shared, *job, should_stop=_still_wanted())


def cloudpickled(value: Any) -> bytes:
    """`value` as bytes that only a worker unpickles (`_unpickled_on_worker`)."""
    return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _unpickled_on_worker(payload: bytes, *arguments: Any) -> tuple[Any, ...]:
    """A task's function and arguments for `client.submit`: `pickle.loads(payload)(*arguments)` on the worker.

    The scheduler unpickles every task it is sent (distributed >= 2024.12 sends the whole graph pickled), so a
    task whose function or arguments are the project's objects needs `stages` and `gat` importable on the
    scheduler too: a `dask scheduler` where the project is not installed fails every task ("Error during
    deserialization of the task graph", from `No module named 'stages'`). Here the scheduler sees only the
    standard library's functions and bytes: `functools.reduce(operator.call, [payload, *arguments], pickle.loads)` is
    `pickle.loads(payload)(*arguments)` with one argument, and a dependency's future among `arguments` is
    replaced by its result on the worker, as usual.
    """
    assert len(arguments) <= 1
    return functools.reduce, operator.call, [payload, *arguments], pickle.loads


class IgnoreCtrlC(WorkerPlugin):
    """A LocalCluster's worker processes are in the terminal's process group: Ctrl-C, and the SIGHUP of a closed
    terminal, reach them too. The stage, not each worker, decides what happens (it cancels the tasks and closes
    the cluster), so the workers ignore both, as stages.support.local_pool's do.
    `setup` runs in the worker process's main
    thread."""

    name = "gat-ignore-ctrl-c"

    def setup(self, worker: distributed.Worker) -> None:
        for signum in (signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)


class DaskPool:
    """A Dask client, and the LocalCluster it started (None when it connected to a scheduler)."""

    def __init__(self, client: Client, cluster: LocalCluster | None, address: str,
                 dashboard: str | None = None) -> None:
        self.client, self.cluster, self.address, self.dashboard = client, cluster, address, dashboard
        self._futures: list[distributed.Future] = []

    @property
    def size(self) -> int:
        """The workers the scheduler knows of now."""
        return len(self.client.scheduler_info(n_workers=-1)["workers"])

    def describe(self) -> str:
        where = (f"a LocalCluster of {self.size} single-threaded workers" if self.cluster is not None
                 else f"the Dask scheduler at {self.address} ({self.size} workers now)")
        return where + (f", dashboard {self.dashboard}" if self.dashboard else "")

    def run_on_workers(self, function: Callable[[], Any]) -> dict[str, Any]:
        """`function()` on every worker now, by address; a worker that cannot import it (started without the
        project installed in its environment) is a one-line error here that names it."""
        found = self.client.run(function, on_error="return")
        failed = {worker: value for worker, value in found.items() if isinstance(value, BaseException)}
        if failed:
            worker, error = sorted(failed.items())[0]
            others = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
            fail(f"the Dask worker {worker}{others} of the scheduler at {self.address} cannot import the project's "
                 f"code ({_one_line(error)}): {START_WORKERS}")
        return found

    def as_completed(self, function: Callable[..., Any], shared: Any,
                     jobs: Sequence[tuple[Any, ...]]) -> Iterator[tuple[int, Any]]:
        """`function(shared, *job, should_stop=...)` for each job as a task; (its index, its result) as each
        finishes. `shared` is sent to every worker once."""
        run = uuid.uuid4().hex[:8]
        # The graph is a task of its own that returns it, not scattered data: a worker fetches it from a peer
        # once, for its first batch, and keeps it while batches wait for it. Scattered data can't be recomputed:
        # once the Active Memory Manager has trimmed the replicas (near the end of a run), the death of the
        # worker holding the last one would cancel every batch still to run.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sending large graph")  # Pubmed's is 12 MB: sent once
            graph = self.client.submit(pickle.loads, cloudpickled(shared), key=f"graph-{run}", pure=False)
        # One named key per batch: `train_seeds-<run>-<batch>` reads well on the dashboard, and is never
        # shared with another stage's tasks.
        futures = {self.client.submit(*_unpickled_on_worker(cloudpickled(functools.partial(run_task, function, job)),
                                                            graph),
                                      key=f"train_seeds-{run}-{index}", pure=False): index
                   for index, job in enumerate(jobs)}
        self._futures = [graph, *futures]
        completed = distributed.as_completed(futures, loop=self.client.loop)
        while not completed.is_empty():
            self._wait_for_a_result(completed)
            future = next(completed)
            result = self._result(future)
            future.release()
            yield futures[future], result

    def _wait_for_a_result(self, completed: distributed.as_completed) -> None:
        """Wait until `completed` has a finished task, looking every WATCH_S seconds whether the scheduler still
        has workers: Dask waits for one forever, here WORKERS_S at most, then a one-line error."""
        workerless_since: float | None = None
        watched = time.monotonic()
        while not completed.has_ready():
            time.sleep(0.1)  # as often as `next(completed)` itself looks
            if time.monotonic() - watched < WATCH_S:
                continue
            watched = time.monotonic()
            if self.size:
                workerless_since = None
            elif workerless_since is None:
                workerless_since = watched
            elif watched - workerless_since > WORKERS_S:
                fail(f"the Dask scheduler at {self.address} has had no workers for {WORKERS_S:.0f} s during the run "
                     f"(they went away): start some with `dask worker {self.address} --nthreads 1` (see the README's "
                     "multi-host section), then rerun.")

    def _cancelled(self, error: CancelledError) -> NoReturn:
        """The one-line error for a task cancelled under the stage: the scheduler went away (the client cancels
        every task as it loses it), or someone else cancelled it (`client.restart()`, another client)."""
        if getattr(error, "reason", None) == "scheduler-connection-lost" or self.client.status != "running":
            fail(f"the Dask scheduler at {self.address} went away during the run ({type(error).__name__}): restart "
                 f"it and its workers (`dask scheduler`, then `dask worker {self.address} --nthreads 1`, as the "
                 "README's multi-host section shows), then rerun.")
        fail(f"the Dask scheduler at {self.address} cancelled the stage's tasks during the run "
             f"({type(error).__name__}: {_one_line(error)}): was it restarted? Rerun.")

    def _result(self, future: distributed.Future) -> Any:
        """A finished task's result, or a one-line error that says why it has none."""
        try:
            return future.result()
        except CancelledError as error:
            self._cancelled(error)
        except RuntimeError as error:
            if "deserialization of the task graph" not in str(error):
                raise
            cause = error.__cause__ or error
            fail(f"the Dask scheduler at {self.address} cannot read the stage's tasks ({type(cause).__name__}: "
                 f"{_one_line(cause)}): start it with this checkout's .venv, `source .venv/bin/activate` "
                 "first, as the README's Dask sections show.")
        except ImportError as error:
            fail(f"a Dask worker of the scheduler at {self.address} cannot import the project's code "
                 f"({type(error).__name__}: {_one_line(error)}): {START_WORKERS}")
        except distributed.KilledWorker as error:
            fail(f"Dask gave up on a batch of seeds: the workers running it died again and again ({error}). "
                 "Look at the workers' logs (out of memory?).")

    def cancel(self) -> None:
        """Cancel this pool's tasks: queued ones never start, running ones stop at their next epoch."""
        if self._futures:
            with contextlib.suppress(Exception):  # the scheduler may be gone already
                self.client.cancel(self._futures, reason="the reproduce stage stopped")
            self._futures = []

    def kill_local_workers(self) -> None:
        """SIGKILL a LocalCluster's worker processes (a batch in the middle of training has nothing to save, and
        a finished run has all its results), rather than wait seconds for them to close; their nannies, told
        first, don't restart them."""
        nannies = list(self.cluster.workers.values()) if self.cluster is not None else []
        for nanny in nannies:
            with contextlib.suppress(Exception):
                nanny.close_gracefully(reason="the reproduce stage stopped")
        for nanny in nannies:
            with contextlib.suppress(Exception):
                os.kill(nanny.pid, signal.SIGKILL)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close(timeout=CLOSE_S)
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.close(timeout=CLOSE_S)

    def __enter__(self) -> "DaskPool":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is not None:
            self.cancel()
        # A LocalCluster's workers hold nothing worth saving, on an error or once every result is in: killed,
        # they are gone at once; a graceful close takes a second or two more (each worker process winds down).
        # Its scheduler's INFO lines about the comms that broke (with tracebacks) say nothing to a user: the
        # cluster logs only errors while it runs (silence_logs), but lifts that as it closes. A client whose
        # scheduler went away logs, as it closes, an error of its own (its attempts to reconnect end: "Failed to
        # reconnect to scheduler", or a CancelledError's traceback), which the stage's one line already says.
        with _logging_at_most("distributed", logging.ERROR) if self.cluster is not None else \
                _logging_at_most("distributed.client", logging.CRITICAL):
            self.kill_local_workers()
            self.close()


def _one_line(error: BaseException) -> str:
    """An exception's message on one line, at most 200 characters (Dask wraps a worker's in `Exception('...')`)."""
    return " ".join(str(error).split())[:200] or type(error).__name__


@contextlib.contextmanager
def _logging_at_most(name: str, level: int) -> Iterator[None]:
    """The logger `name` passes only records of `level` and above in the block."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


async def _handshake(address: str) -> None:
    """Open one connection to the scheduler, Dask's handshake included, and close it."""
    from distributed.comm import connect
    from distributed.security import Security

    comm = await connect(address, timeout=CONNECT_S, **Security().get_connection_args("client"))
    await comm.close()


BUNDLE_HINT = ("ask the team's admin for a bundle (`python -m team issue NAME` on the server host), then `source` its "
               "team.env")


def _check_tls_client(address: str) -> None:
    """For a `tls://` scheduler: this client's certificate, key and the team's CA are set (Dask's config, which a
    bundle's team.env sets), and the certificate is one the scheduler will accept. A scheduler refuses a bad one
    during the handshake, and the client then learns only that the connection closed."""
    settings = {name: dask.config.get(f"distributed.comm.tls.{key}", None) for name, key in (
        ("DASK_DISTRIBUTED__COMM__TLS__CA_FILE", "ca-file"),
        ("DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT", "client.cert"),
        ("DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY", "client.key"))}
    unset = [name for name, value in settings.items() if not value]
    if unset:
        fail(f"the Dask scheduler at {address} speaks TLS, and this client has no certificate ({', '.join(unset)} "
             f"not set): {BUNDLE_HINT}")
    ca_file, cert_file, _ = settings.values()
    problem = certificate_problem(str(cert_file), str(ca_file))
    if problem:
        fail(f"this client's Dask certificate {cert_file} {problem}: the scheduler at {address} would refuse it; "
             f"{BUNDLE_HINT}")


def _connect(address: str, where: str) -> Client:
    if address.startswith("tls://"):
        _check_tls_client(address)
    # A Client whose constructor fails leaves a half-started object whose finalizer waits 20 s more and prints
    # a traceback at exit: try the address with a bare connection first.
    try:
        asyncio.run(_handshake(address))
    except Exception as error:  # refused, no route, no such host, no answer in time, not a Dask scheduler
        reason = (" ".join(str(error).split()) or "no answer")[:200]
        refused = certificate_refused(error)
        if refused is not None:
            fail(f"the Dask scheduler at {address} (from {where}) has a TLS certificate that the CA in "
                 f"DASK_DISTRIBUTED__COMM__TLS__CA_FILE does not vouch for ({refused}): {BUNDLE_HINT}")
        fail(f"cannot reach the Dask scheduler at {address} (from {where}) within {CONNECT_S:.0f} s "
             f"({type(error).__name__}: {reason}). Start it (`dask scheduler`), fix the address, or unset it to "
             "run on a local cluster.")
    client = Client(address, timeout=CONNECT_S, set_as_default=False)
    try:
        client.wait_for_workers(1, timeout=WORKERS_S)
    except (OSError, TimeoutError):
        client.close()
        fail(f"the Dask scheduler at {address} (from {where}) has no workers after {WORKERS_S:.0f} s: start some "
             f"with `dask worker {address} --nthreads 1` (see the README's multi-host section).")
    return client


def local_cluster_config() -> dict[str, Any]:
    """LOCAL_CLUSTER_CONFIG, less the keys whose value the user changed from Dask's default (config file or
    DASK_* variable): those keep the user's value."""
    defaults = dask.config.merge(*dask.config.defaults)
    unset = object()
    return {key: value for key, value in LOCAL_CLUSTER_CONFIG.items()
            if dask.config.get(key, unset) == dask.config.get(key, unset, config=defaults)}


def _local_cluster(workers: int) -> DaskPool:
    dashboard: str | None = os.environ.get(DASHBOARD_ENV, DEFAULT_DASHBOARD).strip()
    if dashboard is not None and dashboard.lower() in ("", "off", "none"):
        dashboard = None
    # The scheduler and nannies (in this process) read the settings as they start, and each nanny hands its
    # worker process a copy of this config. The workers skip the stage's main module: Dask pickles a function
    # defined there by value (cloudpickle), so they never need it.
    with dask.config.set(local_cluster_config()), main_module_hidden():
        # Without a dashboard the scheduler still serves /health and /metrics over HTTP, by default on 8787: on
        # a free loopback port then, so that several stages' clusters never compete for one.
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address=dashboard, silence_logs=logging.ERROR,
                               scheduler_kwargs=None if dashboard else {"dashboard_address": "127.0.0.1:0"})
    try:
        client = Client(cluster, set_as_default=False)
        client.register_plugin(IgnoreCtrlC())
    except BaseException:
        cluster.close(timeout=CLOSE_S)
        raise
    return DaskPool(client, cluster, cluster.scheduler_address, cluster.dashboard_link if dashboard else None)


def dask_pool(workers: int) -> DaskPool:
    """Connect to the configured scheduler, else start a LocalCluster of `workers` processes (0: one per core)."""
    configured = scheduler_address()
    if configured is not None:
        address, where = configured
        return DaskPool(_connect(address, where), None, address)
    return _local_cluster(workers or os.cpu_count() or 1)


class StartingPool:
    """`dask_pool(workers)`, a LocalCluster started in a thread as the block begins, so that its workers' start
    (seconds: a process each, importing torch) overlaps the stage's own set-up; a configured scheduler is
    connected to when the pool is asked for, in the calling thread, as before.

        with starting_dask_pool(2) as starting:   # a LocalCluster starts now
            ...                                   # the stage's own set-up (its MLflow run)
            with starting.pool() as pool:         # waits for it; a failure to start raises here
                ...

    Leaving the outer block on an exception before `pool()` waits for the start and closes what it started,
    so no worker outlives the stage."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._pool: DaskPool | None = None
        self._error: BaseException | None = None
        self._taken = False
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        try:
            self._pool = _local_cluster(self._workers or os.cpu_count() or 1)
        except BaseException as error:  # handed to the thread that asks for the pool
            self._error = error

    def __enter__(self) -> "StartingPool":
        if scheduler_address() is None:
            self._thread = threading.Thread(target=self._start, name="gat-dask-start")
            self._thread.start()
        return self

    def pool(self) -> DaskPool:
        """The pool, once started: waits for the LocalCluster, or connects to the configured scheduler now."""
        if self._thread is None:
            self._taken = True
            return dask_pool(self._workers)
        self._thread.join()  # a signal's exception here leaves the pool to __exit__
        self._taken = True
        if self._error is not None:
            raise self._error
        assert self._pool is not None
        return self._pool

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._taken or self._thread is None:
            return  # the pool's own block closed it
        self._thread.join()
        if self._pool is not None:
            self._pool.__exit__(kind or SystemExit, error, traceback)


def starting_dask_pool(workers: int) -> StartingPool:
    """A pool of `workers` Dask workers (0: one per core) that starts as the `with` block begins; see StartingPool."""
    return StartingPool(workers)
