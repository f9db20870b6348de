"""Team mode: a shared MLflow server on PostgreSQL and S3, and a DVC remote on the same object store.

`python -m team up|down|status|remote` (`make team-up`, `make team-down`, `make team-remote`). See
team.backend for what runs where, and the README's "Team mode" section for how a group uses it.
"""
