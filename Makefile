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

.PHONY: repro test lint ui bench constraints clean

$(VENV)/.runtime: requirements.txt constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -r requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PIP_INSTALL) -r requirements-dev.txt
	touch $@

## repro: set up .venv and run the whole pipeline (dvc repro)
repro: $(VENV)/.runtime
	$(RUN) $(BIN)/python -m stages.init_store
	$(RUN) $(BIN)/dvc repro

## test: set up .venv with the dev requirements and run the whole test suite
test: $(VENV)/.dev
	$(RUN) $(BIN)/python -m pytest tests

## lint: set up .venv with the dev requirements, then ruff and mypy (ruff.toml, mypy.ini) on the code
lint: $(VENV)/.dev
	$(BIN)/ruff check gat stages benchmarks
	$(BIN)/mypy gat stages benchmarks

## ui: the MLflow UI on http://127.0.0.1:5000 against the project's store
ui: $(VENV)/.runtime
	@echo "Open these pages (the \"Model training\" view, with the important columns shown):"
	$(RUN) $(BIN)/python -m stages.init_store --ui-base http://127.0.0.1:5000
	$(BIN)/mlflow ui --host 127.0.0.1 --port 5000 \
	  --backend-store-uri "$${MLFLOW_TRACKING_URI:-sqlite:///$(CURDIR)/mlflow.db}" \
	  --artifacts-destination "$(CURDIR)/mlartifacts"

## bench: time this engine against PyTorch Geometric and the dense tutorial layer on Cora
## (from ../shared/datasets/planetoid, else from data/raw/cora, which `make repro` downloads)
bench: $(VENV)/.dev
	$(RUN) $(BIN)/python -m benchmarks.engine --out reports/benchmark.json

## constraints: re-pin every transitive package after changing requirements*.txt
constraints: $(VENV)/.dev
	$(BIN)/pip freeze --exclude-editable | sed 's/+cpu$$//' > constraints.txt.new
	( sed -n '1,2p' constraints.txt; cat constraints.txt.new ) > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt && rm constraints.txt.new

clean:
	rm -rf $(VENV)
