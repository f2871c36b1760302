"""Minimum-cost assignment (the Hungarian method), for matching a re-packed placement's ranks to the old ones.

Written here rather than taken from ``scipy.optimize.linear_sum_assignment``: every EP rank computes the
same re-placement independently, so ties must break identically everywhere, whether or not a rank has
scipy installed (and whichever version). Ties go to lower column indices.
"""

from __future__ import annotations

import numpy as np


def min_cost_assignment(cost) -> list[int]:
    """The column assigned to each row of a square ``cost`` matrix, minimising the total cost.

    The shortest-augmenting-path form of the Hungarian method with potentials, O(n^3), its inner loop
    over columns vectorised. Costs are compared exactly, so give integers (or exactly representable
    floats) for a deterministic result.
    """
    cost = np.asarray(cost, dtype=np.float64)
    if cost.ndim != 2 or cost.shape[0] != cost.shape[1]:
        raise ValueError(f"cost must be a square matrix, got shape {cost.shape}")
    n = cost.shape[0]
    # 1-based arrays with a virtual column 0, as in the textbook form of the method.
    row_potential = np.zeros(n + 1)
    col_potential = np.zeros(n + 1)
    row_of_col = np.zeros(n + 1, dtype=np.int64)  # 0: unassigned
    way = np.zeros(n + 1, dtype=np.int64)
    for row in range(1, n + 1):
        row_of_col[0] = row
        col = 0
        min_slack = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[col] = True
            current_row = row_of_col[col]
            slack = cost[current_row - 1] - row_potential[current_row] - col_potential[1:]
            free = ~used[1:]
            improved = free & (slack < min_slack[1:])
            min_slack[1:][improved] = slack[improved]
            way[1:][improved] = col
            candidates = np.where(free, min_slack[1:], np.inf)
            next_col = int(np.argmin(candidates)) + 1  # argmin: the lowest index on a tie
            delta = candidates[next_col - 1]
            row_potential[row_of_col[used]] += delta
            col_potential[used] -= delta
            min_slack[1:][free] -= delta
            col = next_col
            if row_of_col[col] == 0:
                break
        while col:  # augment along the path back to the virtual column
            previous = way[col]
            row_of_col[col] = row_of_col[previous]
            col = previous
    assignment = [0] * n
    for col in range(1, n + 1):
        assignment[row_of_col[col] - 1] = col - 1
    return assignment
