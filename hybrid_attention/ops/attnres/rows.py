"""What the AttnRes training kernels share: the pointer tables that let one kernel read a list of separate source
tensors, the compute dtype, the grid of the row-looping backward kernels and the autotuning of their launch shapes.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

from hybrid_attention.ops.numerics import HALF_DTYPES
from hybrid_attention.ops.triton_support import interpreting, next_power_of_2, triton_available, triton_runs_on

try:
    import triton
    import triton.language as tl

    from hybrid_attention.ops.triton_cache import AUTOTUNE_OPTIONS, register_tuner
except ImportError:  # the reference path still works
    triton = None

MAX_ROW = 16384  # widest D held in registers: every training kernel keeps whole rows (our models use 1024)
MAX_TILE = 8192  # most elements of one [BLOCK_S, BLOCK_D] source tile a tuned config may hold
TABLE_CACHE = 1024  # pointer tables kept: a training step asks for the same ones every step


def fused_train_supported(x: torch.Tensor) -> bool:
    """The training kernels can take sources like `x` [..., D]: triton installed, CUDA (or CPU under the
    interpreter, where float64 works too, for tests), a supported dtype and D <= MAX_ROW."""
    if x.shape[-1] > MAX_ROW:
        return False
    if x.dtype == torch.float64:
        return triton_available() and x.device.type == "cpu" and interpreting()
    return triton_runs_on(x)


def check_sources(name: str, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The sources as a list of contiguous tensors, after checking that they are one or more [..., D] tensors of one
    shape, dtype and device that the kernels can take (`fused_train_supported`)."""
    if isinstance(sources, torch.Tensor) or len(sources) == 0:
        raise ValueError(f"{name}: expected a non-empty list of [..., D] tensors, got {type(sources).__name__}")
    s0 = sources[0]
    for i, s in enumerate(sources):
        if s.shape != s0.shape or s.dtype != s0.dtype or s.device != s0.device:
            raise ValueError(
                f"{name}: every source must be {s0.dtype} {tuple(s0.shape)} on {s0.device} like source 0, got "
                f"{s.dtype} {tuple(s.shape)} on {s.device} at {i}"
            )
    if not fused_train_supported(s0):
        raise ValueError(
            f"{name}: needs triton and CUDA tensors (or CPU tensors with TRITON_INTERPRET=1) of float16, bfloat16 or "
            f"float32 (float64 under the interpreter) with D <= {MAX_ROW}; got {s0.dtype} {tuple(s0.shape)} on "
            f"{s0.device}; use the references in ops.attnres.naive"
        )
    return [s.contiguous() for s in sources]


def check_vectors(name: str, D: int, **vectors: torch.Tensor) -> None:
    for label, t in vectors.items():
        if tuple(t.shape) != (D,):
            raise ValueError(f"{name}: {label} must have shape [{D}], got {tuple(t.shape)}")


def residual_scale(dtype: torch.dtype) -> float:
    """The scale of a half-precision mixture's rounding residual kept in 8 bits, 0.0 for other dtypes (none is kept).

    h rounds to h_r with |h - h_r| < |h_r| eps (eps = 2^-7 for bf16, 2^-10 for fp16; half that when rounding to
    nearest, but Triton's interpreter truncates to bf16), so the fraction (h - h_r) / h_r times 127 / eps lies in
    [-127, 127]: an int8 that gives h back to about 2^-7 of its rounding. The backward needs the unrounded h in
    dh . h, a sum that cancels against the sources' dh . v_i (docs/math.md, "AttnRes backward")."""
    return 127.0 / torch.finfo(dtype).eps if dtype in HALF_DTYPES else 0.0


_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_built = [0]  # tables built outside a capture since the process started (`tables_built`)


class CapturedTables:
    """The pointer tables built while a CUDA graph is captured, and the pinned host memory they are copied from.

    The graph's copy reads its host slice again at every replay and its kernels read the device table, so both must
    outlive the graph: whoever owns the graph keeps this object as long as the graph. The host memory is pinned
    before the capture starts (`arena_entries` int64 values), since allocating pinned memory during a capture is not
    a stream operation and may be refused."""

    def __init__(self, arena_entries: int = 0):
        self.arena = torch.empty(arena_entries, dtype=torch.int64, pin_memory=arena_entries > 0)
        self.used = 0
        self.tables: list[tuple[torch.Tensor, torch.Tensor]] = []

    def host_slice(self, values: Sequence[int]) -> torch.Tensor:
        """Pinned host int64 [len(values)] holding `values`: a slice of the arena, or new pinned memory without
        one."""
        if not self.arena.numel():
            return torch.tensor(values, dtype=torch.int64).pin_memory()
        end = self.used + len(values)
        if end > self.arena.numel():
            raise RuntimeError(
                f"pointer tables: a CUDA graph capture needs more than the {self.arena.numel()} pinned entries "
                "set aside for it; pass a larger arena_entries to captured_tables()"
            )
        host = self.arena[self.used : end]
        host.copy_(torch.tensor(values, dtype=torch.int64))
        self.used = end
        return host


# The innermost capture's tables; the first (no arena) serves captures that nobody collects and lives for the process.
_captured: list[CapturedTables] = [CapturedTables()]


@contextlib.contextmanager
def captured_tables(arena_entries: int = 1 << 16):
    """Around a CUDA graph capture: the `CapturedTables` it yields collects every pointer table the capture builds,
    from host memory pinned here, before the capture. Keep it as long as the graph."""
    kept = CapturedTables(arena_entries)
    _captured.append(kept)
    try:
        yield kept
    finally:
        _captured.remove(kept)


def source_table(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A kernel's `table` argument for the n sources `tensors`: the one source itself when n == 1 (the kernels read it
    with DIRECT: no table to build and copy), else their `pointer_table`."""
    return tensors[0] if len(tensors) == 1 else pointer_table(tensors)


def table_alignment(tensors: Sequence[torch.Tensor]) -> int:
    """The kernels' ALIGN for a `pointer_table` of `tensors`: 16 when every tensor starts on a 16-byte boundary, else
    1. A pointer loaded from a table carries no alignment the compiler can see, so without the hint each element of
    a row is its own 2- or 4-byte load; with it (and D a multiple of 16) rows load and store as 16-byte vectors. Fresh
    allocations are aligned; a view into another tensor may not be, and then the kernels take the unhinted build."""
    return 16 if all(t.data_ptr() % 16 == 0 for t in tensors) else 1


def pointer_table(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [S] of the tensors' data pointers, on their device: a kernel reads source i of row m at `table[i] + m * D`.

    Tables are kept by their contents (device and pointers), least recently used dropped first: a training step
    allocates its activations at the same addresses every step, so after the first step no table is built and no
    copy is made. A new one goes through pinned memory without blocking the host (a pageable copy would wait for
    the device). A table only holds addresses, so one found by its contents is always the right one.

    While a CUDA graph is captured, every call builds its own table and keeps it outside the cache (`CapturedTables`):
    the copy that fills it runs only at replays, so an eager caller must never find it, and an evicted table that a
    graph reads would be freed under it.
    """
    key = (tensors[0].get_device(), *(t.data_ptr() for t in tensors))
    if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
        captured = _captured[-1]
        host = captured.host_slice(key[1:])
        table = host.to(tensors[0].device, non_blocking=True)
        captured.tables.append((host, table))
        return table
    table = _tables.get(key)
    if table is not None:
        _tables.move_to_end(key)
        return table
    table = torch.tensor(key[1:], dtype=torch.int64)
    _built[0] += 1
    if tensors[0].is_cuda:
        table = table.pin_memory().to(tensors[0].device, non_blocking=True)
    _tables[key] = table
    if len(_tables) > TABLE_CACHE:
        _tables.popitem(last=False)
    return table


def tables_built() -> int:
    """How many pointer tables `pointer_table` has built outside a CUDA graph capture (each one a host tensor and,
    on CUDA, a copy to the device). An eager training step whose activations land at the same addresses every step
    builds none after its first: a count that keeps growing means the addresses change from step to step."""
    return _built[0]


def tile_warps(elements: int) -> int:
    """4 warps up to [4, 1024] tiles (Q = 4 queries at D = 1024): more warps lower how many programs stay resident."""
    return 4 if elements <= 4096 else 8


def block_d(D: int) -> int:
    return next_power_of_2(D)


def source_bucket(S: int) -> int:
    """The autotuning key for S sources: the next power of two (a few tunings per model, not one per depth)."""
    return next_power_of_2(S)


def tuned_over_sources(configs: list[dict]):
    """triton.autotune over configs of a kernel whose tile is BLOCK_S sources by BLOCK_D (dicts with "BLOCK_S" and
    "num_warps", and any other constexprs), keyed by D and the source bucket `S_BUCKET`; a tile of more than MAX_TILE
    elements, or taller than the bucket (it would only read masked rows), is dropped at tuning time (see
    `tuned_over_configs`)."""
    return tuned_over_configs(
        configs,
        key=["D", "S_BUCKET"],
        keep=lambda config, named_args, width: (
            config.kwargs["BLOCK_S"] * width <= MAX_TILE and config.kwargs["BLOCK_S"] <= named_args["S_BUCKET"]
        ),
        tile_size=lambda config: config.kwargs["BLOCK_S"],
    )


def tuned_over_row_blocks(configs: list[dict], key: list[str]):
    """triton.autotune over configs of a kernel whose tile is BLOCK_M rows by BLOCK_D (dicts with "BLOCK_M" and
    "num_warps", and any other constexprs), keyed by `key` and the row count M (its programs loop over the rows: the
    best shape for a few rows per program is not the best for many); tiles of more than MAX_TILE elements are dropped
    at tuning time (see `tuned_over_configs`)."""
    return tuned_over_configs(
        configs,
        key=[*key, "M"],
        keep=lambda config, named_args, width: config.kwargs["BLOCK_M"] * width <= MAX_TILE,
        tile_size=lambda config: config.kwargs["BLOCK_M"],
    )


def tuned_over_configs(configs: list[dict], key: list[str], keep=None, tile_size=None):
    """triton.autotune over `configs` (dicts of the kernel's tuned constexprs plus "num_warps"), keyed by the
    arguments named in `key`. `keep(config, named_args, BLOCK_D)` prunes at tuning time; when nothing is kept, the
    config with the smallest `tile_size(config)` runs (the first without one). Only the first config runs under the
    interpreter; every one stays listed in the tuner's `all_configs`, so tests can run each alone (the kernels only
    write their outputs: a timing run needs no restore)."""
    all_configs = [
        triton.Config({k: v for k, v in c.items() if k != "num_warps"}, num_warps=c["num_warps"]) for c in configs
    ]

    def prune(configs, named_args, **kwargs):
        kept = [c for c in configs if keep is None or keep(c, named_args, kwargs["BLOCK_D"])]
        return kept or [min(configs, key=tile_size) if tile_size else configs[0]]

    def decorate(fn):
        tuner = triton.autotune(
            configs=all_configs[:1] if interpreting() else all_configs,
            key=key,
            prune_configs_by={"early_config_prune": prune},
            **AUTOTUNE_OPTIONS,
        )(fn)
        tuner.all_configs = all_configs
        return register_tuner(tuner)

    return decorate


if triton is not None:

    @triton.jit
    def row_block(m0, offs_m, offs_d, d_ok, M, D):
        """Rows m0 .. m0 + BLOCK_M - 1 of an [M, D] tensor: (their indices [BLOCK_M], which of them exist, their int64
        element offsets [BLOCK_M, BLOCK_D], the mask of those). Rows past M load zeros and store nothing."""
        rm = m0 + offs_m
        m_ok = rm < M
        return rm, m_ok, rm.to(tl.int64)[:, None] * D + offs_d[None, :], m_ok[:, None] & d_ok[None, :]

    @triton.jit
    def source_pointer(table, j, src_ty, DIRECT: tl.constexpr, ALIGN: tl.constexpr):
        """Source j's data pointer: table[j] cast to a pointer to src_ty, hinted ALIGN-byte aligned; with DIRECT,
        `table` is the one source itself."""
        if DIRECT:
            ptr = table
        else:
            ptr = tl.multiple_of(tl.load(table + j).to(tl.pointer_type(src_ty)), ALIGN)
        return ptr

    @triton.jit
    def rms_norm_bwd_rows(g, hr, rho, nw, D):
        """The backward of rows y = nw * hr * rho (rho [BLOCK_M] their reciprocal RMS) from g = dL/dy [BLOCK_M,
        BLOCK_D], in the compute dtype: (dL/dhr, the rows' shares of dL/d nw), both [BLOCK_M, BLOCK_D]."""
        a = g * nw[None, :]
        dh = rho[:, None] * a - (rho * rho * rho / D * tl.sum(a * hr, axis=1))[:, None] * hr
        return dh, g * hr * rho[:, None]
