"""The task generators: deterministic, well-formed, and their targets are what they claim."""

from __future__ import annotations

import pytest

from mamba_stream.quality.tasks import DISTRACTOR_WORDS, KEYS, VALUES, parity_sample, recall_sample


def test_the_same_seed_and_index_give_the_same_sample_and_others_differ():
    a = [recall_sample(3, i, pairs=5, delay=40) for i in range(50)]
    assert a == [recall_sample(3, i, pairs=5, delay=40) for i in range(50)]
    assert len({s.text for s in a}) == 50
    assert [s.text for s in a] != [recall_sample(4, i, pairs=5, delay=40).text for i in range(50)]
    assert parity_sample(1, 9, bits=30) == parity_sample(1, 9, bits=30)
    # pinned: a generator change that reshuffles every held-out set must be deliberate
    assert recall_sample(0, 1, pairs=4, delay=12).text == "n6 t1 y8 m4|CAT BLUE CAT|t1 n6 y8 m4"


@pytest.mark.parametrize("pairs,delay", [(1, 0), (4, 0), (6, 33), (26, 300)])
def test_recall_targets_are_the_facts_values_after_the_delay(pairs, delay):
    for i in range(20):
        s = recall_sample(5, i, pairs=pairs, delay=delay)
        facts = s.meta["facts"]
        head, distractor, _queries = s.text.split("|")
        assert len(distractor) == delay and set(distractor) <= set("".join(DISTRACTOR_WORDS) + " ")
        assert [f"{k}{v}" for k, v in facts.items()] == head.split(" ")
        assert len(set(facts)) == pairs and set(facts) <= set(KEYS) and set(facts.values()) <= set(VALUES)
        assert s.prefix_end == len(head) + len(distractor) + 2  # both separators
        assert len(s.targets) == pairs
        for o in s.targets:  # each target is a value, right after its key in the query part
            assert o > s.prefix_end and s.text[o] == facts[s.text[o - 1]]
        assert bytes(s.answers()).decode() == "".join(s.text[o] for o in s.targets)


def test_repeated_queries_ask_known_keys_and_defeat_elimination():
    samples = [recall_sample(5, i, pairs=4, delay=3, repeat=True) for i in range(40)]
    assert samples == [recall_sample(5, i, pairs=4, delay=3, repeat=True) for i in range(40)]
    asked_twice = 0
    for s in samples:
        facts = s.meta["facts"]
        asked = [s.text[o - 1] for o in s.targets]
        assert len(asked) == 4 and set(asked) <= set(facts)
        assert all(s.text[o] == facts[s.text[o - 1]] for o in s.targets)
        asked_twice += len(set(asked)) < len(asked)
    assert asked_twice >= 20  # 4 draws from 4 keys repeat one with probability 0.91
    # the default draws what it always drew
    assert recall_sample(0, 1, pairs=4, delay=12, repeat=False).text == "n6 t1 y8 m4|CAT BLUE CAT|t1 n6 y8 m4"


def test_parity_targets_are_the_parity():
    for i in range(50):
        s = parity_sample(2, i, bits=1 + i)
        bits = s.text[2:-2]
        assert s.text.startswith("p:") and s.text[-2] == "=" and len(bits) == 1 + i
        assert s.text[s.targets[0]] == str(bits.count("1") % 2)


@pytest.mark.parametrize("kwargs", [{"pairs": 0}, {"pairs": 27}, {"delay": -1}])
def test_bad_recall_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        recall_sample(0, 0, **kwargs)


def test_bad_parity_length_is_refused():
    with pytest.raises(ValueError):
        parity_sample(0, 0, bits=0)
