PYTHON ?= python3
# Installed only where the interpreter has no torch (a user's CUDA build is kept): the CPU wheel of this
# version where pip is set up to find one (README: Install).
TORCH_PIN ?= torch==2.13.0
# One stamp per interpreter (its sys.prefix, hashed): a second virtualenv gets its own install.
STAMP := .deps-installed-$(shell $(PYTHON) -c \
	'import hashlib, sys; print(hashlib.sha256(sys.prefix.encode()).hexdigest()[:12])')

.PHONY: install test test-fast test-gpu demo
$(STAMP): setup.py pyproject.toml
	$(PYTHON) -c 'import torch' 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_PIN)"
	$(PYTHON) -m pip install -q -e ".[test]"
	touch $@

install: $(STAMP)

# The whole suite: the unit tier, then the multi-rank tier (this is what CI runs); the 25 slowest tests are
# listed at the end, so a CI log shows where the time went.
test: $(STAMP)
	$(PYTHON) -m pytest -q --durations=25 tests/unit tests/multirank

# The unit tier (in-process: no spawned ranks, no torchrun, no end-to-end script runs): for the edit-test loop.
test-fast: $(STAMP)
	$(PYTHON) -m pytest -q tests/unit

# On a machine with a CUDA GPU per rank (2 for most cases): the cuda-marked tests and those of the modules that
# spawn ranks, whose ranks then join over NCCL, one GPU each (MEGAMOE_TEST_BACKEND, read by run_on_ranks).
test-gpu: $(STAMP)
	MEGAMOE_TEST_BACKEND=nccl $(PYTHON) -m pytest -q -m "cuda or multirank"

# The torchrun pretraining demo on 4 CPU ranks: tp=2 x ep=2 (all-gather EP inside the TP group), dp=2.
demo: $(STAMP)
	$(PYTHON) -m torch.distributed.run --nproc-per-node 4 -m megamoe train --config configs/demo.toml
