"""Synthetic recall tasks (the Kimi Linear report's synthetic tests): Palindrome, MQAR and Stack, each batch a pure
function of (seed, step); docs/fidelity.md, "The synthetic suite".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybrid_attention.checks import is_int

PAD, SEP, PUSH, POP = 0, 1, 2, 3
FIRST_SYMBOL = 4
IGNORE = -100
TASKS = ("palindrome", "mqar", "stack")
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Task:
    """One task at one sequence length. `num_symbols`: the alphabet of the random content (values). MQAR only:
    `queries`, the keys queried per sequence (None: half of the pairs); `pairs`, the key-value pairs per sequence
    (None: seq_len // 8)."""

    name: str
    seq_len: int
    num_symbols: int = 64
    queries: int | None = None
    pairs: int | None = None

    def __post_init__(self):
        if self.name not in TASKS:
            raise ValueError(f"unknown synthetic task {self.name!r}; expected one of {', '.join(TASKS)}")
        minimum = {"palindrome": 3, "mqar": 8, "stack": 4}[self.name]
        if not isinstance(self.seq_len, int) or self.seq_len < minimum:
            raise ValueError(f"{self.name}: seq_len must be an integer >= {minimum}, got {self.seq_len!r}")
        if not isinstance(self.num_symbols, int) or self.num_symbols < 2:
            raise ValueError(f"{self.name}: num_symbols must be an integer >= 2, got {self.num_symbols!r}")
        for label, value in (("pairs", self.pairs), ("queries", self.queries)):
            if value is not None and self.name != "mqar":
                raise ValueError(f"{self.name}: {label} applies to mqar only, got {label}={value!r}")
        if self.pairs is not None:
            most = (self.seq_len - 2) // 2  # the pairs and at least one query
            if not is_int(self.pairs) or not 2 <= self.pairs <= most:
                raise ValueError(
                    f"mqar at seq_len {self.seq_len}: pairs must be an integer in [2, {most}], got {self.pairs!r}"
                )
        if self.queries is not None:
            # Queries ask distinct keys, one per two-token slot after the pairs.
            most = min(self.num_pairs, self.num_query_slots)
            if not is_int(self.queries) or not 1 <= self.queries <= most:
                raise ValueError(
                    f"mqar at seq_len {self.seq_len}: queries must be an integer in [1, {most}] "
                    f"(the key-value pairs, and the slots after them), got {self.queries!r}"
                )
        elif self.name == "mqar" and self.num_queries > self.num_query_slots:
            raise ValueError(
                f"mqar at seq_len {self.seq_len}: {self.num_pairs} pairs leave "
                f"{self.num_query_slots} query slots, fewer than the "
                f"{self.num_queries} queries (half the pairs); pass fewer pairs or queries"
            )

    @property
    def num_pairs(self) -> int:
        """MQAR: key-value pairs in the context (`pairs`, else a quarter of the sequence)."""
        return self.pairs if self.pairs is not None else max(2, self.seq_len // 8)

    @property
    def num_query_slots(self) -> int:
        """MQAR: the two-token slots after the pairs, where the queries go."""
        return (self.seq_len - 2 * self.num_pairs) // 2

    @property
    def num_queries(self) -> int:
        """MQAR: keys queried after the context (`queries`, else half of the pairs)."""
        return self.queries if self.queries is not None else max(1, self.num_pairs // 2)

    @property
    def num_keys(self) -> int:
        """MQAR: the key alphabet; at least as large as the number of (distinct) keys in a sequence."""
        return max(self.num_symbols, self.num_pairs)

    @property
    def vocab_size(self) -> int:
        extra = self.num_keys if self.name == "mqar" else 0
        return FIRST_SYMBOL + self.num_symbols + extra

    def batch(self, batch_size: int, *, seed: int, step: int, split: str = "train") -> tuple[torch.Tensor, ...]:
        """input_ids, labels: LongTensor [batch_size, seq_len] for (seed, step, split) (labels -100 off the answers).

        split "train" or "eval": two independent streams, so evaluation batches are never trained on."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng = np.random.default_rng([seed, step, SPLITS.index(split)])
        make = {"palindrome": self._palindrome, "mqar": self._mqar, "stack": self._stack}[self.name]
        ids, answer = make(rng, batch_size)
        labels = np.where(answer, ids, IGNORE)
        return torch.from_numpy(ids).long(), torch.from_numpy(labels).long()

    def _palindrome(self, rng, B):
        T = self.seq_len
        n = (T - 1) // 2
        ids = np.full((B, T), PAD, dtype=np.int64)
        content = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + self.num_symbols, size=(B, n))
        ids[:, :n] = content
        ids[:, n] = SEP
        ids[:, n + 1 : 2 * n + 1] = content[:, ::-1]
        answer = np.zeros((B, T), dtype=bool)
        answer[:, n + 1 : 2 * n + 1] = True
        return ids, answer

    def _mqar(self, rng, B):
        T, P, Q = self.seq_len, self.num_pairs, self.num_queries
        values_from = FIRST_SYMBOL + self.num_keys
        keys = FIRST_SYMBOL + np.argsort(rng.random((B, self.num_keys)), axis=1)[:, :P]  # distinct per row
        values = rng.integers(values_from, values_from + self.num_symbols, size=(B, P))
        ids = np.full((B, T), PAD, dtype=np.int64)
        ids[:, 0 : 2 * P : 2] = keys
        ids[:, 1 : 2 * P : 2] = values
        which = np.argsort(rng.random((B, P)), axis=1)[:, :Q]  # the queried pairs, in query order
        slots = np.argsort(rng.random((B, self.num_query_slots)), axis=1)[:, :Q]  # distinct slots after the pairs
        where = np.sort(slots, axis=1)  # in increasing order
        rows = np.arange(B)[:, None]
        pos = 2 * P + 2 * where  # [B, Q] positions of the query keys
        ids[rows, pos] = np.take_along_axis(keys, which, axis=1)
        ids[rows, pos + 1] = np.take_along_axis(values, which, axis=1)
        answer = np.zeros((B, T), dtype=bool)
        answer[rows, pos + 1] = True
        return ids, answer

    def _stack(self, rng, B):
        T = self.seq_len
        ids = np.full((B, T), PAD, dtype=np.int64)
        answer = np.zeros((B, T), dtype=bool)
        coins = (rng.random((B, T // 2)) < 0.5).tolist()  # Python lists: the loop below is sequential per row
        pushed = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + self.num_symbols, size=(B, T // 2)).tolist()
        for b in range(B):
            stack, row, popped = [], [], []
            for i, (coin, x) in enumerate(zip(coins[b], pushed[b], strict=True)):
                if stack and coin:
                    row += (POP, stack.pop())
                    popped.append(2 * i + 1)
                else:
                    row += (PUSH, x)
                    stack.append(x)
            ids[b, : len(row)] = row
            answer[b, popped] = True
        return ids, answer


def answer_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(correct, counted) answers: logits [B, T, V] at position t predict labels[:, t + 1] (-100 not counted)."""
    target = labels[:, 1:]
    counted = target != IGNORE
    correct = (logits[:, :-1].argmax(-1) == target) & counted
    return int(correct.sum()), int(counted.sum())
