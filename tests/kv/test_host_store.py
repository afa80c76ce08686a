"""The host store against a naive model (a list in least-recently-used order), every operation
followed by check(): bytes never exceed the bound, eviction is least recently used first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.kv.host_store import HostStore

CAP = 10


class Naive:
    def __init__(self) -> None:
        self.lru: list[int] = []  # oldest first
        self.size: dict[int, int] = {}

    def put(self, h: int, n: int) -> bool:
        if h in self.lru:
            self.lru.remove(h)
            self.lru.append(h)
            return True
        if n > CAP:
            return False
        while sum(self.size[x] for x in self.lru) + n > CAP:
            del self.size[self.lru.pop(0)]
        self.lru.append(h)
        self.size[h] = n
        return True

    def get(self, h: int) -> bool:
        if h in self.lru:
            self.lru.remove(h)
            self.lru.append(h)
            return True
        return False

    def delete(self, h: int) -> None:
        if h in self.lru:
            self.lru.remove(h)
            del self.size[h]


ops = st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 7), st.integers(1, 12)),
               max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_host_store_matches_a_naive_lru(seq):
    store, ref = HostStore(CAP), Naive()
    for op, h, n in seq:
        if op == "put":
            assert store.put(h, bytes([h]) * n) == ref.put(h, n)
        elif op == "get":
            assert (store.get(h) is not None) == ref.get(h)
        else:
            store.delete(h)
            ref.delete(h)
        store.check()
        assert list(store.index._sizes) == ref.lru
        assert store.used_bytes <= CAP
        assert store.match(ref.lru) == len(ref.lru)
