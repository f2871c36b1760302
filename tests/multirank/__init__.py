"""Tests that spawn ranks (run_on_ranks, torchrun) or run the example scripts end to end."""
