"""The streaming loader (hybrid_attention/data/loader.py): a permutation of windows per epoch, batches that are a
function of (seed, step, micro-batch, rank), exact across a resume and across world sizes (2 processes, gloo)."""

from __future__ import annotations

import datetime
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hybrid_attention.data.loader import TrainLoader, WindowOrder, cu_seqlens_of_rows, eval_starts, permute
from hybrid_attention.data.shards import open_split, read_index, write_index, write_shard
from tests.helpers import FORKSERVER_PRELOAD


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A training split of 3 shards, 20011 tokens (ids = position mod 60000) in documents of 1 to 90 tokens."""
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 90, 450)
    lengths = lengths[np.cumsum(lengths) <= 20011]
    lengths = np.append(lengths, 20011 - lengths.sum())
    ids = np.arange(20011) % 60000
    cut = [0, 150, 300, len(lengths)]
    entries, at = [], 0
    for i in range(3):
        part = lengths[cut[i] : cut[i + 1]]
        entries.append(
            write_shard(root / f"train-{i}.safetensors", ids[at : at + part.sum()], part, np.dtype("uint16"))
        )
        at += part.sum()
    empty = {"shards": []}
    write_index(
        root,
        {"tokenizer": {}, "source": "t", "dtype": "uint16", "splits": {"train": {"shards": entries}, "val": empty}},
    )
    return open_split(root, read_index(root), "train")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4099])
def test_permute_is_a_permutation_that_depends_on_its_key(n):
    p = permute(np.arange(n), n, key=7)
    assert sorted(p.tolist()) == list(range(n))
    if n >= 16:
        assert not np.array_equal(p, permute(np.arange(n), n, key=8)) and not np.array_equal(p, np.arange(n))


def test_each_epoch_reads_every_window_once():
    order = WindowOrder(num_tokens=1000, seq_len=64, seed=3)  # 15 windows, 40 tokens to spare
    first, second = order.starts(np.arange(15)), order.starts(np.arange(15, 30))
    for starts in (first, second):
        assert len(set(((starts - starts.min()) // 64).tolist())) == 15  # 15 distinct, non-overlapping windows
        assert (starts - starts[0]) % 64 == pytest.approx(0) and starts.max() + 64 <= 1000
    assert not np.array_equal(first, second)
    with pytest.raises(ValueError, match="fewer than one window of --seq-len 64"):
        WindowOrder(num_tokens=63, seq_len=64, seed=0)


def test_a_batch_is_a_function_of_its_step_and_a_resume_continues_it(split):
    kw = dict(batch_size=4, seq_len=50, grad_accum=2, seed=5, documents=True)
    straight = TrainLoader(split, **kw)
    got = [straight.next(step) for step in range(1, 8)]
    straight.close()
    resumed = TrainLoader(split, **kw)  # a resume at step 5: the same batches from there on
    for step in range(5, 8):
        b = resumed.next(step)
        assert b.step == step and torch.equal(b.ids, got[step - 1].ids)
        pairs = zip(b.doc_starts, got[step - 1].doc_starts, strict=True)
        assert all(np.array_equal(x, y) for m, n in pairs for x, y in zip(m, n, strict=True))
    resumed.close()
    assert not torch.equal(got[0].ids, got[1].ids)
    other = TrainLoader(split, **{**kw, "seed": 6})
    assert not torch.equal(other.batch(1).ids, got[0].ids)
    # The windows hold the split's tokens (ids are positions), and the document starts are the split's.
    b = got[2]
    for row in b.ids.flatten(0, 1):
        assert torch.equal(row, (row[0] + torch.arange(50)) % 60000)
    start = int(b.ids[0, 0, 0])
    assert np.array_equal(b.doc_starts[0][0], split.document_starts(start, 50))


def test_ranks_read_disjoint_rows_of_one_global_batch(split):
    whole = TrainLoader(split, batch_size=6, seq_len=40, grad_accum=2, seed=1).batch(9).ids
    for world in (2, 3):
        parts = [
            TrainLoader(split, batch_size=6, seq_len=40, grad_accum=2, seed=1, rank=r, world=world).batch(9).ids
            for r in range(world)
        ]
        assert torch.equal(torch.cat(parts, dim=1), whole)
    with pytest.raises(ValueError, match="multiple of the 4 processes"):
        TrainLoader(split, batch_size=6, seq_len=40, grad_accum=1, seed=1, world=4)


def test_an_error_in_the_thread_reaches_the_caller(split):
    loader = TrainLoader(split, batch_size=2, seq_len=40, grad_accum=1, seed=0)
    loader.split = None  # the thread's next read fails
    with pytest.raises(AttributeError):
        loader.next(1)


def test_packed_rows_and_eval_windows():
    cu = cu_seqlens_of_rows([np.array([3, 7]), np.array([], dtype=np.int64)], 10)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 7, 10, 20]
    assert eval_starts(100, 2, 30, None).tolist() == [0, 30, 60]
    assert eval_starts(100, 2, 30, 2).tolist() == [0, 23, 47, 70]


# -------------------------------------------------------------------------------------------- across world sizes
def _rank(rank: int, world: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    split = open_split(root, read_index(root), "train")
    loader = TrainLoader(split, batch_size=4, seq_len=32, grad_accum=2, seed=9, rank=rank, world=world)
    mine = torch.stack([loader.next(step).ids for step in range(1, 6)])  # [steps, accum, 2, T]
    loader.close()
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        torch.save(torch.cat(gathered, dim=2), out)
    dist.destroy_process_group()


def test_two_gloo_processes_read_the_single_process_batches(split, tmp_path):
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch has no gloo backend")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "gathered.pt"
    ctx = mp.get_context("forkserver")  # torch imported once, in the server (tests/helpers.py)
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(split.root), str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    single = TrainLoader(split, batch_size=4, seq_len=32, grad_accum=2, seed=9)
    assert torch.equal(torch.load(out), torch.stack([single.batch(step).ids for step in range(1, 6)]))
