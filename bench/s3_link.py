"""A bandwidth-limited link to the bench's S3 server, as from a remote store.

``read.s3`` and its ceiling read from moto on the reading machine's own cores, where the read
is bound by CPU. Object storage reached over a network is bound by each connection's
bandwidth instead, and that is where prefetching in parallel has to keep up.
``python -m bench --s3-mbps N`` puts this loopback proxy between both readers and the server:
every response reaches its reader at ``N`` MB/s per connection, requests pass unchanged.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# An idle connection gains no credit: a response after a pause starts at the rate again.
IDLE_S = 0.05


@dataclass
class Pacer:
    """How long to wait after each piece so that pieces leave at ``rate`` bytes/s at most."""

    rate: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0, init=False)
    sent: int = field(default=0, init=False)

    def pause_after(self, size: int) -> float:
        now = self.clock()
        if self.sent and self.sent / self.rate - (now - self.start) < -IDLE_S:
            self.sent = 0  # the link was idle: no burst to catch up
        if not self.sent:
            self.start = now
        self.sent += size
        return max(0.0, self.sent / self.rate - (now - self.start))


class LimitedLink:
    """A loopback proxy to ``target`` (host, port) whose responses go at ``mbps`` MB/s per
    connection; ``endpoint_url`` is what clients use instead of the server's."""

    def __init__(self, target: tuple[str, int], *, mbps: float) -> None:
        self.target, self.rate = target, mbps * 2**20
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_forward, args=(client, server, None), daemon=True).start()
            pacer = Pacer(self.rate)
            threading.Thread(target=_forward, args=(server, client, pacer), daemon=True).start()


def _forward(source: socket.socket, sink: socket.socket, pacer: Pacer | None) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)
            if pacer is not None:
                time.sleep(pacer.pause_after(len(data)))
    for sock in (source, sink):  # either side done: both directions end
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
