"""Shared by tests/unit/test_fp8.py and tests/multirank/test_fp8.py: the builders and constants of the fp8 tests."""


H, FFN, SLOTS = 64, 96, 4
CURRENT_RECIPES = ("tensorwise", "rowwise")
RECIPES = ("delayed",) + CURRENT_RECIPES
