"""Cache weighed against load: whether a replica that holds a prompt's prefix takes it.

Pure. A replica's load is the larger of two counts: the requests this gateway has in flight
there (exact, and at once: taken before any await), and what its engine says it is running
and queueing (`ShardStatus.load`, its shards' summed: every gateway's requests, not only this
one's, as the launcher last read them). With several gateways, each sees only its own in
flight; a hot prefix routed by all of them to one replica is seen piling up there only in the
engine's counts.

A replica holding `depth` blocks of the prompt takes it while

    depth >= match_per_load x (its load - the least load among the candidates)

and it is within the load bound (`load_factor` x the mean load + 1). A match saves the
prefill of `depth` blocks; each request more on it than on the least busy replica is one
more to wait behind (on a one-slot engine, a whole answer). So a deep match tolerates a few
more, a shallow one none, and a hot prefix spills to the least busy replica once its own
is that much busier: the replica it spills to then holds it too, and both count.
"""

from __future__ import annotations

from collections.abc import Iterable


def load_of(in_flight: int, engine: int | None) -> int:
    """A replica's load: this gateway's requests in flight there, or its engine's running and
    waiting requests where that is more (None: the engine said nothing)."""
    return in_flight if engine is None or engine < in_flight else engine


def bound(loads: Iterable[int], load_factor: float) -> float:
    """The most load a replica may have to take a request for its prefix."""
    values = list(loads)
    return load_factor * sum(values) / len(values) + 1 if values else 1.0


def worth(depth: float, load: int, least: int, match_per_load: float) -> bool:
    """Whether a match `depth` blocks deep on a replica of `load` outweighs sending the request
    to the least busy candidate (of load `least`)."""
    return depth >= match_per_load * (load - least)
