"""Which broker node lives where, and which proxy port stands for it.

Port-per-broker routing: each broker node id gets its own listener, at
``broker_port_start + node_id`` unless an explicit ``node_ports`` map says
otherwise. The registry learns the real address of every node from the
responses it rewrites and asks the server to open a listener the first time a
node appears.

A listener that could not be opened (its port taken) stays wanted: it is tried
again when the node is next seen and whenever :meth:`NodeRegistry.reopen_failed`
is called (the server does so on a timer), and :attr:`NodeRegistry.unopened`
names it, with the port and the reason, until it is open - the proxy is not
ready while a known node has no listener, since clients sent to that node's
address would find nothing there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("kiproxy.nodes")

__all__ = ["NodeRegistry"]


class NodeRegistry:
    """Maps node ids to upstream addresses and to the proxy ports that advertise them."""

    def __init__(
        self,
        *,
        advertised_host: str,
        broker_port_start: int,
        node_ports: dict[int, int],
        open_listener: Callable[[int, int], Awaitable[None]],
    ) -> None:
        self.advertised_host = advertised_host
        self.broker_port_start = broker_port_start
        self.node_ports = dict(node_ports)
        self._open_listener = open_listener
        self._upstream: dict[int, tuple[str, int]] = {}
        self._opening: dict[int, asyncio.Task[None]] = {}
        self._settled = True
        """No listener was being opened when last looked (a done task stays done, so this
        holds until one is announced): spares the look on every answer."""

    def port_for(self, node_id: int) -> int:
        """The proxy port that stands for ``node_id``."""
        return self.node_ports.get(node_id, self.broker_port_start + node_id)

    def upstream_for(self, node_id: int) -> tuple[str, int] | None:
        """The real broker address of ``node_id``, once seen in metadata."""
        return self._upstream.get(node_id)

    @property
    def known_nodes(self) -> dict[int, tuple[str, int]]:
        """Every node seen so far and its real address."""
        return dict(self._upstream)

    def seen(self, node_id: int, host: str, port: int) -> tuple[str, int]:
        """Record a node's real address; return the address to advertise instead."""
        previous = self._upstream.get(node_id)
        if previous != (host, port):
            self._upstream[node_id] = (host, port)
            if previous is not None:
                log.info("node %d moved from %s:%d to %s:%d", node_id, *previous, host, port)
        if node_id not in self._opening or self._failed(node_id):
            log.info("node %d (%s:%d) gets listener port %d", node_id, host, port,
                     self.port_for(node_id))
            self._open(node_id)
        return self.advertised_host, self.port_for(node_id)

    def _open(self, node_id: int) -> None:
        """Start opening ``node_id``'s listener. Its outcome is kept for :attr:`unopened`,
        and its error counts as retrieved whoever waits for it, or if nobody does."""
        task = asyncio.ensure_future(self._open_listener(node_id, self.port_for(node_id)))
        task.add_done_callback(_failed_to_open)
        self._opening[node_id] = task
        self._settled = False

    def _failed(self, node_id: int) -> bool:
        """The node's listener could not be opened (port taken): try again when it is next seen."""
        return _failed_to_open(self._opening[node_id])

    @property
    def unopened(self) -> dict[int, tuple[int, str]]:
        """Known nodes whose listener could not be opened: node id -> (port, why)."""
        failed = {}
        for node_id, task in self._opening.items():
            if _failed_to_open(task):
                error = None if task.cancelled() else task.exception()
                failed[node_id] = (self.port_for(node_id),
                                   str(error) if error is not None else "cancelled")
        return failed

    async def reopen_failed(self) -> None:
        """Try again to open every listener that could not be opened; wait for the tries."""
        for node_id in list(self.unopened):
            self._open(node_id)
        await self.settle()

    def stop_opening(self) -> None:
        """Cancel every listener still being opened (the server is stopping: a waiter no
        longer cancels them, see :meth:`settle`)."""
        for task in self._opening.values():
            task.cancel()

    async def settle(self) -> None:
        """Wait until every listener announced so far is open (or failed to open).

        Several connections may wait for the same listener. One whose wait is cancelled
        (its client left) leaves the opening running for the others: ``asyncio.wait``,
        unlike ``gather``, does not cancel what it waits for."""
        pending = [t for t in self._opening.values() if not t.done()]
        if pending:
            await asyncio.wait(pending)

    @property
    def unsettled(self) -> bool:
        """Whether a listener is still being opened."""
        if self._settled:
            return False
        busy = any(not t.done() for t in self._opening.values())
        self._settled = not busy
        return busy


def _failed_to_open(task: asyncio.Future[None]) -> bool:
    """Whether a listener's opening ended without a listener (its error retrieved)."""
    return task.done() and (task.cancelled() or task.exception() is not None)
