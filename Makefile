PYTHON ?= python3
# torch is pinned first so pip takes the local CPU wheel instead of a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: install test test-fast test-gpu demo
.deps-installed: setup.py pyproject.toml
	$(PYTHON) -m pip install -q "$(TORCH_PIN)"
	$(PYTHON) -m pip install -q -e ".[test]"
	touch .deps-installed

install: .deps-installed

# The whole suite, slow multi-rank cases included (this is what CI runs).
test: .deps-installed
	$(PYTHON) -m pytest -q

# Skips the cases marked slow: for the edit-test loop.
test-fast: .deps-installed
	$(PYTHON) -m pytest -q -m "not slow"

# On a machine with a CUDA GPU per rank (2 for most cases): the cuda-marked tests and those of the modules that
# spawn ranks, whose ranks then join over NCCL, one GPU each (MEGAMOE_TEST_BACKEND, read by run_on_ranks).
test-gpu: .deps-installed
	MEGAMOE_TEST_BACKEND=nccl $(PYTHON) -m pytest -q -m "cuda or multirank"

# The torchrun pretraining demo on 4 CPU ranks: tp=2 x ep=2 (all-gather EP inside the TP group), dp=2.
demo: .deps-installed
	$(PYTHON) -m torch.distributed.run --nproc-per-node 4 examples/pretrain_moe.py --tp 2 --ep 2 --dispatcher allgather
