"""Contiguous balanced splits of layers (stages of a pipeline, devices of a stage): a leaf of cluster."""

from __future__ import annotations

from oscar.common import OscarError


def balance_layers(costs: list[int], stages: int, first_extra: int = 0) -> list[tuple[int, int]]:
    """Contiguous layer ranges minimising the largest stage cost (stage 0 also pays
    `first_extra`, the embeddings). Exact DP over split points."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise OscarError(f"--stages must be between 1 and the number of layers ({n}), got {stages}")
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + c)
    inf = float("inf")
    # best[s][i]: minimal max cost placing layers [0, i) on s stages; cut[s][i]: start of the last stage
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = pre[i] - pre[j] + (first_extra if j == 0 else 0)
                v = max(best[s - 1][j], cost)
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    ranges, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]
