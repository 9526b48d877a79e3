"""``Rounds``: a background task of the app that works in rounds (the static view
poller, the pair checks): one round at start, then one after every ``wait`` until
stopped. A round that raises is logged and the next one runs anyway: a bug in one
round must not end the task. Runs on the app's event loop; ``start``/``stop`` are
called by the app's lifespan.
"""

from __future__ import annotations

import abc
import asyncio
import logging

log = logging.getLogger(__name__)


class Rounds(abc.ABC):
    task_name = "rounds"
    _task: asyncio.Task | None = None

    @abc.abstractmethod
    async def round(self) -> None:
        """One round of work."""

    @abc.abstractmethod
    async def wait(self) -> None:
        """Until the next round is due."""

    async def start(self) -> None:
        """One round first, so what the task maintains exists before the app serves."""
        await self.round()
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self.wait()
            try:
                await self.round()
            except Exception:  # noqa: BLE001 - see the module docstring
                log.exception("%s failed", self.task_name)
