"""Waiting in a test for what another thread, process or event loop does a moment later. The bound only ends a
failing test on a loaded machine: nothing here asserts a timing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
BOUND_SECONDS = 60.0  # generous: CI's 2 cores run two test files and the processes they start at once
POLL_SECONDS = 0.02


def wait_for(condition: Callable[[], T], what: str = "the condition", timeout: float = BOUND_SECONDS) -> T:
    """`condition()`'s first true value, polled until it comes."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"never happened in {timeout:g} s: {what}"
        time.sleep(POLL_SECONDS)
    return result


async def eventually(condition: Callable[[], T], what: str = "the condition", timeout: float = BOUND_SECONDS) -> T:
    """`wait_for` inside an event loop, which keeps running while it waits."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"never happened in {timeout:g} s: {what}"
        await asyncio.sleep(POLL_SECONDS)
    return result
