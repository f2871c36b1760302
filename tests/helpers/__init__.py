"""Shared test builders and harness pieces, each module named for its concept; test modules import these,
never each other (tests/unit/test_test_layout.py checks it)."""
