# The two commands of the README. Each sets up what it needs first (scripts/setup.sh).
.PHONY: run test setup

run:
	./scripts/setup.sh --data
	.venv/bin/abtrain train

test:
	./scripts/setup.sh
	.venv/bin/python -m pytest -q

setup:
	./scripts/setup.sh --data
