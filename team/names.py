"""The pipeline's MLflow names (its experiments and registered models), claimed by the admin when the backend
starts, so that no other user creates one first and manages it."""

from __future__ import annotations

from pathlib import Path

from team.settings import ADMIN_USER, Settings, TeamError, say

def pipeline_names(repo: Path) -> tuple[list[str], list[str]]:
    """The experiments and registered models the pipeline creates: every dataset of params.yaml's `datasets`."""
    import yaml

    from stages.support.store import DESCRIPTIONS, model_name

    try:
        datasets = yaml.safe_load((repo / "params.yaml").read_text()).get("datasets") or []
    except (OSError, yaml.YAMLError, AttributeError) as error:
        raise TeamError(f"cannot read the datasets of {repo / 'params.yaml'} ({error}): fix it, then rerun") from None
    return list(DESCRIPTIONS), [model_name(str(dataset)) for dataset in datasets]


def claim_names(settings: Settings, repo: Path, ca_file: Path) -> list[str]:
    """Create, as the admin, every experiment and registered model the pipeline will use, so that no other user
    can create one first and own it (MLflow gives a name's creator MANAGE on it). Returns the names made now."""
    import requests

    api, auth = f"{settings.tracking_uri}/api/2.0/mlflow", (ADMIN_USER, settings.admin_password)
    experiments, models = pipeline_names(repo)
    made = []
    for kind, names, get, create, key in (
            ("experiment", experiments, "experiments/get-by-name", "experiments/create", "experiment_name"),
            ("registered model", models, "registered-models/get", "registered-models/create", "name")):
        for name in names:
            found = requests.get(f"{api}/{get}", params={key: name}, auth=auth, timeout=30, verify=str(ca_file))
            if found.status_code == 200:
                continue
            created = requests.post(f"{api}/{create}", json={"name": name}, auth=auth, timeout=30,
                                    verify=str(ca_file))
            if created.status_code != 200:
                raise TeamError(f"the admin could not create the {kind} {name!r} (HTTP {created.status_code}: "
                                f"{created.text[:120]}): see {settings.tracking_uri}'s log")
            made.append(name)
    _warn_foreign_names(settings, experiments, models, ca_file)
    return made


def _warn_foreign_names(settings: Settings, experiments: list[str], models: list[str], ca_file: Path) -> None:
    """One line for each pipeline name another user manages (created before `team up` claimed it): the stages
    refuse it, and the admin deletes it or revokes that user's MANAGE permission."""
    import requests

    from stages.support.store import foreign_managers

    api, auth = f"{settings.tracking_uri}/api/2.0/mlflow", (ADMIN_USER, settings.admin_password)
    resources = [("registered model", "registered_model", name, name) for name in models]
    for name in experiments:
        found = requests.get(f"{api}/experiments/get-by-name", params={"experiment_name": name}, auth=auth, timeout=30,
                             verify=str(ca_file))
        if found.status_code == 200:
            resources.append(("experiment", "experiment", name, found.json()["experiment"]["experiment_id"]))
    for kind, resource_type, name, pattern in resources:
        owners = foreign_managers(settings.tracking_uri, auth, resource_type, pattern, str(ca_file))
        if owners:
            say(f"warning: the {kind} {name} is managed by user '{owners[0]}', not by {ADMIN_USER}: the stages refuse "
                f"it until {ADMIN_USER} deletes it or revokes that permission")
