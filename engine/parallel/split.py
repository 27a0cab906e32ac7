"""How a batch is divided among lanes."""

from __future__ import annotations

from collections.abc import Sequence


def chunk_sizes(batch: int, lanes: int, weights: Sequence[float] | None = None) -> list[int]:
    """Split ``batch`` samples into ``lanes`` chunk sizes that add up to ``batch``.

    Even by default (sizes differ by at most one, larger ones first). With ``weights`` (one per lane,
    e.g. ``[2, 1]`` to give the first GPU twice the work) sizes follow the weights by largest
    remainder. A lane may get 0 samples when the batch is smaller than the number of lanes; such a lane
    sits that step out.
    """
    if lanes < 1:
        raise ValueError("need at least one lane")
    if batch < 0:
        raise ValueError("batch size must be >= 0")
    if weights is None:
        base, extra = divmod(batch, lanes)
        return [base + (1 if i < extra else 0) for i in range(lanes)]
    if len(weights) != lanes:
        raise ValueError(f"{len(weights)} weights given for {lanes} lanes")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("lane weights must be >= 0 and not all 0")
    total = float(sum(weights))
    exact = [batch * w / total for w in weights]
    sizes = [int(x) for x in exact]
    # Hand the leftover samples to the largest remainders (ties: lower lane first).
    order = sorted(range(lanes), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[: batch - sum(sizes)]:
        sizes[i] += 1
    return sizes
