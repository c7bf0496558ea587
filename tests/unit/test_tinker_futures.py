"""The Tinker API's futures: outcomes kept and long-polled, one run's operations in the SDK's order."""

from __future__ import annotations

import asyncio

from artlike_server.errors import InvalidRequest
from artlike_server.tinker.futures import FutureTable, OrderedQueues, Outcome


async def test_operations_of_a_run_run_in_seq_order_whatever_order_they_arrive_in() -> None:
    futures = FutureTable(poll_s=5)
    queues = OrderedQueues(futures, gap_timeout_s=5)
    ran: list[int] = []

    def work(seq: int):  # type: ignore[no-untyped-def]
        async def run() -> dict[str, int]:
            ran.append(seq)
            await asyncio.sleep(0)
            return {"seq": seq}
        return run

    ids = {seq: queues.submit("run", seq, work(seq)) for seq in (3, 2)}
    await asyncio.sleep(0.05)
    assert ran == []  # 1 has not arrived
    ids[1] = queues.submit("run", 1, work(1))
    assert queues.submit("run", 2, work(99)) == ids[2]  # a retried submission: the first one's future
    outcomes = [await futures.wait(ids[seq]) for seq in (1, 2, 3)]
    assert ran == [1, 2, 3]
    assert [o.payload for o in outcomes if o is not None] == [{"seq": 1}, {"seq": 2}, {"seq": 3}]


async def test_a_missing_number_holds_the_queue_only_for_the_gap_timeout() -> None:
    futures = FutureTable(poll_s=5)
    queues = OrderedQueues(futures, gap_timeout_s=0.1)

    async def run() -> dict[str, bool]:
        return {"ok": True}

    request_id = queues.submit("run", 2, run)
    outcome = await futures.wait(request_id)
    assert outcome is not None and outcome.payload == {"ok": True}


async def test_errors_carry_the_sdks_category_and_unknown_ids_fail_instead_of_hanging() -> None:
    futures = FutureTable(poll_s=0.05)

    async def refused() -> dict[str, bool]:
        raise InvalidRequest("no such thing")

    async def slow() -> dict[str, bool]:
        await asyncio.sleep(10)
        return {}

    outcome = await futures.wait(futures.start(refused), 5)
    assert outcome == Outcome(error="no such thing", category="user")
    assert await futures.wait(futures.start(slow)) is None  # still running: the route answers try_again
    lost = await futures.wait("req-from-an-earlier-process-1")
    assert lost is not None and lost.category == "server" and "restarted" in (lost.error or "")
    await futures.stop()
