"""Every method of every store, against the semantics of torch.distributed.Store."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from spmd.runtime import DistStoreError, DistTimeoutError, HashStore, PrefixStore


def test_set_get_roundtrip_bytes_and_str(store):
    store.set("a", b"\x00\xffbytes")
    store.set("b", "text é")
    store.set("c", bytearray(b"ba"))
    assert store.get("a") == b"\x00\xffbytes"
    assert store.get("b") == "text é".encode("utf-8")
    assert store.get("c") == b"ba"
    store.set("a", b"")
    assert store.get("a") == b""


def test_get_blocks_until_set_by_another_thread(store):
    threading.Timer(0.2, lambda: store.set("late", b"v")).start()
    start = time.monotonic()
    assert store.get("late") == b"v"
    assert time.monotonic() - start >= 0.15


def test_get_times_out_naming_the_key(store):
    store.set_timeout(timedelta(seconds=0.3))
    start = time.monotonic()
    with pytest.raises(DistTimeoutError, match="never-set") as info:
        store.get("never-set")
    assert isinstance(info.value, TimeoutError)
    assert 0.25 <= time.monotonic() - start < 5
    store.set("after", b"1")  # the store (and a TCP connection) is still usable
    assert store.get("after") == b"1"


def test_add_counts_from_zero_and_is_readable(store):
    assert store.add("n", 3) == 3
    assert store.add("n", -5) == -2
    assert store.get("n") == b"-2"
    store.set("m", b"40")
    assert store.add("m", 2) == 42


def test_add_on_non_number_raises_and_store_stays_usable(store):
    store.set("word", b"hello")
    with pytest.raises(DistStoreError, match="not a decimal integer"):
        store.add("word", 1)
    assert store.get("word") == b"hello"
    assert store.add("fine", 1) == 1


def test_compare_set_semantics(store):
    # missing key, empty expected: stores desired
    assert store.compare_set("k", b"", b"first") == b"first"
    assert store.get("k") == b"first"
    # present and equal: swaps
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.get("k") == b"second"
    # present and different: unchanged, returns current
    assert store.compare_set("k", b"nope", b"third") == b"second"
    assert store.get("k") == b"second"
    # missing key, non-empty expected: unchanged, returns expected
    assert store.compare_set("absent", b"exp", b"des") == b"exp"
    assert not store.check(["absent"])


def test_wait_returns_when_all_keys_exist(store):
    def later():
        time.sleep(0.1)
        store.set("w1", b"1")
        time.sleep(0.1)
        store.set("w2", b"2")

    threading.Thread(target=later).start()
    store.wait(["w1", "w2"])
    assert store.check(["w1", "w2"])


def test_wait_timeout_argument_and_missing_keys_in_message(store):
    store.set("here", b"1")
    with pytest.raises(DistTimeoutError, match="gone") as info:
        store.wait(["here", "gone"], timedelta(seconds=0.2))
    assert "here" not in str(info.value).split("keys")[-1]


def test_check_delete_num_keys(store):
    base = store.num_keys()
    assert not store.check(["x"])
    store.set("x", b"1")
    store.set("y", b"2")
    assert store.check(["x", "y"]) and not store.check(["x", "z"])
    assert store.num_keys() == base + 2
    assert store.delete_key("x") is True
    assert store.delete_key("x") is False
    assert not store.check(["x"])
    assert store.num_keys() == base + 1


def test_multi_set_and_multi_get(store):
    store.multi_set(["m1", "m2", "m3"], [b"1", "2", b""])
    assert store.multi_get(["m3", "m1", "m2"]) == [b"", b"1", b"2"]
    threading.Timer(0.1, lambda: store.set("m4", b"4")).start()
    assert store.multi_get(["m1", "m4"]) == [b"1", b"4"]


def test_append_creates_and_extends(store):
    store.append("log", b"a")
    store.append("log", "b")
    store.append("log", b"c")
    assert store.get("log") == b"abc"


def test_timeout_property_and_set_timeout(store):
    store.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7)


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda s: s.set(1, b"v"), TypeError),
        (lambda s: s.set("k", 5), TypeError),
        (lambda s: s.get(b"k"), TypeError),
        (lambda s: s.add("k", 1.5), TypeError),
        (lambda s: s.add("k", True), TypeError),
        (lambda s: s.wait("k"), TypeError),
        (lambda s: s.wait(["k"], timedelta(seconds=-1)), ValueError),
        (lambda s: s.wait(["k"], "soon"), TypeError),
        (lambda s: s.check("k"), TypeError),
        (lambda s: s.multi_set(["a", "b"], [b"1"]), ValueError),
        (lambda s: s.multi_set(["a"], b"1"), TypeError),
        (lambda s: s.set_timeout(timedelta(0)), ValueError),
        (lambda s: s.compare_set("k", None, b"x"), TypeError),
    ],
)
def test_bad_arguments_raise_before_io(store, call, exc):
    with pytest.raises(exc):
        call(store)
    store.set("still", b"ok")
    assert store.get("still") == b"ok"


def test_prefix_store_namespaces_keys():
    base = HashStore()
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", b"1")
    b.set("k", b"2")
    assert base.get("a/k") == b"1" and base.get("b/k") == b"2"
    assert a.get("k") == b"1"
    assert a.add("n", 2) == 2 and base.get("a/n") == b"2"
    nested = PrefixStore("inner", a)
    nested.set("z", b"3")
    assert base.get("a/inner/z") == b"3"
    assert a.underlying_store is base
    with pytest.raises(TypeError):
        PrefixStore(3, base)
    with pytest.raises(TypeError):
        PrefixStore("p", object())


def test_file_store_file_outlives_the_first_of_two_open_users(tmp_path):
    """Two users of one file, each with world_size=1 (a process group's init file and
    RPC's): the file goes when the last one closes, not the first (as in torch)."""
    from spmd.runtime import FileStore

    path = tmp_path / "shared.store"
    first, second = FileStore(str(path), 1), FileStore(str(path), 1)
    first.set("k", b"v")
    first.close()
    assert path.exists() and second.get("k") == b"v"
    second.close()
    assert not path.exists()


def test_queues_push_pop_len(store):
    from spmd.runtime import DistStoreError, QueueEmptyError

    assert store.has_extended_api()
    assert store.queue_len("q") == 0
    with pytest.raises(QueueEmptyError, match="empty"):
        store.queue_pop("q", block=False)
    for item in (b"a", "b", b"c"):
        store.queue_push("q", item)
    assert store.queue_len("q") == 3
    assert [store.queue_pop("q") for _ in range(3)] == [b"a", b"b", b"c"]
    assert store.queue_len("q") == 0
    # a blocking pop waits for a producer elsewhere
    import threading

    threading.Timer(0.2, lambda: store.queue_push("q", b"late")).start()
    assert store.queue_pop("q") == b"late"
    # and gives up after the store's timeout: a store error and a timeout, as torch's is
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(DistStoreError) as caught:
        store.queue_pop("q")
    assert isinstance(caught.value, TimeoutError)


def test_a_queue_with_items_counts_as_a_key_for_check_and_wait(store):
    """torch's TCPStore and HashStore: ``check`` and ``wait`` see a queue while it holds
    items; ``get``, ``delete_key`` and ``num_keys`` see only keys (torch's test_queues)."""
    assert not store.check(["jobs"])
    store.queue_push("jobs", b"1")
    store.queue_push("jobs", b"2")
    assert store.check(["jobs"]) and store.queue_len("jobs") == 2
    store.wait(["jobs"], timedelta(seconds=1))
    store.set("other", b"x")
    assert store.check(["jobs", "other"])
    assert not store.delete_key("jobs") and store.queue_len("jobs") == 2
    assert store.queue_pop("jobs") == b"1" and store.queue_pop("jobs") == b"2"
    assert not store.check(["jobs"]) and store.queue_len("jobs") == 0
    with pytest.raises(DistTimeoutError):
        store.wait(["jobs"], timedelta(seconds=0.2))
    # a wait parked on a key wakes when another thread pushes to that queue
    threading.Timer(0.2, lambda: store.queue_push("late", b"v")).start()
    store.wait(["late"], timedelta(seconds=5))
    assert store.queue_pop("late", block=False) == b"v"
    # a queue and a key of the same name are apart, as in torch
    store.queue_push("both", b"queued")
    store.set("both", b"value")
    assert store.get("both") == b"value" and store.queue_pop("both") == b"queued"


def test_store_timeouts_are_store_errors(store):
    from spmd.runtime import DistStoreError, DistTimeoutError

    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(DistStoreError) as caught:
        store.get("never-set")
    assert isinstance(caught.value, DistTimeoutError)


def test_every_store_timeout_says_timeout(store):
    """torch's tests match a store's timeouts on "timeout" (lower case)."""
    store.set_timeout(timedelta(seconds=0.2))
    for call in (lambda: store.get("never-set"), lambda: store.multi_get(["a", "never-set"]),
                 lambda: store.wait(["never-set"]), lambda: store.queue_pop("empty"),
                 lambda: store.wait(["never-set"], timedelta(seconds=0.1))):
        with pytest.raises(DistTimeoutError, match="timeout"):
            call()


def test_clone_is_another_handle_on_the_same_store(store):
    twin = store.clone()
    store.set("from-original", b"1")
    twin.set("from-clone", b"2")
    assert twin.get("from-original") == b"1" and store.get("from-clone") == b"2"
    if twin is not store:
        twin.close()
    store.set("after", b"3")  # closing the clone leaves the original working
    assert store.get("after") == b"3"
