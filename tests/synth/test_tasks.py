"""The synthetic task generators: format, answer masks, determinism, independent seeds and splits."""

import pytest
import torch

from hybrid_attention.synth.tasks import FIRST_SYMBOL, IGNORE, PAD, POP, PUSH, SEP, TASKS, Task, answer_accuracy


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("seq_len", [17, 40])
def test_shapes_vocab_and_masks(name, seq_len):
    task = Task(name, seq_len, num_symbols=9)
    x, y = task.batch(5, seed=3, step=7)
    assert x.shape == y.shape == (5, seq_len) and x.dtype == y.dtype == torch.long
    assert 0 <= int(x.min()) and int(x.max()) < task.vocab_size
    answers = y != IGNORE
    assert answers.any(dim=1).all()
    assert torch.equal(y[answers], x[answers])  # the label of an answer is the token there
    assert not answers[:, 0].any()  # the first token is never predicted


def test_palindrome_reverses_after_the_separator():
    x, y = Task("palindrome", 21, num_symbols=50).batch(4, seed=0, step=1)
    n = 10
    assert (x[:, n] == SEP).all()
    assert torch.equal(x[:, n + 1 :], x[:, :n].flip(1))
    assert (y[:, : n + 1] == IGNORE).all() and (y[:, n + 1 :] != IGNORE).all()


@pytest.mark.parametrize("seq_len, queries, pairs", [(64, None, None), (37, 4, None), (32, 1, None), (61, None, 13),
                                                     (40, 3, 17), (96, 3, 3)])  # fmt: skip
def test_mqar_answers_are_the_queried_values(seq_len, queries, pairs):
    task = Task("mqar", seq_len, num_symbols=20, queries=queries, pairs=pairs)
    P, Q = task.num_pairs, task.num_queries
    assert P == (seq_len // 8 if pairs is None else pairs)
    assert Q == (P // 2 if queries is None else queries)
    x, y = task.batch(6, seed=1, step=2)
    for row, labels in zip(x.tolist(), y.tolist(), strict=True):
        pairs = dict(zip(row[0 : 2 * P : 2], row[1 : 2 * P : 2], strict=True))
        assert len(pairs) == P  # distinct keys
        assert all(k < FIRST_SYMBOL + task.num_keys <= v for k, v in pairs.items())  # disjoint ranges
        answers = [t for t, label in enumerate(labels) if label != IGNORE]
        assert len(answers) == Q and min(answers) > 2 * P
        assert len({row[t - 1] for t in answers}) == Q  # a subset of distinct keys
        for t in answers:
            assert row[t] == pairs[row[t - 1]]
        rest = set(range(2 * P, len(row))) - set(answers) - {t - 1 for t in answers}
        assert all(row[t] == PAD for t in rest)


def test_stack_pops_the_top():
    x, y = Task("stack", 50, num_symbols=7).batch(8, seed=2, step=0)
    for row, labels in zip(x.tolist(), y.tolist(), strict=True):
        stack, pops = [], 0
        for i in range(0, 50, 2):
            op, value = row[i], row[i + 1]
            assert op in (PUSH, POP) and labels[i] == IGNORE
            if op == PUSH:
                stack.append(value)
                assert labels[i + 1] == IGNORE
            else:
                assert stack and value == stack.pop() and labels[i + 1] == value
                pops += 1
        assert pops > 0


@pytest.mark.parametrize("name", TASKS)
def test_deterministic_and_streams_differ(name):
    task = Task(name, 33, num_symbols=11)
    a = task.batch(4, seed=5, step=9)
    b = task.batch(4, seed=5, step=9)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    others = [
        task.batch(4, seed=6, step=9),
        task.batch(4, seed=5, step=10),
        task.batch(4, seed=5, step=9, split="eval"),
    ]
    for other in others:
        assert not torch.equal(a[0], other[0])


def test_answer_accuracy_counts_answers_only():
    x, y = Task("palindrome", 9, num_symbols=5).batch(3, seed=0, step=0)
    logits = torch.full((3, 9, 20), -1.0)
    logits[:, :-1].scatter_(-1, x[:, 1:, None], 1.0)  # a perfect next-token predictor
    assert answer_accuracy(logits, y) == (12, 12)
    logits[0, 4, :] = 0.0
    logits[0, 4, 0] = 5.0  # a wrong answer at the first reversed position of row 0
    assert answer_accuracy(logits, y) == (11, 12)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="unknown synthetic task"):
        Task("copy", 32)
    with pytest.raises(ValueError, match="seq_len"):
        Task("mqar", 4)
    with pytest.raises(ValueError, match="queries applies to mqar only"):
        Task("stack", 32, queries=2)
    for queries in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match=r"queries must be an integer in \[1, 4\]"):
            Task("mqar", 32, queries=queries)
    with pytest.raises(ValueError, match="pairs applies to mqar only"):
        Task("palindrome", 32, pairs=4)
    for pairs in (1, 16, 4.0, True):
        with pytest.raises(ValueError, match=r"pairs must be an integer in \[2, 15\]"):
            Task("mqar", 32, pairs=pairs)
    with pytest.raises(ValueError, match="14 pairs leave 2 query slots, fewer than the 7 queries"):
        Task("mqar", 32, pairs=14)
    with pytest.raises(ValueError, match=r"queries must be an integer in \[1, 3\]"):  # 3 slots after 13 pairs
        Task("mqar", 32, pairs=13, queries=4)
    with pytest.raises(ValueError, match="split"):
        Task("mqar", 32).batch(1, seed=0, step=0, split="test")
