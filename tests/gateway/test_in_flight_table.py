"""The gateway's in-flight table (gateway/in_flight.py) and the registry's live view of it, without
workers: a state machine against a plain model, and a restarted worker's requests detached but kept
for failover."""

from __future__ import annotations

import asyncio

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.in_flight import InFlightTable
from gateway.request_stream import InFlight
from gateway.workers import WorkerRegistry
from wire.messages import Register, Submit
from wire.sampling import SamplingParams
from wire.tier import DEFAULT_TIERS

MODEL = "mock"
TIER = DEFAULT_TIERS[0]


def _in_flight(request_id: str) -> InFlight:
    submit = Submit(
        request_id=request_id,
        epoch=0,
        prompt_token_ids=[1],
        sampling=SamplingParams(max_tokens=4, temperature=0.0),
        tier=TIER,
        arrival_time=0.0,
    )
    return InFlight(submit, MODEL, "", asyncio.Queue())


_REGISTER = Register(
    worker_id="a",
    model=MODEL,
    dtype="float32",
    device="cpu",
    num_kv_blocks=16,
    block_size=16,
    kv_capacity_tokens=256,
    max_model_len=4096,
    max_num_seqs=4,
    pid=1,
)


class InFlightTableMachine(RuleBasedStateMachine):
    """Add, remove (the record, or a stale one of the same id), detach a worker and re-add what it had:
    the per-worker sets, the records and the registry's counts always agree with a plain model."""

    workers = ("a", "b", "c")

    def __init__(self) -> None:
        super().__init__()
        self.table = InFlightTable()
        self.registry = WorkerRegistry(in_flight=self.table)
        for worker_id in self.workers:
            self.registry.on_register(msgspec.structs.replace(_REGISTER, worker_id=worker_id), 0.0)
        self.placed: dict[str, str | None] = {}  # request id → its worker (None: detached)
        self.records: dict[str, InFlight] = {}

    @rule(request_id=st.sampled_from([f"r{i}" for i in range(8)]), worker_id=st.sampled_from(workers))
    def add(self, request_id: str, worker_id: str) -> None:
        if request_id in self.table and self.placed[request_id] is not None:
            return  # in flight on a worker: the dispatcher never adds it twice
        request = self.records.get(request_id) or _in_flight(request_id)
        self.table.remove(request)  # a detached one is removed before it is placed again
        self.table.add(request, worker_id)
        self.records[request_id], self.placed[request_id] = request, worker_id
        assert request.worker_id == worker_id

    @precondition(lambda self: self.records)
    @rule(data=st.data(), stale=st.booleans())
    def remove(self, data: st.DataObject, stale: bool) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.records)))
        request = _in_flight(request_id) if stale else self.records[request_id]
        assert self.table.remove(request) is (not stale)
        assert self.table.remove(request) is False  # once only
        if not stale:
            del self.records[request_id], self.placed[request_id]

    @rule(worker_id=st.sampled_from(workers))
    def detach(self, worker_id: str) -> None:
        expected = {r for r, w in self.placed.items() if w == worker_id}
        assert self.table.detach(worker_id) == expected
        for request_id in expected:
            self.placed[request_id] = None
            assert self.table.get(request_id) is self.records[request_id]  # kept for the caller

    @invariant()
    def agrees_with_the_model(self) -> None:
        assert len(self.table) == len(self.records) == len(list(self.table))
        for request_id, request in self.records.items():
            assert request_id in self.table and self.table.get(request_id) is request
        for worker_id in self.workers:
            on_worker = {r for r, w in self.placed.items() if w == worker_id}
            assert self.table.request_ids_on(worker_id) == on_worker
            info = self.registry.get(worker_id)
            assert info is not None and info.in_flight_ids == on_worker  # the registry's live view
            assert self.registry.view(info).num_in_flight == len(on_worker)


InFlightTableMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestInFlightTable = InFlightTableMachine.TestCase


def test_a_restarted_worker_s_requests_are_detached_from_it_but_kept_for_failover() -> None:
    table = InFlightTable()
    registry = WorkerRegistry(in_flight=table)
    registry.on_register(_REGISTER, 0.0)
    request = _in_flight("r1")
    table.add(request, "a")
    assert registry.on_register(msgspec.structs.replace(_REGISTER, pid=2), 1.0) == {"r1"}  # new process
    info = registry.get("a")
    assert info is not None and info.in_flight_ids == set()
    assert table.get("r1") is request and request.worker_id == "a"  # until the dispatcher moves it
    assert table.remove(request) and len(table) == 0
