# Everything a newcomer or CI needs: a local virtual environment with the project installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Test processes (pytest-xdist, tests handed out as processes free up): on the 2-core host the
# suite took 16.1 min against 18.0 min with whole files per process and about 22 serially.
# tests/conftest.py shares compiled programs through the session's compilation cache: 576
# tests in 15.4 min (pytest's count; 575 in 18.3 min without it, the session before); 586
# (the parametric bootstrap's tests added) in 16.2 min, 587 (its kept replicates) in 16.3 min;
# 594 (re-centred priors) in 20.1 and 21.4 min: the six new tests take about 65 s of CPU,
# the rest of the rise from 16.7 min (588, the session before) was not investigated; 594
# again (the re-centring tests now run a bootstrap too, about 100 s more CPU) in 20.6 min;
# 595 (the bootstrap's checkpointed refits; test_shooting's API test without intervals,
# 61 → 37 s alone) in 19.6 min quiet (24.9 and 32.4 min beside a 2-core benchmark); 598 (a
# bootstrap's refits share their compiled step) in 15.8 min quiet (17.3 with --durations).
# 607 (reduced steps: about 52 s alone for their test) in 33.3 min beside two 2-core fits.
# 611 (the field solves preconditioned cell by cell: about 53 s alone for their test) in
# 17.8 min quiet.
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup demo test lint bench clean slurm-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

## demo: simulate Aliev–Panfilov spirals, forget six parameters, recover them
demo: setup
	$(BIN)/pdefit-fit

## test: lint and run the whole test suite (the Slurm tests need slurm-deps, else they skip)
test: setup slurm-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

## slurm-deps: Debian's slurm-wlm and munge for tests/test_slurm.py (installed as root only)
slurm-deps:
	@if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing slurm-wlm and munge for the Slurm tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  { apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null; } || \
	  echo "could not install slurm-wlm and munge: the Slurm tests will be skipped"; \
	else echo "slurm-wlm and munge are not installed (root and apt-get needed):" \
	  "the Slurm tests will be skipped"; fi

lint: setup
	$(BIN)/ruff check .

## bench: the adjoint benchmark (pdefit schedules vs diffrax), quick variant
bench: setup
	$(BIN)/python benchmarks/adjoint.py --quick

clean:
	rm -rf $(VENV) runs outputs multirun .pytest_cache .ruff_cache
