"""Unbiased pass@k (Chen et al., 2021) from n samples per task of which c are correct."""

from __future__ import annotations

from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k = 1 - C(n-c, k) / C(n, k), in the stable product form
    1 - prod_{i=n-c+1}^{n} (1 - k / i); exactly 1 when n - c < k."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k averaged over tasks; `counts` holds one (n, c) pair per task (NaN if empty)."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    return sum(values) / len(values) if values else float("nan")
