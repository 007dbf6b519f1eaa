"""Token-budget batching over a unit's samples (already stored longest-first)."""

from __future__ import annotations


def plan_batches(lengths: list[int], token_budget: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) sample ranges whose padded size (count x longest) fits the budget.
    A sample longer than the budget forms a batch of its own. Deterministic: resume recomputes the
    same batches, so resumed output is bit-identical to an uninterrupted run."""
    batches, start = [], 0
    while start < len(lengths):
        end, longest = start + 1, lengths[start]
        while end < len(lengths) and max(longest, lengths[end]) * (end - start + 1) <= token_budget:
            longest = max(longest, lengths[end])
            end += 1
        batches.append((start, end))
        start = end
    return batches
