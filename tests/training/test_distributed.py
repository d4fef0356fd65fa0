"""Distributed training on CPU: 2 processes (gloo, float32, FSDP2) against one process on the same global batch.

The processes are started with torch.multiprocessing (forkserver: torch is imported once) and run the real CLI
(`cli.main`), with the variables torchrun would set. Every launch has a deadline; a hang fails the test.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from hybrid_attention.cli import main as cli_main
from hybrid_attention.runs.checkpoint import WEIGHTS, latest_checkpoint
from tests.helpers import FORKSERVER_PRELOAD

pytestmark = [
    pytest.mark.skipif(
        tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 9),
        reason=f"FSDP2 on gloo gives wrong results before torch 2.9 (this is torch {torch.__version__})",
    ),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch has no gloo backend"),
]

# Tiny shapes: 4 steps with a checkpoint (and a validation) at steps 2 and 4. AdamW: Muon orthogonalises in bf16,
# where the ranks' float32 reduction-order noise flips roundings; its sharded step is tested on its own below.
TRAIN = ["--steps", "4", "--batch-size", "4", "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1",
         "--log-every", "1", "--data-max-bytes", "20000", "--device", "cpu", "--dist-timeout", "60"]  # fmt: skip
DEADLINE_S = 240  # per launch; a loaded 2-core machine needs a fraction of it


# ------------------------------------------------------------------------------------------------------ launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(target: str, rank: int, world: int, port: int, args: tuple, err_path: str) -> None:
    """One rank: torchrun's variables, stderr to a file, then `target(rank, *args)`'s return value as exit code."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    code = globals()[target](rank, *args)
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: the exit code is the result


def _launch(target: str, world: int, tmp: Path, *args) -> tuple[list[int], list[str]]:
    """Run `target` on `world` ranks; returns their exit codes and stderr texts. Fails the test past DEADLINE_S."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    port = _free_port()
    errs = [str(tmp / f"{target}-{world}-rank{r}.err") for r in range(world)]
    procs = [ctx.Process(target=_worker, args=(target, r, world, port, args, errs[r])) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    texts = [Path(e).read_text() if Path(e).exists() else "" for e in errs]
    assert not hung, f"ranks {hung} still ran after {DEADLINE_S} s; stderr of rank 0:\n{texts[0][-3000:]}"
    return [p.exitcode for p in procs], texts


def _cli(rank: int, argv: list[str]) -> int:
    return cli_main(argv)


def _cli_with(rank: int, argv: list[str], fault: str) -> int:
    """The CLI, with something happening to rank 1 alone while it draws the batch of step 2: `fault` "error" (say,
    its copy of the data is unreadable) or "sigint" (a Ctrl-C that reached this one process)."""
    from hybrid_attention.data.loader import TrainLoader

    real = TrainLoader.next

    def next_batch(self, step):
        if rank == 1 and step == 2 and fault == "error":
            raise ValueError("injected: rank 1 cannot read its data")
        if rank == 1 and step == 2 and fault == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, step)

    TrainLoader.next = next_batch
    return cli_main(argv)


def _units(rank: int) -> int:
    """Sharding checks on 2 ranks; an AssertionError (traceback on stderr) fails the launch."""
    import traceback

    try:
        _check_units(rank)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def _check_units(rank: int) -> None:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from hybrid_attention.config import HybridConfig
    from hybrid_attention.model import HybridLM
    from hybrid_attention.training.distributed import Parallel, shard_model
    from hybrid_attention.training.muon import GatheredMuon

    par = Parallel.from_env("cpu", timeout_s=60)
    torch.manual_seed(0)
    config = HybridConfig.from_preset("tiny", hidden_size=48, intermediate_size=80, kda_head_dim=24)
    full = HybridLM(config)
    with torch.no_grad():  # non-zero pseudo-queries, so a wrong (sharded or stale) read shows
        for p in full.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = HybridLM(config)
    model.load_state_dict(full.state_dict())
    shard_model(model, par, param_dtype=torch.bfloat16)

    # Read outside the owner's forward: every AttnRes vector, RMSNorm weight and the LM head (the chunked loss reads
    # it), from the forward of an MLP and from the backward (a hook on the final norm's output), must be the whole
    # float32 tensor with the right values.
    vectors = [n for n, _ in full.named_parameters() if n.endswith(("query", "key_norm.weight", "norm.weight"))]
    vectors = [n for n in vectors if ".mixer." not in n] + ["lm_head.weight"]  # mixer norms are mixer weights
    seen = {}

    def read(where):
        for name in vectors:
            t = model.get_parameter(name)
            seen[(where, name)] = (isinstance(t, DTensor), t.dtype, torch.equal(t.detach(), full.get_parameter(name)))

    model.layers[1].mlp.register_forward_hook(lambda *a: read("forward"))
    x = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(rank))
    dtypes = {}
    hook = model.layers[0].mixer.q_proj.register_forward_pre_hook(
        lambda *a: dtypes.update(
            A_log=model.layers[0].mixer.A_log.dtype,
            dt_bias=model.layers[0].mixer.dt_bias.dtype,
            q_proj=model.layers[0].mixer.q_proj.weight.dtype,
            mlp=model.layers[0].mlp.up_proj.weight.dtype,
        )
    )

    def on_norm_output(module, args, out):  # a tensor hook: runs in the backward
        out.register_hook(lambda grad: read("backward"))

    model.norm.register_forward_hook(on_norm_output)
    model(x, labels=x, return_logits=False).loss.backward()
    hook.remove()
    bad = {k: v for k, v in seen.items() if v != (False, torch.float32, True)}
    assert len(seen) == 2 * len(vectors) and not bad, bad
    want = dict(A_log=torch.float32, dt_bias=torch.float32, q_proj=torch.bfloat16, mlp=torch.bfloat16)
    assert dtypes == want, dtypes

    # Muon on shards: momentum on the local shard, the update gathered whole; equal to torch's Muon on the full
    # matrix given the same gradients, bit for bit.
    weight = full.layers[0].mlp.up_proj.weight  # [80, 48]: 40 rows per rank
    ref = torch.nn.Parameter(weight.detach().clone())
    sharded = torch.nn.Parameter(distribute_tensor(weight.detach().clone(), par.mesh, [Shard(0)]))
    opt_ref = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    opt = GatheredMuon([sharded], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(step))  # the same on both ranks
        ref.grad = grad
        sharded.grad = distribute_tensor(grad, par.mesh, [Shard(0)])
        opt_ref.step()
        opt.step()
    assert isinstance(sharded.data, DTensor)
    torch.testing.assert_close(sharded.full_tensor(), ref.detach(), rtol=0, atol=0)
    par.close()


def _run_cli(argv: list[str]) -> None:
    """The CLI in this process (no torchrun variables: the single-process path)."""
    assert not any(k in os.environ for k in ("RANK", "WORLD_SIZE"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    assert code == 0, err.getvalue()[-3000:]


def _log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def _assert_same_run(got: Path, want: Path, steps: list[int]) -> None:
    """Losses, gradient norms and validation losses of `steps`, then the exported weights, agree to float32
    reduction-order noise (the ranks sum their gradients in another order than one process does), as amplified by
    AdamW: it divides by sqrt(v), so where a gradient is near zero the noise moves a weight by up to a fraction of
    the learning rate (3e-3), hence an absolute bound on the weights and 1e-4 on what they produce. A wrong
    gradient, batch or average moves every weight by about the learning rate and the losses in the third digit."""
    rows = {r["step"]: r for r in _log(got)}
    ref = {r["step"]: r for r in _log(want)}
    for step in steps:
        for key in ("loss", "grad_norm", "val_loss"):
            if key in ref[step]:
                assert rows[step][key] == pytest.approx(ref[step][key], rel=1e-4), (step, key)
    a, b = (load_file(str(latest_checkpoint(run) / WEIGHTS)) for run in (got, want))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("single") / "run"
    _run_cli(["train", *TRAIN, "--out", str(out)])
    return out


# ----------------------------------------------------------------------------------------------------------- tests
def test_two_ranks_equal_one_process(reference, tmp_path):
    """FSDP2 on 2 ranks (with activation checkpointing and resharding after forward) equals one process: losses for
    4 steps, validation losses, and the final weights after `export`."""
    out = tmp_path / "run"
    argv = ["train", *TRAIN, "--out", str(out), "--activation-checkpointing", "--fsdp-reshard-after-forward"]
    codes, errs = _launch("_cli", 2, tmp_path, argv)
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4]
    assert not (latest_checkpoint(out) / WEIGHTS).exists()  # the sharded run writes DCP shards only
    sample = ["generate", "--ckpt", str(out), "--prompt", "def ", "--max-new-tokens", "2", "--device", "cpu"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli_main(sample) == 1
    assert f"gather it with `hybrid-attention export --ckpt {out}`" in err.getvalue()
    assert cli_main(["export", "--ckpt", str(out)]) == 0
    _assert_same_run(out, reference, [1, 2, 3, 4])
    _run_cli(sample)  # one process, one device, from the exported file


def test_resume_on_another_world_size(reference, tmp_path):
    """A SIGINT that reaches rank 1 alone during step 2 makes both ranks save step 2 and stop (exit 130); resumed on
    2 ranks and in one process, both continuations equal the uninterrupted run."""
    first = tmp_path / "first"
    codes, errs = _launch("_cli_with", 2, tmp_path, ["train", *TRAIN, "--out", str(first)], "sigint")
    assert codes == [130, 130], errs[0][-3000:] + errs[1][-3000:]
    assert latest_checkpoint(first).name == "step_00000002"
    assert [r["step"] for r in _log(first)] == [1, 2]
    on_two, on_one = tmp_path / "on_two", tmp_path / "on_one"
    shutil.copytree(first, on_two)
    shutil.copytree(first, on_one)
    codes, errs = _launch("_cli", 2, tmp_path, ["train", "--resume", "--out", str(on_two)])
    assert codes == [0, 0], errs[0][-3000:]
    assert cli_main(["export", "--ckpt", str(on_two)]) == 0
    _assert_same_run(on_two, reference, [1, 2, 3, 4])
    _run_cli(["train", "--resume", "--out", str(on_one)])
    _assert_same_run(on_one, reference, [1, 2, 3, 4])


def test_sharding_units(tmp_path):
    """Under a bf16 policy, A_log / dt_bias stay float32 and the matrices are bf16; AttnRes pseudo-queries, key
    norms and RMSNorm weights read outside their module's forward (in another module's forward, in the backward)
    are whole and exact; the sharded Muon step equals torch's Muon on the full matrix."""
    codes, errs = _launch("_units", 2, tmp_path)
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]


def test_failing_rank_stops_every_rank(tmp_path):
    """An error on rank 1 ends both ranks non-zero, each with rank 1's one-line error, well within the timeout."""
    start = time.monotonic()
    codes, errs = _launch("_cli_with", 2, tmp_path, ["train", *TRAIN, "--out", str(tmp_path / "run")], "error")
    assert time.monotonic() - start < DEADLINE_S
    assert codes == [1, 1], errs
    want = "hybrid-attention train: error: rank 1 failed: injected: rank 1 cannot read its data"
    for rank, text in enumerate(errs):  # the line may follow rank 0's unfinished progress bar on its line
        lines = re.findall(r"hybrid-attention train: error: .*", text)
        assert lines == [want], f"rank {rank}:\n{text[-3000:]}"
