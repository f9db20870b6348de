"""The tracking store: where it is (SQLite at the repo root, or a team server), connecting to it, its experiments
and their views, what its errors mean, and the runs that stopped stages left RUNNING."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

# The machines here have no internet, and a pipeline should not phone home: no usage telemetry.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402  (after the telemetry switch, which MLflow reads when it starts)
import requests  # noqa: E402
from filelock import FileLock
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from stages.support.certificates import certificate_refused
from stages.support.redaction import redact_urls
from stages.support.files import disk_full, no_space
from stages.support.params import fail, repo_root

# Separate experiments keep the training table one row per training configuration.


# Separate experiments keep the training table one row per training configuration.
TRAIN_EXPERIMENT = "gat-repro"
DATA_EXPERIMENT = "gat-repro-data"
REPRODUCE_EXPERIMENT = "gat-repro-reproduce"
COMPARE_EXPERIMENT = "gat-repro-compare"
ABLATION_EXPERIMENT = "gat-repro-ablation"
EXPERIMENTS = (TRAIN_EXPERIMENT, REPRODUCE_EXPERIMENT, DATA_EXPERIMENT, COMPARE_EXPERIMENT, ABLATION_EXPERIMENT)
# The tag that tells the ablation's three levels of runs apart: `invocation` (one per `make ablation`, with the
# report), `cell` (a dataset and attention variant, with its summary), `seed` (one seed of a cell).
ABLATION_LEVEL = "ablation_level"

# What each experiment holds: its description in the UI (the `mlflow.note.content` tag).
DESCRIPTIONS = {
    TRAIN_EXPERIMENT: "One row per training configuration (stages train + evaluate): the params with params.yaml's "
                      "dotted keys, test_acc, val_acc, test_macro_f1, epochs and best_epoch of the restored "
                      "checkpoint, per-epoch curves (`epoch_*`), the confusion matrix (JSON), the curves as a PNG, the "
                      "analyze stage's pictures and metrics (`analysis/`), and the model. The best configuration on "
                      "val_acc is registered as `gat-<dataset>@champion`.",
    DATA_EXPERIMENT: "One run per download or preprocess of a dataset: its source, checksums, sizes and split.",
    COMPARE_EXPERIMENT: "One run per `python -m tools.compare` (`make compare`): every reproduced configuration's "
                        "mean test accuracy with its 95% CI, per dataset, as a table (compare.md) and a plot "
                        "(compare.png), read from the gat-repro-reproduce parents.",
    ABLATION_EXPERIMENT: "Does attention matter? One parent run per `make ablation` (`python -m stages.ablation`), "
                         "with the report (ablation.md) and its picture; under it one run per dataset and attention "
                         "variant (tags dataset, variant, training_kernel; ablation_level = cell) with the mean, std "
                         "and 95% CI of test accuracy and the paired difference to gat; under each, one run per seed.",
    REPRODUCE_EXPERIMENT: "The paper's table: one parent run per dataset and reproduction config, with the mean, "
                          "std and 95% CI of test accuracy over the seeds and the report; one child run per seed.",
}

# The columns each experiment's runs table opens with, so the important values need no ticking among dozens.
# MLflow's UI loads a view state from the experiment tag `mlflow.sharedViewState.<key>` when the page's URL
# carries `viewStateShareKey=<key>`: `ui_url` builds that URL. It takes the search (searchFilter, orderByKey, ...)
# and the table's and charts' layout (selectedColumns, compareRunCharts, ...), never which rows are expanded.
VIEW_KEY = "main"
TRAIN_PARAMS = ("train.dataset", "train.seed", "train.optim.lr", "train.optim.weight_decay", "train.model.heads",
                "train.model.dropout")
# The Chart view's sections, and its first chart: the params against test_acc (MLflow's Compare page instead opens
# its parallel-coordinates plot on the first metric a run logged, epoch_train_loss for a training run). MLflow
# adds a chart per metric to the sections by itself: after this one in a section marked reordered, else sorted
# by name around it.
_SECTIONS = [{"uuid": f"gat-{name.split()[0].lower()}", "name": name, "display": True, "isReordered": True,
              "deleted": False, "isGenerated": True} for name in ("Model metrics", "System metrics")]
_PARAMS_TO_TEST_ACC = {"uuid": "gat-params-to-test-acc", "type": "PARALLEL", "metricSectionId": _SECTIONS[0]["uuid"],
                       "isGenerated": False, "deleted": False, "runsCountToCompare": 100, "showAllRuns": True,
                       "selectedParams": list(TRAIN_PARAMS[2:]), "selectedMetrics": ["test_acc"]}
VIEWS = {
    TRAIN_EXPERIMENT: {"orderByKey": "metrics.`val_acc`", "orderByAsc": False, "selectedColumns": [
        *(f"metrics.`{m}`" for m in ("test_acc", "val_acc", "test_macro_f1", "epochs", "best_epoch")),
        *(f"params.`{p}`" for p in TRAIN_PARAMS), "tags.`dvc_exp_name`"],
        "compareRunCharts": [_PARAMS_TO_TEST_ACC], "compareRunSections": _SECTIONS},
    # The parents only: MLflow nests child runs under their parent only in a table sorted by start time (and
    # unfiltered), where a page of 100 runs holds a parent's seeds but not always the parent; sorted on a metric,
    # it lists parents and seeds flat. Each parent's page lists its seeds ("Child runs").
    REPRODUCE_EXPERIMENT: {"searchFilter": "tags.`mlflow.parentRunId` IS NULL", "orderByKey": "metrics.`test_acc_mean`",
                           "orderByAsc": False, "selectedColumns": [
        *(f"metrics.`{m}`" for m in ("test_acc_mean", "test_acc_std", "test_acc_ci95_low", "test_acc_ci95_high",
                                     "val_acc_mean", "epochs_mean", "seeds")),
        "params.`reproduce.seeds`", "tags.`dataset`", "tags.`dvc_exp_name`"]},
    # The (dataset, variant) cells only, side by side: MLflow's table lists nested runs flat once filtered.
    ABLATION_EXPERIMENT: {"searchFilter": f"tags.`{ABLATION_LEVEL}` = 'cell'", "orderByKey": "attributes.start_time",
                          "orderByAsc": False, "selectedColumns": [
        "tags.`dataset`", "tags.`variant`",
        *(f"metrics.`{m}`" for m in ("test_acc_mean", "test_acc_std", "test_acc_ci95_low", "test_acc_ci95_high",
                                     "diff_to_gat_mean", "diff_to_gat_ci95_low", "diff_to_gat_ci95_high",
                                     "seeds_better_than_gat", "seeds_worse_than_gat", "seeds")),
        "tags.`training_kernel`", "tags.`cached`"]},
    COMPARE_EXPERIMENT: {"orderByKey": "attributes.start_time", "orderByAsc": False, "selectedColumns": [
        "metrics.`configurations`", "metrics.`runs`", "params.`varied`", "params.`dvc_experiments`"]},
    DATA_EXPERIMENT: {"orderByKey": "attributes.start_time", "orderByAsc": False, "selectedColumns": [
        *(f"metrics.`{m}`" for m in ("num_nodes", "num_edges", "num_features", "total_bytes", "seconds")),
        "params.`source`", "tags.`dataset`"]},
}

# The tag by which MLflow's UI tells a classic model-training experiment from a GenAI one; without it,
# MLflow 3 opens the experiment on an empty "Traces" page.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
NOTE = "mlflow.note.content"


def model_name(dataset: str) -> str:
    """What a logged model is called (and registered as): `gat-cora`."""
    return f"gat-{dataset}"


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI when set (a team server), else a SQLite file at the repo root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def shown_uri() -> str:
    """The tracking URI as messages show it: without a password."""
    return redact_urls(tracking_uri())


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


# MLflow's HTTP client waits 120 s for an answer and retries 7 times with a growing backoff, and urllib3 retries
# a read timeout too: a frozen server held a stage for many minutes. These defaults (the user's own settings win)
# give up on one request after 3 tries of 10 s and 2-4 s of backoff, 32-34 s; the cleanup that follows
# (_end_failed) takes at most CLEANUP_TIMEOUT_S more.
# MLflow also prints two "View run at <url>" lines per run against a server: 200 for reproduce's children.
# Artifacts come through the server (which checks its object store's certificate), not from presigned object-store URLs,
# which MLflow fetches trusting only the system's CAs: against a store with a certificate of the team's CA, each file
# would fail and be retried for a minute.
# `.team/env` exports the request settings to every client of the team's server, the user's own Python too: with
# MLflow's defaults, `mlflow.pyfunc.load_model("runs:/<run_id>/gat-cora")` spent 4 minutes retrying the server's
# error for the run's own copy of the model, which MLflow 3 asks for before the logged model's (there is none).
SERVER_REQUEST_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                           "MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD": "false"}
SERVER_CLIENT_DEFAULTS = {**SERVER_REQUEST_SETTINGS, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
# What talking to a tracking server can raise: MLflow's own errors, and requests' once its retries are spent.
SERVER_ERRORS = (MlflowException, requests.RequestException)
# Marking a run FAILED after the server failed: one try, this long; a server that did not answer the stage's
# request will rarely answer this one, and the stage should not wait for it again.
CLEANUP_TIMEOUT_S = 3


def from_server(error: BaseException) -> bool:
    """Whether `error` is the server's (an error answer, or no answer), not a local mistake of MLflow's."""
    from mlflow.exceptions import RestException

    return isinstance(error, (RestException, requests.RequestException)) or (
        isinstance(error, MlflowException) and str(error).startswith("API request to"))


def use_store() -> str:
    """Point MLflow at the tracking store and return its URI; a server is checked first (check_server)."""
    uri = tracking_uri()
    # No progress bar on stderr for every model downloaded (model_digest, load_verified_model), from any store.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if is_server(uri):
        for key, value in SERVER_CLIENT_DEFAULTS.items():
            os.environ.setdefault(key, value)
        check_server(uri)
    else:
        # MLflow logs every failed SQLite write (a full disk: one per write) with its traceback, then raises it;
        # what the stage does with the error (one line, or the traceback of a bug) says it once.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    mlflow.set_tracking_uri(uri)
    return uri


def server_verify() -> str | bool:
    """What an HTTPS server's certificate is checked against, as MLflow's client does: the CA file in
    MLFLOW_TRACKING_SERVER_CERT_PATH, else the system's CAs (MLFLOW_TRACKING_INSECURE_TLS=true: nothing)."""
    from mlflow.environment_variables import MLFLOW_TRACKING_INSECURE_TLS, MLFLOW_TRACKING_SERVER_CERT_PATH

    if MLFLOW_TRACKING_INSECURE_TLS.get():
        return False
    return MLFLOW_TRACKING_SERVER_CERT_PATH.get() or True


def check_server(uri: str) -> None:
    """One request, before any work, that the server answers and takes the credentials: a one-line error
    within seconds (at most 5 s to connect, 20 s to answer) instead of a traceback after the retries."""
    shown = redact_urls(uri)  # a password in the URI is never printed
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    auth = (user, os.environ.get("MLFLOW_TRACKING_PASSWORD", "")) if user else None
    verify = server_verify()
    if isinstance(verify, str) and not os.path.isfile(verify):
        fail(f"MLFLOW_TRACKING_SERVER_CERT_PATH={verify} is not a file: point it at the team's CA certificate "
             "(`source .team/env`, or the env of your bundle from `python -m team issue`)")
    try:
        response = requests.get(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search", params={"max_results": 1},
                                auth=auth, timeout=(5, 20), verify=verify)
    except requests.RequestException as error:
        why = certificate_refused(error)
        if why is not None:
            trusted = f"the CA in MLFLOW_TRACKING_SERVER_CERT_PATH ({verify})" if isinstance(verify, str) else \
                "the system's CAs (MLFLOW_TRACKING_SERVER_CERT_PATH is not set)"
            fail(f"the MLflow server at {shown} has a TLS certificate that {trusted} does not vouch for ({why}): "
                 "set MLFLOW_TRACKING_SERVER_CERT_PATH to the team's CA certificate (`source .team/env`, or your "
                 "bundle's env), or ask the team's admin whether the server's certificate changed")
        fail(f"the MLflow tracking server at {shown} is unreachable ({type(error).__name__}): start it "
             "(`make team-up`, then `source .team/env`), or check MLFLOW_TRACKING_URI")
    if response.status_code == 401:
        who = f"user '{user}'" if user else "no user (MLFLOW_TRACKING_USERNAME is not set)"
        fail(f"the MLflow server at {shown} refused the credentials of {who}: check MLFLOW_TRACKING_USERNAME "
             "and MLFLOW_TRACKING_PASSWORD (`source .team/env`)")
    if response.status_code != 200:
        fail(f"{shown} answered HTTP {response.status_code} to an MLflow API call: check MLFLOW_TRACKING_URI (is it "
             "an MLflow tracking server?) and the server's log")


def foreign_managers(uri: str, auth: tuple[str, str] | None, resource_type: str, pattern: str,
                     verify: str | bool | None = None) -> list[str]:
    """The users other than admins who hold MANAGE on a resource (`experiment` by id, `registered_model` by
    name): MLflow gives it to whoever created the resource. Only an admin may list users: for anyone else (or a
    server without basic-auth) the answer is an empty list."""
    try:
        response = requests.get(f"{uri.rstrip('/')}/api/2.0/mlflow/users/list", auth=auth, timeout=(5, 20),
                                verify=server_verify() if verify is None else verify)
    except requests.RequestException:
        return []
    if response.status_code != 200:
        return []
    return sorted({user["username"] for user in response.json().get("users", []) if not user.get("is_admin")
                   for role in user.get("roles") or [] for grant in role.get("permissions") or []
                   if grant.get("resource_type") == resource_type and grant.get("resource_pattern") == pattern
                   and grant.get("permission") == "MANAGE"})


def _client_auth() -> tuple[str, str] | None:
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    return (user, os.environ.get("MLFLOW_TRACKING_PASSWORD", "")) if user else None


def refuse_a_foreign_name(kind: str, name: str, pattern: str) -> None:
    """Stop, in one line, when a name the pipeline writes to is managed by another (non-admin) user."""
    uri = tracking_uri()
    if not is_server(uri):
        return
    resource_type = "experiment" if kind == "experiment" else "registered_model"
    owners = foreign_managers(uri, _client_auth(), resource_type, pattern)
    if owners:
        fail(redact_urls(f"the {kind} {name} on the MLflow server at {uri} is managed by user '{owners[0]}', "
                         "not by the pipeline's admin (someone created it first): the server's admin deletes it or "
                         "revokes that permission, then runs `make team-up`, which creates every pipeline name as "
                         "the admin"))


def timed_out(error: BaseException) -> bool:
    """Whether the server took no answer within MLflow's timeout (urllib3's retries turn a read timeout into a
    ConnectionError whose text names it; MLflow wraps both in an MlflowException)."""
    text = str(error)
    return isinstance(error, requests.Timeout) or "ReadTimeoutError" in text or "timeout exception" in text


def _why_silent(error: BaseException) -> str:
    """Why a server may not answer: an artifact waits on its object store too (the server proxies artifacts)."""
    if "/mlflow-artifacts/" in str(error):
        return "it could not store an artifact (is its object store up?), or it is stopped, frozen or overloaded"
    return "it is stopped, frozen or overloaded"


def _run_fate(ended: bool | None) -> str:
    """What became of the stage's run: None when none was started, else whether it could be marked FAILED."""
    if ended is None:
        return "no run was started"
    return "the run is marked FAILED" if ended else ("the run stays RUNNING until the next stage on this host that "
                                                     "opens its experiment marks it KILLED")


def server_problem(error: BaseException, what: str, ended: bool | None = None) -> str:
    """One line for a failure of the tracking server in the middle of a stage; `ended`: whether the run could
    still be marked FAILED (None: no run was started)."""
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    uri, fate = shown_uri(), _run_fate(ended)
    if timed_out(error):
        timeout, tries = MLFLOW_HTTP_REQUEST_TIMEOUT.get(), MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() + 1
        return redact_urls(f"the MLflow tracking server at {uri} did not answer within {timeout} s ({tries} tries; "
                           f"MLFLOW_HTTP_REQUEST_TIMEOUT) while logging to {what}: {_why_silent(error)}; {fate} and no "
                           "output is written: check the server (`python -m team status`, its log), then rerun")
    if isinstance(error, MlflowException) and error.error_code == "PERMISSION_DENIED":
        user = os.environ.get("MLFLOW_TRACKING_USERNAME", "?")
        return redact_urls(f"user '{user}' may not write to {what} on the MLflow server at {uri} "
                           "(PERMISSION_DENIED): ask the server's admin for EDIT permission, or use an account that "
                           "has it (MLFLOW_TRACKING_USERNAME)")
    text = str(error)
    if "/mlflow-artifacts/" in text:  # the server proxies artifacts: its object store failed, or it did
        problem = "it could not store an artifact (is its object store up?)"
    elif "Max retries exceeded" in text or isinstance(error, requests.ConnectionError):
        problem = "it stopped answering"
    else:
        problem = (text.strip().splitlines() or [type(error).__name__])[0][:200]
    return redact_urls(f"the MLflow server at {uri} failed while logging to {what}: {problem}. {fate[0].upper()}"
                       f"{fate[1:]} and no output is written: check the server's log, then rerun")


def store_full(error: BaseException) -> Path | None:
    """Where the disk that `error` found full is, when it was the store's: the SQLite database's folder (SQLite's
    "database or disk is full", which MLflow wraps) or the local artifact folder (an OSError from MLflow's copy
    of an artifact); None for any other error (a full disk elsewhere is stages.support.interrupts.main's to say)."""
    for link in _chain(error):
        if isinstance(link, OSError) and disk_full(link) and _raised_in(link, "mlflow/store/artifact/"):
            return Path(link.filename).parent if link.filename else artifact_root()
        if "database or disk is full" in str(link):
            return _sqlite_folder(tracking_uri())
    return None


def _raised_in(error: BaseException, path_part: str) -> bool:
    """Whether `error` passed through code whose file path holds `path_part`."""
    traceback = error.__traceback__
    while traceback is not None:
        if path_part in traceback.tb_frame.f_code.co_filename.replace(os.sep, "/"):
            return True
        traceback = traceback.tb_next
    return False


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and the errors it was raised from or while handling."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def store_problem(error: BaseException, what: str, ended: bool | None = None) -> str:
    """One line for a failure of the tracking store: a full disk under a local store, else the server's."""
    full = store_full(error)
    if full is not None:
        return f"{no_space(full)}; {_run_fate(ended)}"
    return server_problem(error, what, ended)


def _sqlite_folder(uri: str) -> Path | None:
    """The folder of a SQLite store's database file (`sqlite:///rel` or `sqlite:////abs`), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///")).resolve().parent


def artifact_root() -> Path:
    # Next to the database, so a store elsewhere (tests: a tmp SQLite file) keeps its artifacts out of the repo.
    return (_sqlite_folder(tracking_uri()) or repo_root()) / "mlartifacts"


def store_lock() -> contextlib.AbstractContextManager:
    """A file lock beside a SQLite store (whose first migration, and read-then-write steps, race); else nothing."""
    store = _sqlite_folder(tracking_uri())
    return FileLock(str(store / ".mlflow.lock")) if store else contextlib.nullcontext()


def connect(experiment: str) -> str:
    """Point MLflow at the store and return the experiment id, creating both once.

    A brand-new SQLite store migrated by two processes at once fails, so the first
    touch (schema creation, experiment creation) happens under a file lock.
    """
    uri = use_store()
    store = _sqlite_folder(uri)
    with store_lock():
        client = MlflowClient()
        found = client.get_experiment_by_name(experiment)
        tags = {EXPERIMENT_KIND[0]: EXPERIMENT_KIND[1], NOTE: DESCRIPTIONS[experiment],
                f"mlflow.sharedViewState.{VIEW_KEY}": json.dumps(VIEWS[experiment])}
        if found is None:
            location = (artifact_root() / experiment).as_uri() if store else None
            try:
                return client.create_experiment(experiment, artifact_location=location, tags=tags)
            except MlflowException as error:  # a server: another stage made it a moment ago
                if error.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                found = client.get_experiment_by_name(experiment)
                assert found is not None
        refuse_a_foreign_name("experiment", experiment, found.experiment_id)
        for key, value in tags.items():  # a store made by an older version of the project gets them too
            if found.tags.get(key) != value:
                client.set_experiment_tag(found.experiment_id, key, value)
    end_abandoned_runs(client, found.experiment_id, experiment)
    return found.experiment_id


# Who started a run: the host, the pid and the process's start time (the pid alone names another process once
# the pid is reused). A run still RUNNING whose process is gone was left by a killed stage, or by one whose
# server stopped answering: end_abandoned_runs ends it.
HOST_TAG, PID_TAG, PID_START_TAG = "stage.host", "stage.pid", "stage.pid_start"


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot: field 22 of /proc/<pid>/stat), or None when there is
    no such process (or only its zombie, which will never end a run)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the name (field 2), which may hold spaces and ")"
    state, start = fields[0], fields[19]  # fields 3 and 22
    return None if state in ("Z", "X") else start


def process_tags() -> dict[str, str]:
    """The tags naming this process as a run's owner; none where /proc does not say when it started."""
    start = process_start(os.getpid())
    if start is None:
        return {}
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), PID_START_TAG: start}


def _abandoned(run) -> bool:
    """Whether the process that started `run` (on this host) is gone, or its pid now names another process."""
    pid, start = run.data.tags.get(PID_TAG, ""), run.data.tags.get(PID_START_TAG)
    return pid.isdigit() and start is not None and process_start(int(pid)) != start


def end_abandoned_runs(client: MlflowClient, experiment_id: str, experiment: str) -> None:
    """End KILLED the runs of the experiment left RUNNING by a stage of this host that is gone, and say so in one
    line. Runs of other hosts (their processes cannot be seen from here), of living processes (a stage running
    now, reproduce's parent while its children are logged) and without the tags (older runs) are left alone."""
    if not process_tags():
        return
    host = socket.gethostname()
    found = client.search_runs([experiment_id], max_results=1000, filter_string=(
        f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'"))
    abandoned = [run for run in found if _abandoned(run)]
    for run in abandoned:
        client.set_terminated(run.info.run_id, "KILLED")
    if abandoned:
        pids = ", ".join(sorted({run.data.tags[PID_TAG] for run in abandoned}, key=int))
        runs = f"{len(abandoned)} run{'s' if len(abandoned) > 1 else ''}"
        print(f"note: ended {runs} of {experiment} left RUNNING by stopped stages (pids {pids} on host {host}) "
              "as KILLED", file=sys.stderr)


def compare_url(base: str, run_ids: list[str], experiment_ids: list[str]) -> str:
    """MLflow's page comparing runs (its parallel-coordinates plot, params and metrics side by side), in the
    "Model training" view: the page the runs table's Compare button opens keeps no `workflowType` (ui_url)."""
    runs, experiments = (quote(json.dumps(ids, separators=(",", ":"))) for ids in (run_ids, experiment_ids))
    return f"{base.rstrip('/')}/#/compare-runs?runs={runs}&experiments={experiments}&workflowType=machine_learning"


def ui_url(base: str, experiment_id: str, charts: bool = False) -> str:
    """The UI page of an experiment's runs, in the "Model training" view, with the important columns shown; with
    `charts`, its Chart view (VIEWS' compareRunCharts first) instead of the table.

    MLflow 3.17 picks GenAI or Model training for the whole UI from the `workflowType` URL parameter (else
    the browser's last choice, GenAI at first); the experiment's `mlflow.experimentKind` tag marks its kind.
    """
    mode = "&compareRunsMode=CHART" if charts else ""
    return (f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs"
            f"?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}{mode}")
