# The two commands of the README: `make demo` (the main job) and `make test`.
SHELL := /bin/bash
VENV := .venv/bin

.PHONY: demo test reliability replay lint lab-up lab-down lab-env bootstrap

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	@scripts/demo.sh

# --durations: where the time goes, printed on every run (issue 28). TEST_WORKERS=3 runs the
# test files on 3 pytest-xdist workers (a file stays on one worker), each with a lab, a Prefect
# server and a PostgreSQL of its own (tests/conftest.py): 22 min instead of 45 on 2 cores, but
# 5 tests that wait for a process to answer a signal timed out in 1 of 2 runs (README), so the
# default (and CI) stays in one process.
TEST_WORKERS ?= 0
test: bootstrap
	$(VENV)/pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile

# The reliability and security suites (tests/reliability) at full size: 200 randomised
# fault-injected recreates, 10,000 examples per parser, 2,000 forged Slack requests, ...; every
# figure is printed at the end (`make test` runs them at the small size CI uses).
reliability: bootstrap
	CUDAMEDIC_RELIABILITY=full $(VENV)/pytest -q -p no:cacheprovider tests/reliability

# Every corpus case replayed live on the replay lab (tests/lab/replay.py): collect + classify and
# `cudamedic triage`, each verdict against the offline one (docs/accuracy.md, "live"); `make test`
# replays a stratified sample. About 45 minutes on 2 cores.
replay: bootstrap
	$(VENV)/python scripts/replay.py --triage --tsv out/replay.tsv

lint: bootstrap
	$(VENV)/ruff check .
	$(VENV)/ruff format --check runbooks flows reports tests/lab tests/reliability tests/*.py
	$(VENV)/mypy

lab-up: bootstrap
	$(VENV)/python -m tests.lab up

lab-down:
	$(VENV)/python -m tests.lab down

# The lab's settings for a shell, from any directory: eval "$(make -s -C PATH/TO/cudamedic lab-env)"
lab-env:
	@$(VENV)/python -m tests.lab env
