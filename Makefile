# Two commands do everything on a fresh machine: `make repro` and `make test`.
# Each creates .venv and installs the pinned requirements itself.

VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
PYTHON ?= python3
# Stages run `python -m stages.*` through DVC: the venv's python must come first on PATH.
RUN := PATH="$(BIN):$$PATH"
# No usage telemetry from MLflow or DVC (and these machines have no internet to send it to).
export MLFLOW_DISABLE_TELEMETRY := true
export DVC_NO_ANALYTICS := 1
PIP_INSTALL := $(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: repro test test-all lint ui serve exps bench bench-team bench-scale compare ablation figures constraints clean team-up team-down team-status team-remote team-repro system-deps

# The project itself is installed in editable mode (pyproject.toml): the venv's python imports gat, stages and tools
# from any folder, with no PYTHONPATH.
$(VENV)/.runtime: requirements.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -r requirements.txt
	$(PIP_INSTALL) --no-build-isolation --no-deps --editable .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PIP_INSTALL) -r requirements-dev.txt
	touch $@

# The fused training kernel (gat/csrc/fused.cpp), compiled into .venv/gat-fused/ by the system C++ compiler and
# self-checked against the torch path (gat/fused_check.py) before it is used (tools/build_fused.py).
# Where that is impossible it says why, leaves no stamp (the next make tries again), and `kernel: fused` trains
# with the torch kernel instead.
$(VENV)/.fused: $(VENV)/.runtime gat/csrc/fused.cpp gat/fused.py gat/fused_check.py tools/build_fused.py
	if $(BIN)/python -m tools.build_fused; then touch $@; fi

## repro: set up .venv and run the whole pipeline (dvc repro)
repro: $(VENV)/.runtime $(VENV)/.fused
	$(RUN) $(BIN)/python -m tools.init_store
	$(RUN) $(BIN)/dvc repro

## test: set up .venv with the dev requirements and run the fast tier (minutes): every test that needs neither
## the real pipeline, nor a server, nor a Dask cluster, nor minutes of its own (markers in pyproject.toml)
test: $(VENV)/.dev $(VENV)/.fused
	$(RUN) $(BIN)/python -m pytest -m "not (e2e or team or dask or multihost or slow)" tests

## test-all: the whole suite, as CI runs it (the team tests start their own PostgreSQL, SeaweedFS and MLflow
## server: PostgreSQL must be installed, see `make system-deps`)
test-all: $(VENV)/.dev $(VENV)/.fused
	$(RUN) $(BIN)/python -m pytest tests

## system-deps: as root, install the Debian packages the team backend needs (PostgreSQL), if missing
system-deps:
	./team/install-system-deps.sh

## lint: set up .venv with the dev requirements, then ruff and mypy (ruff.toml, mypy.ini) on the code
lint: $(VENV)/.dev
	$(BIN)/ruff check gat stages tools benchmarks team tests
	$(BIN)/mypy gat stages tools benchmarks team

## ui: the MLflow UI on http://127.0.0.1:$(PORT) (PORT=5000 by default) against the project's store; it prints the
## pages to open once the UI answers, and Ctrl-C stops it (tools/ui.py). With a team server's settings sourced
## (MLFLOW_TRACKING_URI=http://...), the addresses of that server's pages instead
PORT ?= 5000
ui: $(VENV)/.runtime
	@$(RUN) $(BIN)/python -m tools.ui --port "$(PORT)"

## serve: serve a dataset's champion (models:/gat-<dataset>@champion) over HTTP on 127.0.0.1 until Ctrl-C:
## DATASET=cora by default, PORT=<n> or a free port; it prints the address once the server answers
DATASET ?= cora
serve: $(VENV)/.runtime
	$(RUN) $(BIN)/python -m tools.serve --dataset "$(DATASET)" $(if $(PORT),--port "$(PORT)")

## team-up: start the team backend (PostgreSQL, SeaweedFS S3, MLflow server with a login; HTTPS with a CA of its own in
## .team/tls/) on 127.0.0.1, or with GAT_TEAM_HOST=<this host's name> for other hosts (README: "Across hosts"),
## state in .team/, client settings in .team/env, this clone's DVC remote on its bucket; a no-op when up
team-up: $(VENV)/.runtime
	$(RUN) $(BIN)/python -m team up

## team-repro: with a team's .team/env sourced, every stage again, each logging to the team server (where `make repro`
## has already run, the pipeline is up to date: `make repro` would run nothing, and nothing would reach the server)
team-repro: $(VENV)/.runtime $(VENV)/.fused
	@case "$${MLFLOW_TRACKING_URI:-}" in http://*|https://*) ;; \
	  *) echo 'error: MLFLOW_TRACKING_URI names no tracking server: `source .team/env` (written by `make team-up`) first' >&2; \
	     exit 2 ;; \
	esac
	$(RUN) $(BIN)/python -m tools.init_store
	$(RUN) $(BIN)/dvc repro --force

## team-down: stop every process team-up started (by PID); the data stays in .team/
team-down: $(VENV)/.runtime
	$(RUN) $(BIN)/python -m team down

team-status: $(VENV)/.runtime
	$(RUN) $(BIN)/python -m team status

## team-remote: with a team's .team/env sourced, make its S3 bucket this clone's DVC remote (.dvc/config.local)
team-remote: $(VENV)/.runtime
	$(RUN) $(BIN)/python -m team remote

## bench: time this engine against PyTorch Geometric and the dense tutorial layer on Cora, and the fused kernel's
## training loop and whole reproduce stage against issue 22's starting point
## (from ../shared/datasets/planetoid, else from data/raw/cora, which `make repro` downloads)
bench: $(VENV)/.dev $(VENV)/.fused
	$(RUN) $(BIN)/python -m benchmarks.engine --out reports/benchmark.json

## bench-team: the time to log reproduce@cora's 100 child runs, SQLite against a team server (started for it)
bench-team: $(VENV)/.dev
	$(RUN) $(BIN)/python -m benchmarks.child_runs --out reports/benchmark-team.json

## figures: the README's pictures (reports/figures/): the pipeline up to analyze, then its PNGs copied
figures: $(VENV)/.runtime
	$(RUN) $(BIN)/python -m tools.init_store
	$(RUN) $(BIN)/dvc repro analyze
	mkdir -p reports/figures
	cp data/analysis/*.png reports/figures/

## exps: one line per DVC experiment (the workspace, the commit, each `dvc exp run`): its key metrics and the
## params it changed (tools/exps.py); options go to `dvc exp show`, e.g. `make exps ARGS=-A`
exps: $(VENV)/.runtime
	$(RUN) $(BIN)/python -m tools.exps $(ARGS)

## compare: one table and plot of every reproduced configuration (dvc exp sweeps), from MLflow
compare: $(VENV)/.runtime
	$(RUN) $(BIN)/python -m tools.compare --markdown reports/compare.md --plot reports/compare.png

## ablation: does attention matter? Every `ablation.variants` on `ablation.seeds` seeds of each `ablation.datasets`
## (tens of minutes; not part of `make repro`, whose data/prepared it reads): reports/ablation.md and .png, MLflow's
## gat-repro-ablation; finished seeds are cached in data/ablation/, so a rerun trains only what is missing or changed
ablation: $(VENV)/.runtime $(VENV)/.fused
	$(RUN) $(BIN)/python -m stages.ablation --data data/prepared --cache data/ablation --report reports/ablation.md --plot reports/ablation.png

## bench-scale: reproduce@cora's 100 seeds on the local executor and on Dask LocalClusters of 2 and 1 workers
bench-scale: $(VENV)/.dev
	$(RUN) $(BIN)/python -m benchmarks.scale --seeds 100 --out reports/scale.json

## constraints: re-pin every transitive package after changing requirements*.txt
constraints: $(VENV)/.dev
	$(BIN)/pip freeze --exclude-editable | sed 's/+cpu$$//' > constraints.txt.new
	( sed -n '1,2p' constraints.txt; cat constraints.txt.new ) > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt && rm constraints.txt.new

clean:
	rm -rf $(VENV)
