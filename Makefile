# Two entry points, both self-contained on a fresh Debian machine (run as root,
# or with sudo available for the system packages):
#   make demo   install everything, then run the main job
#   make test   install everything, then lint, type-check and run the whole suite
# `make bootstrap` alone installs: system packages, then a virtualenv in .venv
# with Slates (its C extension is compiled by cffi during the install).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SYSTEM_PACKAGES := fuse3 libfuse3-dev libmsgpack-dev liburing-dev libdeflate0 pkg-config gcc libc6-dev git make \
	etcd-server serf iproute2 nftables python3 util-linux

.PHONY: bootstrap system-packages demo test lint

system-packages:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing system packages: $$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

bootstrap: system-packages $(BIN)/python
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=compat

demo: bootstrap
	$(BIN)/slates demo --workspace
	$(BIN)/slates demo

lint: bootstrap
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q -p no:cacheprovider

# `make bench` (as root): every side-by-side benchmark in one run (bench/run_all.py),
# about 3 minutes on 2 cores; BENCH_ARGS="--quick" for a short smoke run.
.PHONY: bench
bench: bootstrap
	@$(MAKE) --no-print-directory system-packages SYSTEM_PACKAGES="fuse-overlayfs"
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)

# `make sim SEEDS=100000`: the fleet's deterministic simulator over many seeded
# schedules (CI runs a bounded number inside the suite); prints any failing seed.
SEEDS ?= 100000
.PHONY: sim
sim: bootstrap
	$(BIN)/python -m slates.fleet.sim --seeds $(SEEDS)

# `make fuzz ROUNDS=20000`: the seeded protocol fuzzer against a real anchor (CI runs a
# bounded number of rounds inside the suite); prints the seed of any finding.
ROUNDS ?= 20000
.PHONY: fuzz
fuzz: bootstrap
	$(BIN)/python -m tests.protocol_fuzz --rounds $(ROUNDS)
