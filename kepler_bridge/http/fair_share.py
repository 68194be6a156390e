"""A few slots of costly work (bcrypt checks) shared out fairly among client addresses.

Waiting checks get a free slot round-robin by address, oldest first within one address. One
address holds at most one check per user name at a time, and, while other addresses are clients
too, at most as many checks as there are slots. A check that would pass those bounds is refused at
once: it never holds one of the few request threads, so a flood from one address cannot keep
another address's check from a thread or a slot. Nothing here depends on whether a user exists.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import Counter, OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

# An address that asked within this time counts as a client that the others must leave room for.
RECENT_SECONDS = 60.0
RECENT_ADDRESSES = 4096
# IPv6 clients are told apart by network: one host holds a whole /64.
IPV6_PREFIX = 64


def address_key(address: str | None) -> str:
    """The client an address belongs to: the IPv4 address, or the /64 network of an IPv6 one."""
    try:
        parsed = ipaddress.ip_address(address or "")
    except ValueError:
        return address or ""
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/{IPV6_PREFIX}", strict=False))
    return str(parsed)


@dataclass(eq=False)
class _Ticket:
    """A check waiting for a slot."""

    admitted: bool = False


class FairShare:
    """`slots` pieces of work at once, handed out round-robin by client address."""

    def __init__(self, slots: int, wait_seconds: float) -> None:
        self.slots, self.wait_seconds = slots, wait_seconds
        self._cond = threading.Condition()
        self._free = slots
        self._waiting: OrderedDict[str, deque[_Ticket]] = OrderedDict()  # in round-robin order
        self._holders: set[tuple[str, str]] = set()  # (address, name) running or waiting
        self._held: Counter[str] = Counter()
        self._recent: OrderedDict[str, float] = OrderedDict()

    def seen(self, address: str) -> None:
        """Note a request from `address`, answered from a cache or not: it is a client now."""
        now = time.monotonic()
        with self._cond:
            self._recent[address] = now
            self._recent.move_to_end(address)
            while self._recent and (
                len(self._recent) > RECENT_ADDRESSES
                or next(iter(self._recent.values())) < now - RECENT_SECONDS
            ):
                self._recent.popitem(last=False)

    @contextmanager
    def slot(self, address: str, name: str) -> Iterator[bool]:
        """Hold a slot for `name`'s check from `address`; yields False (do not run it) when that
        would pass a bound or no slot came free within `wait_seconds`."""
        admitted = self._enter(address, name)
        try:
            yield admitted
        finally:
            if admitted:
                self._leave(address, name)

    def _enter(self, address: str, name: str) -> bool:
        with self._cond:
            if (address, name) in self._holders or self._over_share(address):
                return False
            self._holders.add((address, name))
            self._held[address] += 1
            if self._free and not self._waiting:
                self._free -= 1
                return True
            ticket = _Ticket()
            self._waiting.setdefault(address, deque()).append(ticket)
            if not self._cond.wait_for(lambda: ticket.admitted, self.wait_seconds):
                queue = self._waiting[address]
                queue.remove(ticket)
                if not queue:
                    del self._waiting[address]
                self._give_up_place(address, name)
            return ticket.admitted

    def _over_share(self, address: str) -> bool:
        return self._held[address] >= self.slots and len(self._recent) > 1

    def _leave(self, address: str, name: str) -> None:
        with self._cond:
            self._give_up_place(address, name)
            self._free += 1
            while self._free and self._waiting:
                first, queue = next(iter(self._waiting.items()))
                queue.popleft().admitted = True
                self._free -= 1
                if queue:
                    self._waiting.move_to_end(first)
                else:
                    del self._waiting[first]
            self._cond.notify_all()

    def _give_up_place(self, address: str, name: str) -> None:
        self._holders.discard((address, name))
        self._held[address] -= 1
        if not self._held[address]:
            del self._held[address]
