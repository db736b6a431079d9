# Two commands from a clean clone: `make run` and `make test`.
# Everything installs into .venv; the Horovod wheel is built once and cached
# under ~/.cache/pipe_horovod/wheels (see scripts/install_horovod.sh), with
# the MPI controller when Open MPI is installed (scripts/install_openmpi.sh
# installs it where the machine allows: root with apt-get), and SimGrid's Python
# module for `pipe-horovod simulate` the same way (scripts/install_simgrid.sh).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NP ?= 2

.PHONY: install run test image gpu-kit clean

install: $(STAMP)

# pyproject.toml declares the versions the package supports; constraints.txt
# pins the ones installed here, so every run of the suite sees the same stack.
# TensorFlow is not a requirement of the package (users bring the flavour they
# run): CI takes the CPU one.
$(STAMP): Makefile pyproject.toml constraints.txt scripts/install_openmpi.sh scripts/install_slurm.sh scripts/install_simgrid.sh scripts/install_horovod.sh scripts/cuda_archs.sh scripts/cxx17
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	bash scripts/install_openmpi.sh
	bash scripts/install_slurm.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -c constraints.txt --upgrade pip setuptools wheel
	$(PY) -m pip install -c constraints.txt torch
	$(PY) -m pip install -c constraints.txt -e '.[test,keras,horovod-tests]' tensorflow-cpu
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt PYTHON=$(PY) bash scripts/install_horovod.sh
	bash scripts/install_simgrid.sh $(VENV)
	touch $@

# The main job: the digits CNN on $(NP) horovodrun workers, synchronous then at
# the default (tune="auto", with what it chose), with the held-out accuracy and
# train time of each: PyTorch, then Keras 3 (its
# TensorFlow backend). Then, where the machine allows it (root, ip netns, tc),
# the point: a wider digits MLP on an emulated 1 Gbit cluster, Horovod's
# DistributedOptimizer vs ours K=1 vs ours K=2, step time and time to
# accuracy (table + PNG under bench-out/); elsewhere one line says why not.
# Every part runs; make fails if any does.
run: install
	@status=0; \
	$(PY) examples/compare_digits.py --np $(NP) || status=1; \
	$(PY) examples/compare_digits.py --np $(NP) --framework keras || status=1; \
	$(PY) examples/emulated_digits.py --out bench-out || status=1; \
	exit $$status

# pytest's full log and a JUnit XML go to .ci/artifacts (scripts/run_tests.sh).
test: install
	bash scripts/run_tests.sh $(PY)

# The Docker image, built and tested (scripts/image.sh): a Docker daemon and
# a base are provided where the machine allows it (root); a progress line per
# stage, the full log under build/image/, then tests/test_image.py.
image: install
	PYTHON=$(PY) bash scripts/image.sh

# What a lent GPU machine needs for the GPU check and cannot fetch, built here into
# build/gpu-kit/ (scripts/gpu_kit/build.sh; no GPU needed); docs/gpu.md gives the one call
# that runs it there. The first build fetches a CUDA torch for the machine's Python
# (about 3.5 GB) and builds Horovod twice; both are cached, so the next takes seconds.
gpu-kit:
	bash scripts/gpu_kit/build.sh

clean:
	rm -rf $(VENV) build *.egg-info
