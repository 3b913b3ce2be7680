"""The prefix-affinity rule shared by the Ray Serve router and the simulator."""

from __future__ import annotations

import pytest

from segserve.routing.prefix_affinity import PrefixAffinity, chained_keys, text_keys


def test_chained_keys_name_prefixes():
    a, b = chained_keys([1, 2, 3]), chained_keys([1, 2, 4])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert chained_keys([2, 3])[0] != a[1]  # a block's key depends on everything before it


def test_text_keys_whole_blocks_only():
    assert text_keys("x" * 63, 64) == []
    assert len(text_keys("x" * 64 + "y" * 63, 64)) == 1
    assert text_keys("a" * 128, 64) == chained_keys(["a" * 64, "a" * 64])


def test_new_prefixes_spread_then_stick():
    rule = PrefixAffinity()
    groups = [chained_keys([g, 1, 2]) for g in range(4)]
    picks = [rule.choose(groups[i % 4], {"r0": 0, "r1": 0}) for i in range(32)]
    # First sight of each group: least loaded, then fewest remembered keys (r0, r1, r0, r1).
    assert picks[:4] == ["r0", "r1", "r0", "r1"]
    assert picks == picks[:4] * 8


def test_overloaded_match_goes_to_least_loaded():
    rule = PrefixAffinity(imbalanced_threshold=2)
    keys = chained_keys([7, 8])
    assert rule.choose(keys, {"a": 0, "b": 0}) == "a"
    assert rule.choose(keys, {"a": 2, "b": 0}) == "a"  # 2 above the least: still a candidate
    assert rule.choose(keys, {"a": 3, "b": 0}) == "b"  # 3 above: not
    assert rule.match_len(keys, "b") == 2  # and b now remembers it


def test_low_match_rate_goes_to_least_loaded():
    rule = PrefixAffinity(match_rate_threshold=0.5)
    rule.remember("a", chained_keys([1]))
    # 1 of 4 blocks matched on a (0.25 < 0.5): the least-loaded b.
    assert rule.choose(chained_keys([1, 2, 3, 4]), {"a": 0, "b": 1, "c": 1}) == "a"  # a is least loaded too
    assert rule.choose(chained_keys([1, 5, 6, 7]), {"a": 1, "b": 0}) == "b"
    assert rule.choose(chained_keys([1, 2, 3, 4]), {"a": 1, "b": 0}) == "a"  # 4 of 4 on a now


def test_lru_cap_and_forget():
    rule = PrefixAffinity(max_keys_per_replica=3)
    rule.remember("a", chained_keys([1, 2, 3, 4]))
    assert rule.num_keys("a") == 3 and rule.match_len(chained_keys([1, 2, 3, 4]), "a") == 0
    rule.forget("a")
    assert rule.num_keys("a") == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"imbalanced_threshold": -1}, "imbalanced_threshold must be >= 0, got -1"),
    ({"match_rate_threshold": 1.5}, r"match_rate_threshold must be in \[0, 1\], got 1.5"),
    ({"max_keys_per_replica": 0}, "max_keys_per_replica must be >= 1, got 0"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefixAffinity(**kwargs)


def test_no_replicas():
    with pytest.raises(ValueError, match="no replicas"):
        PrefixAffinity().choose([], {})
