"""The multi-rank harness: results come back per rank, a failing or dying rank fails the test fast
and is named as the cause (not the rank that noticed it), and a hung rank times out instead of
hanging CI. No assertion here depends on how busy the machine is: promptness is shown by which
error comes back (a harness that waited for the hung rank would raise RankTimeout instead).

The in-process cases; those that spawn ranks or run scripts end to end are in tests/multirank/test_testing.py."""





def test_tests_of_modules_that_spawn_ranks_are_marked_multirank(request):
    """`make test-gpu` selects them with `-m multirank` (tests/conftest.py marks them)."""
    assert request.node.get_closest_marker("multirank") is not None
