"""The host store against a naive model: a list in least-recently-used order plus a dict of
pins, every operation followed by check(); bytes never exceed the bound and a pinned block is
never evicted."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.kv.host_store import HostStore

CAP = 10


class Naive:
    def __init__(self) -> None:
        self.lru: list[int] = []  # oldest first
        self.size: dict[int, int] = {}
        self.pins: dict[int, int] = {}

    def pinned_bytes(self) -> int:
        return sum(self.size[h] for h in self.pins)

    def room(self) -> int:
        return CAP - self.pinned_bytes()

    def evict_to(self, limit: int) -> None:
        while sum(self.size[h] for h in self.lru) > limit:
            del self.size[self.lru.pop(0)]

    def put(self, h: int, n: int) -> bool:
        if h in self.pins:
            return True
        if h in self.lru:
            self.lru.remove(h)
            self.lru.append(h)
            return True
        if n > self.room():
            return False
        self.evict_to(self.room() - n)
        self.lru.append(h)
        self.size[h] = n
        return True

    def get(self, h: int) -> bool:
        if h in self.pins:
            return True
        if h in self.lru:
            self.lru.remove(h)
            self.lru.append(h)
            return True
        return False

    def pin(self, h: int, n: int) -> bool:
        if h in self.pins:
            self.pins[h] += 1
            return True
        n = self.size.get(h, n)
        if self.pinned_bytes() + n > CAP:
            return False
        if h in self.lru:
            self.lru.remove(h)
        self.size[h] = n
        self.pins[h] = 1
        self.evict_to(self.room())
        return True

    def unpin(self, h: int) -> None:
        if h not in self.pins:
            return
        self.pins[h] -= 1
        if self.pins[h] == 0:
            del self.pins[h]
            n = self.size.pop(h)
            self.put(h, n)

    def delete(self, h: int) -> None:
        if h in self.lru:
            self.lru.remove(h)
            del self.size[h]


ops = st.lists(st.tuples(st.sampled_from(["put", "get", "pin", "unpin", "delete"]),
                         st.integers(0, 7), st.integers(1, 4)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_host_store_matches_a_naive_lru_with_pins(seq):
    store, ref = HostStore(CAP), Naive()
    for op, h, n in seq:
        payload = bytes([h]) * n
        if op == "put":
            assert store.put(h, payload) == ref.put(h, n)
        elif op == "get":
            assert (store.get(h) is not None) == ref.get(h)
        elif op == "pin":
            assert store.pin(h, payload) == ref.pin(h, n)
        elif op == "unpin":
            store.unpin([h])
            ref.unpin(h)
        else:
            store.delete(h)
            ref.delete(h)
        store.check()
        assert {x for x in range(8) if x in store} == set(ref.lru) | set(ref.pins)
        assert store.index._sizes.keys() == set(ref.lru) and list(store.index._sizes) == ref.lru
        assert store.used_bytes <= CAP
