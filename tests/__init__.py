"""The test suite: unit/ (in-process), multirank/ (spawned ranks, torchrun, end-to-end script runs), helpers/
(shared builders and harness pieces)."""
