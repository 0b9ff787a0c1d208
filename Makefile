# The two commands of the README: `make demo` (the main job) and `make test`.
SHELL := /bin/bash
VENV := .venv/bin

.PHONY: demo test lint lab-up lab-down bootstrap

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	@scripts/demo.sh

test: bootstrap
	$(VENV)/pytest -q

lint: bootstrap
	$(VENV)/ruff check .
	$(VENV)/ruff format --check runbooks flows reports tests/lab tests/*.py
	$(VENV)/mypy

lab-up: bootstrap
	$(VENV)/python -m tests.lab up

lab-down:
	$(VENV)/python -m tests.lab down
