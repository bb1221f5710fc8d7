"""A call run on a daemon thread, its outcome handed back to the test's thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_background(body: Callable[[], object]) -> tuple[threading.Thread, list[BaseException | None]]:
    """Start `body` on a daemon thread; the list gets None once it returns, or what it raised."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            body()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome
