"""Contiguous balanced splits of layers (stages of a pipeline, devices of a stage): a leaf of cluster."""

from __future__ import annotations

from oscar.common import OscarError


def balance(costs: list[float], stages: int, first_cost: float = 0.0, *, mem: list[float] | None = None,
            budget: float = float("inf"), first_mem: float = 0.0) -> list[tuple[int, int]] | None:
    """Contiguous layer ranges minimising the largest stage cost (stage 0 also pays `first_cost`) among the
    splits whose every stage holds its memory (`mem` per layer, stage 0 also `first_mem`, each stage <= `budget`);
    None when no split fits. Exact DP over split points."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise OscarError(f"--stages must be between 1 and the number of layers ({n}), got {stages}")
    mem = [0.0] * n if mem is None else mem
    pc, pm = [0.0], [0.0]
    for c, m in zip(costs, mem):
        pc.append(pc[-1] + c)
        pm.append(pm[-1] + m)
    inf = float("inf")
    # best[s][i]: minimal max cost placing layers [0, i) on s stages; cut[s][i]: start of the last stage
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf or pm[i] - pm[j] + (first_mem if j == 0 else 0.0) > budget:
                    continue
                v = max(best[s - 1][j], pc[i] - pc[j] + (first_cost if j == 0 else 0.0))
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    if best[stages][n] == inf:
        return None
    ranges, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


def balance_layers(costs: list[int], stages: int, first_extra: int = 0) -> list[tuple[int, int]]:
    """Contiguous layer ranges minimising the largest stage cost (stage 0 also pays `first_extra`, the
    embeddings)."""
    return balance(costs, stages, first_extra)
