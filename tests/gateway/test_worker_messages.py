"""The gateway's worker-message handlers (gateway/worker_messages.py) without sockets: frames go in as the
ROUTER hands them over, and what the handlers send, place and queue is recorded. The same paths over real
mock workers are in test_dispatch.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import get_args

import msgspec
import pytest

from gateway.failover import Failover
from gateway.in_flight import InFlightTable
from gateway.request_stream import InFlight, WorkerRejected
from gateway.worker_messages import WorkerMessages
from gateway.workers import WorkerRegistry, WorkerState
from tests.wire.registers import cpu_register
from wire.codec import encode
from wire.messages import (
    Abort,
    DrainNotice,
    GatewayMessage,
    Register,
    Rejected,
    ResyncKV,
    Submit,
    TokenBatch,
    TokenDelta,
    Usage,
    WorkerMessage,
)
from wire.sampling import SamplingParams
from wire.tier import DEFAULT_TIERS

MODEL = "mock"


def _register(worker_id: str, pid: int = 1) -> Register:
    return cpu_register(worker_id, model=MODEL, num_kv_blocks=16, pid=pid)


def _delta(request_id: str, epoch: int, token_ids: list[int], finish_reason: str | None = None) -> TokenDelta:
    usage = Usage(prompt_tokens=1, completion_tokens=len(token_ids))
    return TokenDelta(
        request_id=request_id, epoch=epoch, token_ids=token_ids, finish_reason=finish_reason, usage=usage
    )


@dataclass
class Gateway:
    """WorkerMessages over a real registry, in-flight table and failover; sends and placements recorded."""

    in_flight: InFlightTable = field(default_factory=InFlightTable)
    sent: list[tuple[str, GatewayMessage]] = field(default_factory=list)
    placed: list[tuple[str, set[str]]] = field(default_factory=list)
    place_answer: bool = True
    num_notified: int = 0

    def __post_init__(self) -> None:
        self.registry = WorkerRegistry(in_flight=self.in_flight)
        failover = Failover(
            self.registry,
            self.in_flight,
            place=lambda request: self._place(request, set()),
            send=self._send,
            notify=self._notify,
            heartbeat_timeout_s=3.0,
            hang_timeout_s=30.0,
            max_migrations=2,
        )
        self.messages = WorkerMessages(
            self.registry,
            self.in_flight,
            failover,
            place=self._place,
            send=self._send,
            notify=self._notify,
        )

    def _place(self, request: InFlight, exclude: set[str]) -> bool:
        self.placed.append((request.request_id, set(exclude)))
        return self.place_answer

    def _send(self, worker_id: str, message: GatewayMessage) -> bool:
        self.sent.append((worker_id, message))
        return True

    def _notify(self) -> None:
        self.num_notified += 1

    def frame(self, identity: str, message: WorkerMessage) -> None:
        self.messages.on_frames([identity.encode(), encode(message)], 0.0)

    def request_on(self, worker_id: str, request_id: str = "r1", epoch: int = 0) -> InFlight:
        submit = Submit(
            request_id=request_id,
            epoch=epoch,
            prompt_token_ids=[1],
            sampling=SamplingParams(max_tokens=8, temperature=0.0),
            tier=DEFAULT_TIERS[0],
            arrival_time=0.0,
        )
        request = InFlight(submit, MODEL, "", asyncio.Queue())
        self.in_flight.add(request, worker_id)
        return request


@pytest.fixture
def gateway() -> Gateway:
    gateway = Gateway()
    for worker_id in ("w1", "w2"):
        gateway.frame(worker_id, _register(worker_id))
    gateway.sent.clear()  # each new worker was asked for its prefix cache
    return gateway


def test_every_worker_message_type_has_its_own_handler(gateway: Gateway) -> None:
    handlers = gateway.messages.handlers
    assert set(handlers) == set(get_args(WorkerMessage))
    assert len({handler.__name__ for handler in handlers.values()}) == len(handlers)


def test_deltas_reach_their_request_and_the_last_one_ends_it(gateway: Gateway) -> None:
    request = gateway.request_on("w1")
    gateway.frame("w1", TokenBatch(worker_id="w1", step=1, deltas=[_delta("r1", 0, [7, 8])]))
    gateway.frame(
        "w1", TokenBatch(worker_id="w1", step=2, deltas=[_delta("r1", 0, [9], finish_reason="length")])
    )
    assert request.token_ids == [7, 8, 9]
    assert [request.queue.get_nowait().token_ids for _ in range(2)] == [[7, 8], [9]]
    assert "r1" not in gateway.in_flight
    assert gateway.messages.num_stale_deltas == 0 and gateway.sent == []


@pytest.mark.parametrize(
    ("sender", "epoch"),
    [("w1", 1), ("w2", 0)],  # the request runs on w2 at epoch 1: another worker, or an old epoch
)
def test_a_stale_delta_is_dropped_and_its_run_aborted_at_its_own_epoch(
    gateway: Gateway, sender: str, epoch: int
) -> None:
    request = gateway.request_on("w2", epoch=1)
    gateway.frame(sender, TokenBatch(worker_id=sender, step=1, deltas=[_delta("r1", epoch, [5])]))
    assert request.token_ids == [] and request.queue.empty()
    assert gateway.messages.num_stale_deltas == 1
    assert gateway.sent == [(sender, Abort(request_id="r1", epoch=epoch))]
    # A stale delta that is already the last one needs no Abort.
    gateway.frame(
        sender, TokenBatch(worker_id=sender, step=2, deltas=[_delta("r1", epoch, [6], finish_reason="stop")])
    )
    assert gateway.messages.num_stale_deltas == 2 and len(gateway.sent) == 1


def test_a_frame_is_believed_only_from_the_link_of_the_worker_it_names(gateway: Gateway) -> None:
    request = gateway.request_on("w1")
    notified = gateway.num_notified
    gateway.frame("w2", TokenBatch(worker_id="w1", step=1, deltas=[_delta("r1", 0, [5])]))
    gateway.frame("w2", DrainNotice(worker_id="w1", reason="claimed by w2"))
    gateway.frame(
        "rogue", TokenBatch(worker_id="rogue", step=1, deltas=[_delta("r1", 0, [5])])
    )  # never registered
    assert gateway.messages.num_dropped_unknown_peer == 3
    assert gateway.num_notified == notified + 3  # every drop changes a counter
    assert request.token_ids == [] and request.queue.empty()
    worker = gateway.registry.get("w1")
    assert worker is not None and worker.state is WorkerState.READY


def test_frames_not_shaped_as_a_worker_sends_them_are_counted(gateway: Gateway) -> None:
    gateway.messages.on_frames([b"w1"], 0.0)
    gateway.messages.on_frames([b"w1", b"\xc1", b"extra"], 0.0)
    gateway.messages.on_frames([b"w1", b"\xc1 not msgpack"], 0.0)
    assert gateway.messages.num_dropped_multipart == 2
    assert gateway.messages.decoder.stats.dropped_malformed == 1


def test_a_503_rejection_is_placed_again_elsewhere_and_the_client_never_learns(gateway: Gateway) -> None:
    request = gateway.request_on("w1")
    gateway.frame("w1", Rejected(request_id="r1", epoch=0, status=503, field="", message="draining"))
    assert gateway.placed == [("r1", {"w1"})]
    assert request.queue.empty()


@pytest.mark.parametrize(("status", "place_answer"), [(503, False), (400, True)])
def test_a_rejection_that_cannot_be_placed_again_ends_the_stream_with_it(
    gateway: Gateway, status: int, place_answer: bool
) -> None:
    gateway.place_answer = place_answer
    request = gateway.request_on("w1")
    gateway.frame(
        "w1", Rejected(request_id="r1", epoch=0, status=status, field="max_tokens", message="too many")
    )
    error = request.queue.get_nowait()
    assert isinstance(error, WorkerRejected)
    assert (error.status, error.field) == (status, "max_tokens")
    assert "r1" not in gateway.in_flight
    assert gateway.placed == ([("r1", {"w1"})] if status == 503 else [])


def test_a_rejection_from_another_link_or_epoch_is_stale(gateway: Gateway) -> None:
    request = gateway.request_on("w1", epoch=1)
    gateway.frame("w2", Rejected(request_id="r1", epoch=1, status=400, field="", message="not yours"))
    gateway.frame("w1", Rejected(request_id="r1", epoch=0, status=400, field="", message="an old attempt"))
    assert gateway.messages.num_stale_deltas == 2
    assert request.queue.empty() and "r1" in gateway.in_flight


def test_a_new_pid_loses_the_old_process_s_requests_and_asks_for_the_prefix_cache(gateway: Gateway) -> None:
    request = gateway.request_on("w1")
    gateway.frame("w1", msgspec.structs.replace(_register("w1"), pid=2))
    # The failover moves the request (here: placed again) and the new process's index starts over.
    assert [request_id for request_id, _ in gateway.placed] == ["r1"]
    assert request.submit.epoch == 1
    assert ("w1", ResyncKV()) in gateway.sent
