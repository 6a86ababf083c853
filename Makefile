# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs the project with its export, test and distributed
# extras (the tests start a local Ray cluster for the pipeline-stage actors).
# torch==2.13.0 is installed first and on its own: on these machines that pin resolves to a
# local CPU build, while a looser requirement would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[export,test,distributed]'
	touch $(STAMP)

.PHONY: install demo test bench
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/graphkiln demo

# Two pytest workers, each taking whole test files (its session and module fixtures stay its own):
# most test time is single-threaded tracing, so the two cores of the build machines both work.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(VENV)/bin/python scripts/bench_decode.py
