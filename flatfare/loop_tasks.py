"""``flatfare_event_loop_tasks``: the asyncio tasks alive in a process's event loop, read at scrape time.

A task that never ends (a watcher per request left behind, a retry loop started twice) is the slow leak
of an asyncio server: memory grows a little with each, and nothing else shows it. The gateway's
``/metrics`` and the worker's report this gauge; ``python -m bench soak`` watches it over an hour.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

NAME = "flatfare_event_loop_tasks"


class EventLoopTasks(Collector):
    """The tasks of ``loop``; labelled with the process id, since a gateway's scrape is answered by any one
    of its processes."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop

    @classmethod
    def of_running_loop(cls) -> EventLoopTasks:
        """The caller's running loop's; none (nothing reported) when called outside one."""
        try:
            return cls(asyncio.get_running_loop())
        except RuntimeError:
            return cls(None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self._loop is None:
            return
        # A scrape from another thread (the worker's metrics server) can meet the task set changing.
        for _ in range(5):
            try:
                count = len(asyncio.all_tasks(self._loop))
                break
            except RuntimeError:
                continue
        else:
            return
        family = GaugeMetricFamily(NAME, "Asyncio tasks alive in this process's event loop (a count that "
                                   "only grows under a steady load is a leak).", labels=["pid"])
        family.add_metric([str(os.getpid())], count)
        yield family
