"""EnginePool.pick without processes: least outstanding first, ties in turn (requests sent one at a
time must reach every engine, not only the first), unhealthy and already-tried engines left out."""

from __future__ import annotations

import pytest

from services.gateway.engines import EngineError, EnginePool


class _Client:
    def __init__(self, engine_id: str):
        self.id, self.url = engine_id, f"http://engine-{engine_id}"


def pool_of(n: int) -> EnginePool:
    pool = EnginePool([_Client(str(i)) for i in range(n)])
    for e in pool.engines:
        e.healthy, e.info = True, {"model_id": "m"}
    return pool


def test_sequential_requests_take_turns_over_idle_engines():
    pool = pool_of(3)
    picked = [pool.pick("m").client.id for _ in range(6)]
    assert picked == ["0", "1", "2", "0", "1", "2"]


def test_least_outstanding_wins_over_the_turn():
    pool = pool_of(2)
    pool.engines[0].outstanding = 2
    assert {pool.pick("m").client.id for _ in range(4)} == {"1"}
    pool.engines[1].outstanding = 3
    assert pool.pick("m").client.id == "0"


def test_down_and_tried_engines_are_left_out():
    pool = pool_of(2)
    pool.engines[0].healthy = False
    assert {pool.pick("m").client.id for _ in range(3)} == {"1"}
    with pytest.raises(EngineError) as err:
        pool.pick("m", exclude={id(pool.engines[1])})
    assert err.value.status == 503
