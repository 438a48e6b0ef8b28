"""The router's approximate radix tree: matching, splitting, per-worker bound, LRU eviction."""

import os
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from radixray.router.tree import ApproxRadixTree


def lcp(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def check_invariants(tree: ApproxRadixTree) -> None:
    """Sizes are exact, bounds hold, parents hold their children's tenants, no dead nodes."""
    sizes: dict[str, int] = {}
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.text and child.text[0] == first
            assert child.parent is node
            assert child.tenants, "a node nobody holds must have been dropped"
            assert child.tenants <= node.tenants or node is tree.root
            stack.append(child)
        for t in node.tenants:
            sizes[t] = sizes.get(t, 0) + len(node.text)
    for t in tree.tenants():
        assert tree.size(t) == sizes.get(t, 0)
        assert tree.size(t) <= tree.max_chars
    assert set(sizes) <= set(tree.tenants())


def test_match_credits_each_worker_with_its_own_prefix():
    tree = ApproxRadixTree(10_000)
    tree.insert("system: be nice. user: hello", "a")
    tree.insert("system: be nice. user: bye", "b")
    m = tree.match("system: be nice. user: help me")
    assert m.chars_for("a") == len("system: be nice. user: hel")
    assert m.chars_for("b") == len("system: be nice. user: ")
    assert m.best({"a", "b"}) == (len("system: be nice. user: hel"), ["a"])
    assert m.best({"b"}) == (len("system: be nice. user: "), ["b"])
    assert tree.match("zzz").best({"a", "b"}) == (0, [])
    check_invariants(tree)


def test_split_keeps_sizes_and_shared_text_is_stored_once():
    tree = ApproxRadixTree(10_000)
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "a")
    tree.insert("abc", "b")
    assert tree.size("a") == len("abc") + len("def") + len("xyz")
    assert tree.size("b") == 3
    assert tree.total_chars() == 9
    assert tree.num_nodes() == 3
    check_invariants(tree)


def test_bound_is_enforced_on_insert_with_lru_order():
    tree = ApproxRadixTree(30)
    tree.insert("A" * 10, "w")
    tree.insert("B" * 10, "w")
    tree.insert("C" * 10, "w")
    tree.insert("A" * 10, "w")  # touch A: B is now the least recently used
    tree.insert("D" * 10, "w")
    assert tree.size("w") == 30
    assert tree.match("B" * 10).chars_for("w") == 0
    for kept in "ACD":
        assert tree.match(kept * 10).chars_for("w") == 10
    check_invariants(tree)


def test_eviction_takes_leaves_before_their_shared_prefix():
    tree = ApproxRadixTree(40)
    prefix = "P" * 20
    tree.insert(prefix + "x" * 10, "w")
    tree.insert(prefix + "y" * 10, "w")  # 40 chars: at the bound
    tree.insert("Q" * 5, "w")  # over by 5: the oldest leaf (..x) goes, not the prefix
    m = tree.match(prefix + "x" * 10)
    assert m.chars_for("w") == 20
    assert tree.match(prefix + "y" * 10).chars_for("w") == 30
    check_invariants(tree)


def test_a_per_insert_bound_below_the_trees_applies_to_that_worker_only():
    tree = ApproxRadixTree(1000)
    for i in range(20):
        tree.insert(chr(65 + i) * 20, "small", max_chars=50)
        tree.insert(chr(65 + i) * 20, "big", max_chars=5000)  # capped by the tree's 1000
    assert tree.size("small") == 40
    assert tree.size("big") == 400
    check_invariants(tree)


def test_one_workers_bound_does_not_evict_another_worker():
    tree = ApproxRadixTree(100)
    tree.insert("shared-" * 10, "a")
    tree.insert("shared-" * 10, "b")
    for i in range(50):
        tree.insert(f"only-a-{i}-" * 3, "a")
    assert tree.match("shared-" * 10).chars_for("b") == 70
    assert tree.size("a") <= 100
    check_invariants(tree)


def test_flood_of_unique_prompts_stays_bounded():
    bound = 20_000
    tree = ApproxRadixTree(bound)
    rng = random.Random(0)
    workers = [f"w{i}" for i in range(4)]
    last = {}
    for i in range(10_000):
        prompt = f"{rng.getrandbits(64):016x}" * 8  # 128 unique chars
        tree.insert(prompt, workers[i % 4])
        last[workers[i % 4]] = prompt
        if i % 1000 == 0:
            check_invariants(tree)
    for w in workers:
        assert bound - 128 < tree.size(w) <= bound
    assert tree.total_chars() <= 4 * bound
    # at most 4*bound/128 whole prompts are held; a trie over n leaves has < n inner nodes
    assert tree.num_nodes() < 2 * (4 * bound // 128 + 4)
    assert tree.evicted_chars > 10_000 * 128 - 8 * bound  # the rest really left
    for w, prompt in last.items():  # the newest prompt of each worker is still whole
        assert tree.match(prompt).chars_for(w) == len(prompt)
    check_invariants(tree)


def test_a_request_longer_than_the_bound_is_cut_to_its_prefix():
    tree = ApproxRadixTree(50)
    tree.insert("a" * 40 + "b" * 40, "w")
    tree.insert("a" * 40 + "c" * 40, "w")
    assert tree.size("w") <= 50
    check_invariants(tree)


def test_remove_tenant_and_clear():
    tree = ApproxRadixTree(1000)
    tree.insert("common prefix one", "a")
    tree.insert("common prefix two", "b")
    tree.remove_tenant("a")
    assert tree.tenants() == ["b"]
    assert tree.match("common prefix one").chars_for("a") == 0
    assert tree.match("common prefix two").chars_for("b") == len("common prefix two")
    assert tree.total_chars() == len("common prefix two")
    check_invariants(tree)
    tree.clear()
    assert tree.num_nodes() == 0 and tree.tenants() == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text("abc", min_size=1, max_size=12), st.sampled_from("xyz")),
                max_size=40),
       st.text("abc", max_size=12))
def test_unbounded_match_equals_longest_common_prefix(inserts, query):
    tree = ApproxRadixTree(10**9)
    seen: dict[str, list[str]] = {}
    for text, tenant in inserts:
        tree.insert(text, tenant)
        seen.setdefault(tenant, []).append(text)
    check_invariants(tree)
    m = tree.match(query)
    for tenant in "xyz":
        expect = max((lcp(query, s) for s in seen.get(tenant, [])), default=0)
        assert m.chars_for(tenant) == expect


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text("ab", min_size=1, max_size=16), st.sampled_from("xy"),
                          st.booleans()), max_size=60))
def test_bounded_tree_keeps_invariants_under_any_sequence(ops):
    tree = ApproxRadixTree(24)
    for text, tenant, remove in ops:
        if remove and len(text) % 5 == 0:
            tree.remove_tenant(tenant)
        else:
            tree.insert(text, tenant)
            # the newest text fits in the bound, so LRU eviction keeps all of it
            assert tree.match(text).chars_for(tenant) == len(text)
        check_invariants(tree)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text("abc", min_size=1, max_size=12), st.sampled_from("xy")),
                max_size=30),
       st.text("abc", min_size=1, max_size=12), st.sampled_from("xy"))
def test_forget_undoes_a_failed_attempts_insert(inserts, failed, tenant):
    """The router inserts a request's text for the worker it picks before sending; when that
    worker fails the request, ``forget`` restores what the tree predicted before."""
    tree = ApproxRadixTree(10**9)
    for text, t in inserts:
        tree.insert(text, t)
    queries = [text for text, _ in inserts] + [failed, failed[:-1]]
    before = [(tree.match(q).chars_for("x"), tree.match(q).chars_for("y")) for q in queries]
    sizes = (tree.size("x"), tree.size("y"))
    keep = tree.match(failed).chars_for(tenant)
    tree.insert(failed, tenant)
    tree.forget(failed, tenant, keep)
    check_invariants(tree)
    assert [(tree.match(q).chars_for("x"), tree.match(q).chars_for("y"))
            for q in queries] == before
    assert (tree.size("x"), tree.size("y")) == sizes
