"""In-process tests: no spawned ranks, no torchrun, no subprocess training runs (`make test-fast`)."""
