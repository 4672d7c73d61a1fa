"""Property tests: every store behaves like a dictionary model under random operations."""

from __future__ import annotations

import re
import tempfile

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from spmd.runtime import DistStoreError

from ..conftest import make_store

KEYS = st.sampled_from(["a", "b", "c", "ключ", "k/with/slash", ""])
VALUES = st.one_of(st.binary(max_size=16), st.sampled_from([b"0", b"7", b"-3", b"x"]))


def machine_for(kind: str):
    class StoreModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.tmp = tempfile.TemporaryDirectory()
            self.store, self.keep = make_store(kind, self.tmp.name)
            self.base = self.store.num_keys()
            self.model: dict[str, bytes] = {}

        def teardown(self) -> None:
            for s in self.keep:
                s.close()
            self.tmp.cleanup()

        @rule(key=KEYS, value=VALUES)
        def set(self, key, value):
            self.store.set(key, value)
            self.model[key] = value

        @rule(key=KEYS, amount=st.integers(-1000, 1000))
        def add(self, key, amount):
            current = self.model.get(key)
            try:  # a counter is ASCII whitespace around one decimal integer (C's strtoll)
                if current is not None and not re.fullmatch(
                        rb"[ \t\n\r\f\v]*[+-]?[0-9]+[ \t\n\r\f\v]*", current):
                    raise ValueError(current)
                expected = (int(current) if current is not None else 0) + amount
            except ValueError:
                with pytest.raises(DistStoreError):
                    self.store.add(key, amount)
                return
            assert self.store.add(key, amount) == expected
            self.model[key] = str(expected).encode()

        @rule(key=KEYS, expected=VALUES, desired=VALUES)
        def compare_set(self, key, expected, desired):
            current = self.model.get(key)
            got = self.store.compare_set(key, expected, desired)
            if current is None:
                if expected == b"":
                    self.model[key] = desired
                    assert got == desired
                else:
                    assert got == expected
            elif current == expected:
                self.model[key] = desired
                assert got == desired
            else:
                assert got == current

        @rule(key=KEYS)
        def delete(self, key):
            assert self.store.delete_key(key) == (key in self.model)
            self.model.pop(key, None)

        @rule(key=KEYS, value=VALUES)
        def append(self, key, value):
            self.store.append(key, value)
            self.model[key] = self.model.get(key, b"") + value

        @rule(pairs=st.dictionaries(KEYS, VALUES, max_size=4))
        def multi_set(self, pairs):
            self.store.multi_set(list(pairs), list(pairs.values()))
            self.model.update(pairs)

        @rule(keys=st.lists(KEYS, max_size=4))
        def check(self, keys):
            assert self.store.check(keys) == all(k in self.model for k in keys)

        @rule(data=st.data())
        def get_existing(self, data):
            if not self.model:
                return
            keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3))
            assert self.store.multi_get(keys) == [self.model[k] for k in keys]

        @invariant()
        def same_number_of_keys(self):
            assert self.store.num_keys() == self.base + len(self.model)

    StoreModel.__name__ = f"StoreModel_{kind}"
    return StoreModel


@pytest.mark.parametrize("kind", ["hash", "file", "tcp"])
def test_store_matches_dictionary_model(kind):
    machine = machine_for(kind)
    machine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
    machine.TestCase().runTest()
