"""Admission: seats, per-tier queues served most-urgent first, 429 with a Retry-After from the drain rate."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.admission import Admission, Shed
from policies.admission import BoundedQueue, BoundedQueueParams
from wire.tier import Tier

INTERACTIVE = Tier(name="interactive", rank=0, max_queue=2)
STANDARD = Tier(name="standard", rank=1, max_queue=2)
BATCH = Tier(name="batch", rank=2, max_queue=4, sheddable=True)
TIERS = (BATCH, INTERACTIVE, STANDARD)  # any order: ranks decide


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(capacity: int, clock: Clock | None = None) -> tuple[Admission, list[int]]:
    seats = [capacity]
    return Admission(TIERS, lambda: seats[0], clock or Clock()), seats


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_admits_up_to_capacity_then_queues_until_a_release() -> None:
    admission, _ = make(2)
    a = await admission.admit(STANDARD)
    b = await admission.admit(STANDARD)
    assert a.waited_s == 0 and admission.seats_in_use == 2
    waiting = asyncio.create_task(admission.admit(STANDARD))
    await settle()
    assert not waiting.done() and admission.queue_length("standard") == 1
    a.release()
    a.release()  # idempotent
    c = await asyncio.wait_for(waiting, 1)
    assert admission.seats_in_use == 2 and admission.queue_length("standard") == 0
    b.release()
    c.release()
    assert admission.seats_in_use == 0
    assert admission.counts["standard"].admitted == 3 and admission.counts["standard"].queued == 1


async def test_most_urgent_tier_first_then_fifo() -> None:
    admission, _ = make(1)
    holder = await admission.admit(STANDARD)
    order: list[str] = []

    async def wait(tier: Tier, name: str) -> None:
        ticket = await admission.admit(tier)
        order.append(name)
        await asyncio.sleep(0)
        ticket.release()

    tasks = [asyncio.create_task(wait(STANDARD, "s1"))]
    await settle()
    tasks.append(asyncio.create_task(wait(INTERACTIVE, "i1")))
    await settle()
    tasks.append(asyncio.create_task(wait(STANDARD, "s2")))
    tasks.append(asyncio.create_task(wait(INTERACTIVE, "i2")))
    await settle()
    holder.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert order == ["i1", "i2", "s1", "s2"]


async def test_within_a_tier_lower_priority_first_then_fifo() -> None:
    admission, _ = make(1)
    holder = await admission.admit(STANDARD)
    p5 = asyncio.create_task(admission.admit(STANDARD, priority=5))
    await settle()
    p0 = asyncio.create_task(admission.admit(STANDARD, priority=0))
    await settle()
    assert admission.queue_length("standard") == 2  # STANDARD's queue is full: [p0, p5]
    holder.release()
    first = await asyncio.wait_for(p0, 1)
    p_minus = asyncio.create_task(admission.admit(STANDARD, priority=-3))  # goes before p5
    await settle()
    first.release()
    second = await asyncio.wait_for(p_minus, 1)
    assert not p5.done()
    second.release()
    (await asyncio.wait_for(p5, 1)).release()
    assert admission.seats_in_use == 0


async def test_a_newcomer_does_not_overtake_waiters_of_its_tier_or_above() -> None:
    admission, seats = make(1)
    holder = await admission.admit(INTERACTIVE)
    queued = asyncio.create_task(admission.admit(INTERACTIVE))
    await settle()
    seats[0] = 4  # more room appears, but only capacity_changed() hands it out
    late = asyncio.create_task(admission.admit(STANDARD))
    await settle()
    assert not late.done()  # an interactive request is waiting ahead of it
    admission.capacity_changed()
    await asyncio.wait_for(asyncio.gather(queued, late), 1)
    holder.release()


async def test_full_queue_sheds_with_retry_after_from_the_drain_rate() -> None:
    clock = Clock()
    admission, _ = make(1, clock)
    running = await admission.admit(INTERACTIVE)
    waiters = [asyncio.create_task(admission.admit(INTERACTIVE)) for _ in range(2)]
    await settle()
    with pytest.raises(Shed) as info:
        await admission.admit(INTERACTIVE)
    assert "queue is full" in info.value.reason
    assert info.value.retry_after_s == 3  # 3 seats ahead (2 waiting + itself) at the 1/s floor
    assert admission.counts["interactive"].shed == 1
    # Seats drain at 4 per second: 3 ahead → 1 s.
    for _ in range(4):
        running.release()
        clock.now += 0.25
        running = await asyncio.wait_for(waiters.pop(0), 1) if waiters else await admission.admit(INTERACTIVE)
    waiters = [asyncio.create_task(admission.admit(INTERACTIVE)) for _ in range(2)]
    await settle()
    rate = admission.drain_rate()
    assert rate is not None and rate == pytest.approx(4.0)
    with pytest.raises(Shed) as info:
        await admission.admit(INTERACTIVE)
    assert info.value.retry_after_s == 1
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_sheddable_tier_is_refused_while_more_urgent_requests_wait() -> None:
    admission, _ = make(1)
    holder = await admission.admit(STANDARD)
    batch_waiter = asyncio.create_task(admission.admit(BATCH))  # nothing more urgent waits: it queues
    await settle()
    assert admission.queue_length("batch") == 1
    urgent = asyncio.create_task(admission.admit(STANDARD))  # its own tier holds the seat: it waits
    await settle()
    assert admission.queue_length("standard") == 1
    with pytest.raises(Shed, match="more urgent"):
        await admission.admit(BATCH)
    holder.release()
    ticket = await asyncio.wait_for(urgent, 1)  # the standard request went first
    assert not batch_waiter.done()
    ticket.release()
    (await asyncio.wait_for(batch_waiter, 1)).release()
    assert admission.seats_in_use == 0


async def test_an_urgent_arrival_goes_into_the_overflow_over_less_urgent_seats() -> None:
    admission, _ = make(4)
    batch = [await admission.admit(BATCH) for _ in range(4)]
    # The fleet's 4 seats are batch's: interactive still goes at once (the worker takes a batch
    # request's slot for it), up to 4 more seats; then it waits like anyone.
    urgent = [await asyncio.wait_for(admission.admit(INTERACTIVE), 1) for _ in range(4)]
    assert admission.seats_in_use == 8
    late = asyncio.create_task(admission.admit(INTERACTIVE))
    await settle()
    assert not late.done()
    for ticket in [*batch, *urgent]:
        ticket.release()
    (await asyncio.wait_for(late, 1)).release()


async def test_a_less_urgent_tier_is_deferred_to_keep_seats_for_the_urgent_peak() -> None:
    clock = Clock()
    admission, _ = make(10, clock)
    urgent = [await admission.admit(INTERACTIVE) for _ in range(4)]  # interactive's peak: 4 seats
    for ticket in urgent[:2]:
        ticket.release()
    # 1.25 · 4 = 5 seats kept for interactive, 2 of them held: batch may fill 10 - 3 = 7 in all.
    view = admission.view(BATCH, 1)
    assert view.seats_reserved == 3 and view.room == 7
    held = [await asyncio.wait_for(admission.admit(BATCH), 1) for _ in range(5)]
    deferred = asyncio.create_task(admission.admit(BATCH))
    await settle()
    assert not deferred.done() and admission.seats_in_use == 7
    clock.now += 61  # the peak is forgotten: only what interactive holds now counts
    urgent[2].release()  # a release hands out seats: 1 kept (ceil(1.25 · the 1 still held) - 1)
    (await asyncio.wait_for(deferred, 1)).release()
    assert admission.view(BATCH, 1).seats_reserved == 1
    for ticket in [*held, urgent[3]]:
        ticket.release()
    assert admission.seats_in_use == 0


async def test_a_sheddable_request_whose_wait_would_be_long_is_shed_with_retry_after() -> None:
    clock = Clock()
    policy = BoundedQueue(BoundedQueueParams(sheddable_max_wait_s=15.0))
    admission = Admission(TIERS, lambda: 1, clock, policy)
    (await admission.admit(BATCH)).release()  # one seat released at t = 100
    clock.now += 5.0  # ... and none since: 1 seat per 5 s
    holder = await admission.admit(BATCH)
    # Expected waits 5, 10 and 15 s: they queue; the next one's would be 20 s: shed, Retry-After 20.
    waiting = [asyncio.create_task(admission.admit(BATCH)) for _ in range(3)]
    await settle()
    assert admission.queue_length("batch") == 3
    with pytest.raises(Shed, match="expected wait of 20 s is past the 'batch' tier's 15 s") as info:
        await admission.admit(BATCH)
    assert info.value.retry_after_s == 20
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    holder.release()


async def test_a_cancelled_waiter_leaves_the_queue_and_holds_no_seat() -> None:
    admission, _ = make(1)
    holder = await admission.admit(STANDARD)
    waiter = asyncio.create_task(admission.admit(STANDARD))
    await settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.queue_length("standard") == 0
    holder.release()
    assert admission.seats_in_use == 0


async def test_several_seats_at_once_and_a_request_bigger_than_the_fleet_still_runs() -> None:
    admission, _ = make(4)
    one = await admission.admit(STANDARD, seats=3)
    big = asyncio.create_task(admission.admit(STANDARD, seats=2))
    await settle()
    assert not big.done()
    small = asyncio.create_task(admission.admit(STANDARD, seats=1))
    await settle()
    assert not small.done()  # FIFO: it does not jump the bigger request ahead of it
    one.release()
    tickets = await asyncio.wait_for(asyncio.gather(big, small), 1)
    assert admission.seats_in_use == 3
    for ticket in tickets:
        ticket.release()
    huge = await admission.admit(STANDARD, seats=9)  # more than capacity: alone, it runs
    huge.release()


async def test_the_policy_sheds_when_the_expected_wait_is_past_the_tiers_limit() -> None:
    clock = Clock()
    policy = BoundedQueue(BoundedQueueParams(max_wait_s={"batch": 1.5}))
    seats = [2]
    admission = Admission(TIERS, lambda: seats[0], clock, policy=policy)
    held = [await admission.admit(BATCH) for _ in range(2)]
    # Nothing has drained yet: no rate, no estimate, so it queues.
    first = asyncio.create_task(admission.admit(BATCH))
    await settle()
    assert admission.queue_length("batch") == 1
    # One seat per second drains.
    held[0].release()
    clock.now += 1.0
    held.append(await asyncio.wait_for(first, 1))
    assert admission.drain_rate() == pytest.approx(1.0)
    second = asyncio.create_task(admission.admit(BATCH))
    await settle()
    view = admission.view(BATCH, 1)
    assert view.expected_wait_s() == pytest.approx(2.0)  # 2 in use + 1 ahead + 1 - 2 seats
    with pytest.raises(Shed, match=r"expected wait of 2 s is past the 'batch' tier's 1\.5 s"):
        await asyncio.wait_for(admission.admit(BATCH), 1)
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)


def test_every_policy_in_the_example_config_loads() -> None:
    from gateway.serve import check_policies
    from wire.config import load_config

    check_policies(load_config(Path(__file__).resolve().parents[2] / "examples" / "tierserve.toml", env={}))
