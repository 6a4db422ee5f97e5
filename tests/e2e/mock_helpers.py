"""What the end-to-end tests against mock workers share: the mock model's known answers and waiting
on a server's own metrics (never a sleep standing in for a condition)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx

from worker.mock import MockModel, MockTokenizer

TOKENIZER = MockTokenizer()
MODEL = MockModel()


def expected_text(prompt_ids: list[int], max_tokens: int) -> str:
    return TOKENIZER.decode(MODEL.transcript(prompt_ids, max_tokens), skip_special_tokens=True)


def chat_ids(text: str) -> list[int]:
    ids = TOKENIZER.apply_chat_template([{"role": "user", "content": text}])
    assert isinstance(ids, list)
    return ids


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one Prometheus sample, or None when no sample matches."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


def workers_idle(base_url: str) -> bool:
    """Every worker reports nothing running or waiting and all its KV blocks free (its last heartbeat)."""
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    workers = re.findall(r'tierserve_worker_kv_blocks_total\{worker="([^"]+)"', text)
    assert workers, text
    return all(
        metric(text, "tierserve_worker_requests_running", worker=w) == 0
        and metric(text, "tierserve_worker_requests_waiting", worker=w) == 0
        and metric(text, "tierserve_worker_kv_blocks_free", worker=w)
        == metric(text, "tierserve_worker_kv_blocks_total", worker=w)
        for w in workers
    )


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)  # polling a deadline-bounded condition
    return predicate()
