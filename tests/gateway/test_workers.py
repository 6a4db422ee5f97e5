"""The worker registry: least-loaded picks, round-robin ties, drain and expiry (no sockets, no clock)."""

from __future__ import annotations

from collections import Counter

import msgspec

from gateway.workers import WorkerRegistry, WorkerState
from policies.routing import RouteRequest
from tests.wire.registers import cpu_register
from wire.messages import DrainNotice, Heartbeat, Register, WorkerStats


def _register(worker_id: str, *, model: str = "m", pid: int = 1) -> Register:
    return cpu_register(worker_id, model=model, num_kv_blocks=100, max_num_seqs=8, pid=pid)


def _heartbeat(
    worker_id: str, *, running: int = 0, waiting: int = 0, free: int = 100, seq: int = 0
) -> Heartbeat:
    stats = WorkerStats(
        num_running=running,
        num_waiting=waiting,
        num_free_blocks=free,
        num_total_blocks=100,
        step_time_ema_ms=1.0,
        num_steps=0,
        num_preemptions=0,
    )
    return Heartbeat(worker_id=worker_id, seq=seq, sent_at=0.0, stats=stats)


def _registry(*worker_ids: str, now: float = 0.0) -> WorkerRegistry:
    registry = WorkerRegistry()
    for worker_id in worker_ids:
        registry.on_register(_register(worker_id), now)
    return registry


def _picked(registry: WorkerRegistry, model: str = "m") -> str | None:
    info = registry.pick(model)
    return info.worker.worker_id if info is not None else None


def test_pick_prefers_fewest_requests_then_least_kv() -> None:
    registry = _registry("a", "b", "c")
    registry.on_heartbeat(_heartbeat("a", running=2), 0.0)
    registry.on_heartbeat(_heartbeat("b", running=1, waiting=1), 0.0)
    registry.on_heartbeat(_heartbeat("c", running=1, free=10), 0.0)
    assert _picked(registry) == "c"  # 1 request beats 2, whatever its KV use
    registry.on_heartbeat(_heartbeat("a", running=1, free=50), 0.0)
    assert _picked(registry) == "a"  # tied on requests: 50% KV in use beats 90%


def test_in_flight_count_beats_a_stale_heartbeat() -> None:
    registry = _registry("a", "b")
    info_a = registry.get("a")
    assert info_a is not None
    info_a.in_flight_ids.update({"r1", "r2"})  # sent since its last (idle) heartbeat
    registry.on_heartbeat(_heartbeat("b", running=1), 0.0)
    assert _picked(registry) == "b"


def test_exact_ties_rotate() -> None:
    registry = _registry("a", "b", "c")
    picks = Counter(_picked(registry) for _ in range(9))
    assert picks == {"a": 3, "b": 3, "c": 3}


def test_only_ready_workers_of_the_model_are_picked() -> None:
    registry = _registry("a", "b")
    registry.on_register(_register("other", model="small"), 0.0)
    registry.on_drain(DrainNotice(worker_id="a", reason="sigterm"), 0.0)
    assert {_picked(registry) for _ in range(4)} == {"b"}
    assert _picked(registry, "small") == "other"
    assert _picked(registry, "nope") is None
    assert registry.pick("m", exclude={"b"}) is None
    assert registry.num_in_state(WorkerState.DRAINING) == 1


def test_expire_marks_silent_workers_dead_once() -> None:
    registry = _registry("a", "b", now=0.0)
    registry.on_heartbeat(_heartbeat("b"), 2.0)
    registry.touch("a", 0.5)  # tokens count as a sign of life too
    dead = registry.expire(now=3.6, timeout_s=3.0)
    assert [w.worker_id for w in dead] == ["a"]
    assert registry.expire(now=3.7, timeout_s=3.0) == []  # already dead: not reported again
    assert _picked(registry) == "b"
    assert [w.worker_id for w in registry.expire(now=10.0, timeout_s=3.0)] == ["b"]
    assert _picked(registry) is None


def test_a_dead_worker_comes_back_with_a_heartbeat_or_register() -> None:
    registry = _registry("a")
    registry.expire(now=10.0, timeout_s=3.0)
    registry.touch("a", 11.0)  # a stray token batch does not revive it
    assert _picked(registry) is None
    registry.on_heartbeat(_heartbeat("a"), 12.0)
    assert _picked(registry) == "a"


def test_reregister_same_pid_keeps_requests_new_pid_loses_them() -> None:
    registry = _registry("a")
    info = registry.get("a")
    assert info is not None
    info.in_flight_ids.add("r1")
    assert registry.on_register(_register("a", pid=1), 1.0) == set()  # a reconnect
    assert info.in_flight_ids == {"r1"}
    assert registry.on_register(_register("a", pid=2, model="m2"), 2.0) == {"r1"}  # a new process
    assert info.in_flight_ids == set()
    assert info.model == "m2"
    assert len(registry) == 1


def test_heartbeat_from_an_unregistered_worker_is_ignored() -> None:
    registry = WorkerRegistry()
    assert registry.on_heartbeat(_heartbeat("ghost"), 0.0) is None
    assert registry.on_drain(DrainNotice(worker_id="ghost", reason="x"), 0.0) is None
    assert len(registry) == 0


def _stepping(worker_id: str, *, steps: int, running: int = 1) -> Heartbeat:
    heartbeat = _heartbeat(worker_id, running=running)
    stats = msgspec.structs.replace(heartbeat.stats, num_steps=steps)
    return msgspec.structs.replace(heartbeat, stats=stats)


def test_a_worker_with_requests_but_no_step_is_ejected_as_hung() -> None:
    registry = _registry("a", "b", "idle", now=0.0)
    registry.on_heartbeat(_stepping("a", steps=5), 0.0)
    registry.on_heartbeat(_stepping("b", steps=5), 0.0)
    registry.on_heartbeat(_stepping("idle", steps=0, running=0), 0.0)
    for t in (1.0, 2.0, 3.0):  # all three keep heartbeating; only b keeps stepping
        registry.on_heartbeat(_stepping("a", steps=5), t)
        registry.on_heartbeat(_stepping("b", steps=5 + int(t)), t)
        registry.on_heartbeat(_stepping("idle", steps=0, running=0), t)
    assert registry.expire(now=3.0, timeout_s=1.5) == []  # nobody is silent
    assert registry.expire_hung(now=2.9, hang_timeout_s=3.0) == []
    assert [w.worker_id for w in registry.expire_hung(now=3.1, hang_timeout_s=3.0)] == ["a"]
    assert registry.expire_hung(now=3.2, hang_timeout_s=3.0) == []  # reported once
    info = registry.get("a")
    assert info is not None and info.state is WorkerState.DEAD


def test_a_hung_worker_is_readmitted_only_once_it_steps_again_or_is_idle() -> None:
    registry = _registry("a", "b", now=0.0)
    registry.on_heartbeat(_stepping("a", steps=7), 0.0)
    registry.on_heartbeat(_stepping("b", steps=3), 0.0)
    hung = registry.expire_hung(now=31.0, hang_timeout_s=30.0)
    assert {w.worker_id for w in hung} == {"a", "b"}
    registry.on_heartbeat(_stepping("a", steps=7), 31.5)  # still talking, still stuck
    registry.on_register(_register("a", pid=1), 31.5)  # the same process redialling is no proof either
    assert _picked(registry) is None
    registry.on_heartbeat(_stepping("a", steps=8), 32.0)  # a new step: it works again
    assert _picked(registry) == "a"
    registry.on_heartbeat(_stepping("b", steps=3, running=0), 32.0)  # its requests were aborted: idle
    assert registry.num_in_state(WorkerState.READY) == 2
    # Readmission starts a fresh grace period: its old progress time does not eject it again at once.
    registry.on_heartbeat(_stepping("a", steps=8), 33.0)
    assert registry.expire_hung(now=33.0, hang_timeout_s=30.0) == []


def test_a_silent_worker_is_readmitted_when_it_talks_again() -> None:
    registry = _registry("a", "b", "c", now=0.0)
    for worker_id in ("a", "b", "c"):
        registry.on_heartbeat(_stepping(worker_id, steps=7), 0.0)
    assert len(registry.expire(now=2.0, timeout_s=1.5)) == 3  # SIGSTOP, say, or a network partition
    registry.on_heartbeat(_stepping("a", steps=7), 5.0)  # SIGCONT: its stats are from before the stop
    registry.on_register(_register("b", pid=1), 5.0)  # its link was dropped meanwhile: it redials
    registry.on_register(_register("c", pid=2), 5.0)  # a new process under the same id
    assert registry.num_in_state(WorkerState.READY) == 3
    assert registry.expire_hung(now=6.0, hang_timeout_s=30.0) == []


def test_candidates_are_the_workers_taking_the_prompt_s_context_class_with_room_after_it() -> None:
    registry = WorkerRegistry()
    short = msgspec.structs.replace(_register("short"), context_classes=["short"], max_model_len=1024)
    long = msgspec.structs.replace(_register("long"), context_classes=["long"], max_model_len=8192)
    anything = _register("any")  # declares no class: takes them all, up to its 4096
    for message in (short, long, anything):
        registry.on_register(message, 0.0)

    def ids(context_class: str | None, num_prompt_tokens: int = 0) -> set[str]:
        found = registry.ready("m", context_class=context_class, num_prompt_tokens=num_prompt_tokens)
        return {info.worker_id for info in found}

    assert ids(None) == {"short", "long", "any"}
    assert ids("short", 10) == {"short", "any"}
    assert ids("long", 2000) == {"long", "any"}
    assert ids("long", 5000) == {"long"}
    assert ids("long", 8192) == set()  # no room left for even one token
    request = RouteRequest(request_id="r", model="m", tier=None, num_prompt_tokens=5000, context_class="long")
    pick = registry.pick("m", request=request)
    assert pick is not None and pick.worker.worker_id == "long"


def test_routing_sees_each_workers_device_from_its_register() -> None:
    registry = WorkerRegistry()
    gpu = msgspec.structs.replace(
        _register("gpu"),
        device="cuda:0",
        dtype="bfloat16",
        device_name="NVIDIA H200",
        device_memory_bytes=141 << 30,
    )
    registry.on_register(gpu, 0.0)
    registry.on_register(_register("old"), 0.0)  # a worker from before the device fields
    views = {}
    for worker_id in ("gpu", "old"):
        info = registry.get(worker_id)
        assert info is not None
        views[worker_id] = registry.view(info)
    fast = views["gpu"]
    assert (fast.device, fast.device_name, fast.device_memory_bytes, fast.dtype) == (
        "cuda:0",
        "NVIDIA H200",
        141 << 30,
        "bfloat16",
    )
    assert (views["old"].device, views["old"].device_name, views["old"].device_memory_bytes) == (
        "cpu",
        None,
        None,
    )
