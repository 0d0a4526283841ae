"""PrefixCache as a state machine: whatever sequence of puts, lookups and drops, a lookup returns a prefix of the
prompt that some kept entry of the same tag holds (its K/V are that entry's, cut to the prefix), never one under
`MIN_REUSE` nor the prompt's last token; an entry's sequence is never kept twice; the cache stays within its budget.

The fake K/V carry each position's token id, so a returned cache can be checked against the prompt itself."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from astratk.engines.torch_prefix_cache import MIN_REUSE, PrefixCache

LAYERS, HEADS = 2, 1
TAGS = st.sampled_from([(None, 0, 0), (None, 1, 1), ("a", 3, 0)])
# sequences over few tokens and a shared head, so common prefixes of every length happen
HEAD = tuple(range(1, MIN_REUSE + 5))
SEQS = st.tuples(st.integers(0, len(HEAD)), st.lists(st.integers(1, 3), max_size=12)).map(
    lambda t: HEAD[:t[0]] + tuple(t[1]))


def kv_of(tokens: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)  # [H, L, D]: position i holds token i
    return [(t.clone(), -t.clone()) for _ in range(LAYERS)]


def nbytes(tokens: tuple[int, ...]) -> int:
    return LAYERS * 2 * len(tokens) * 4


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.budget = nbytes(HEAD) * 3
        self.cache = PrefixCache(self.budget)
        self.kept: dict[tuple, set[tuple[int, ...]]] = {}  # what may be held, per tag (evictions shrink the truth)

    @rule(tag=TAGS, seq=SEQS)
    def put(self, tag, seq) -> None:
        self.cache.put(tag, list(seq), kv_of(seq))
        if len(seq) >= MIN_REUSE:
            self.kept.setdefault(tag, set()).add(seq)

    @rule(tag=TAGS, prompts=st.lists(SEQS.filter(bool), min_size=1, max_size=4))
    def lookup(self, tag, prompts) -> None:
        for prompt, (kv, m) in zip(prompts, self.cache.lookup(tag, prompts)):
            if kv is None:
                assert m == 0
                continue
            assert MIN_REUSE <= m <= len(prompt) - 1
            for k, v in kv:
                assert k.shape == (1, m, 1)
                assert k.view(-1).tolist() == list(prompt[:m]) and v.view(-1).tolist() == [-x for x in prompt[:m]]
            # some sequence put under this tag starts with the reused prefix
            assert any(s[:m] == prompt[:m] for s in self.kept.get(tag, ()))

    @rule(tag=TAGS)
    def drop_tag(self, tag) -> None:
        self.cache.drop(lambda t: t != tag)
        self.kept.pop(tag, None)

    @invariant()
    def within_budget(self) -> None:
        assert 0 <= self.cache.bytes <= self.budget
        held = [(e.tag, tuple(e.tokens.tolist())) for e in self.cache._entries.values()]
        assert self.cache.bytes == sum(nbytes(s) for _, s in held)
        for i, (tag, s) in enumerate(held):  # no entry is a prefix of another of its tag
            assert not any(t == tag and o[:len(s)] == s for j, (t, o) in enumerate(held) if j != i)


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_a_lookup_finds_the_longest_common_prefix_and_a_put_supersedes_an_earlier_turn() -> None:
    cache = PrefixCache(1 << 20)
    tag = (None, 0, 0)
    first = HEAD + (1, 2)
    cache.put(tag, list(first), kv_of(first))
    [(kv, m)] = cache.lookup(tag, [first + (3, 3)])
    assert m == len(first) and kv[0][0].shape[1] == m
    [(_, m)] = cache.lookup(tag, [HEAD[:-2] + (9, 9)])  # a new episode: the shared head only
    assert m == len(HEAD) - 2
    [(_, m)] = cache.lookup(tag, [first])  # the whole sequence: its last token stays to prefill
    assert m == len(first) - 1
    assert cache.lookup((None, 1, 1), [first + (3,)]) == [(None, 0)]  # another version's weights
    cache.put(tag, list(first + (3, 3, 1)), kv_of(first + (3, 3, 1)))  # the next turn supersedes the first
    assert cache.entries == 1 and cache.bytes == nbytes(first + (3, 3, 1))
    cache.put(tag, list(first), kv_of(first))  # held whole already
    assert cache.entries == 1


def test_a_workload_that_never_reuses_a_prefix_stops_paying_for_the_cache() -> None:
    """Single-turn tasks: after `patience_rows` rows in a row without a hit, sequences are no longer kept and the
    entries are freed; a hit resets the count."""
    cache = PrefixCache(1 << 20, patience_rows=5)
    tag = (None, 0, 0)
    cache.put(tag, list(HEAD), kv_of(HEAD))
    assert cache.lookup(tag, [HEAD + (1,)])[0][1] == len(HEAD)  # a hit
    for i in range(5):
        cache.lookup(tag, [(9, 9, 9, i)])  # short, unrelated prompts: no hit
    assert cache.storing and cache.entries == 1
    cache.lookup(tag, [(8,) * 40])
    assert not cache.storing and cache.entries == 0 and cache.bytes == 0 and cache.stats["prefix_stopped"] == 1
    cache.put(tag, list(HEAD), kv_of(HEAD))
    assert cache.entries == 0
