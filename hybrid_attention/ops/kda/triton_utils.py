"""Shared pieces of the Triton KDA kernels: tile loads and stores, the gate, the 16x16 inverse, the sub-chunk anchors
and the chunk layout (docs/kernels.md, "Numerics").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_attention.ops.triton_support import interpreting

CHUNK = 64
MAX_DIM = 256
MAX_TILE_SPAN = 2**31  # a tile's int32 offsets: CHUNK rows of H * MAX_DIM elements must stay below this
LOG2E = tl.constexpr(1.4426950408889634)
SHIFT = tl.constexpr(58.0)  # centres the anchored factors: 2^(+-58) for spans up to WIDE
# Decays below 2^-48 per step are taken as 2^-48: anything across such a step is then below 2^-48 of what it
# would be undecayed, under float32 resolution either way, and the cumulative gate stays small enough to keep its
# float32 rounding small (a step of -1000 would put every later G of the chunk near -1443).
STEP_FLOOR = tl.constexpr(-48.0)
WIDE = tl.constexpr(116.0)  # the largest in-sub-chunk span (log2) the anchored dots take; g >= -5 stays below it
# A bounded gate with lower_bound >= NARROW_BOUND keeps every step at or above it: 16 steps span at most
# 16 * 5 * log2(e) < WIDE, so no row is wide and the kernels are compiled without the pair-by-pair path.
NARROW_BOUND = -5.0
L2_EPS = tl.constexpr(1e-6)  # x / sqrt(sum x^2 + eps), as FLA's in-kernel l2norm
# Fixed when triton is imported, as the interpreter itself is: selects the plain-Python fallback of inline PTX.
INTERPRET = tl.constexpr(interpreting())


def empty(like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every buffer of these kernels comes from here, through `torch.empty` looked up at call time, so a test can
    poison them all (monkeypatch torch.empty to fill NaN) and catch any element a kernel forgets to write."""
    return torch.empty(shape, device=like.device, dtype=like.dtype if dtype is None else dtype)


def tuning_width(pairs: int) -> int:
    """The number of (sequence, head) pairs a sequential state pass runs in parallel, as an autotuning key: a power
    of two, capped at 512 (beyond it every config fills the GPU), so that a long single sequence and a large
    batch tune apart without a re-tune for every batch size."""
    return min(512, triton.next_power_of_2(max(1, pairs)))


def narrow_span(gate: int, lower_bound: float) -> bool:
    """Whether the fused gate itself bounds every sub-chunk's span below WIDE (the kernels' NARROW flag): the
    bounded gate (GATE 1) with lower_bound >= NARROW_BOUND. A precomputed g or the softplus gate may be wider."""
    return gate == 1 and lower_bound >= NARROW_BOUND


def dot_setup(dtype: torch.dtype) -> tuple[str, bool, bool]:
    """(PREC, EMU, A32) for kernels whose io dtype is `dtype`.

    PREC: precision of float32 x float32 dots: "ieee" for float32 inputs (real float32 accuracy), "tf32" else.
    EMU: the interpreter mis-multiplies bfloat16 dots, so there they run as float32 dots of bf16-rounded values.
    A32: the anchored score dots (factors up to 2^58) run on float32 operands: float16 cannot hold the factors.
    """
    prec = "ieee" if dtype == torch.float32 else "tf32"
    return prec, interpreting() and dtype == torch.bfloat16, dtype == torch.float16


@triton.jit
def _tf32(x):
    """x rounded to tf32 (10 mantissa bits, to nearest, ties away from zero); NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)


@triton.jit
def dot_operand(x, DT: tl.constexpr, PREC: tl.constexpr):
    """x as the dot of `mm(..., DT, PREC)` multiplies it (rounded to DT, or to tf32), in float32: for sums that
    must cancel exactly against that dot's own products."""
    if DT == tl.float32:
        if PREC == "tf32":
            return _tf32(x)
        else:
            return x
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def mm(a, b, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """a @ b with both operands cast to DT (the io dtype, or float32), float32 accumulation."""
    if EMU:
        return tl.dot(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), input_precision="ieee")
    elif DT == tl.float32 and PREC == "tf32":
        return tf32_dot(a, b)
    else:
        return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def tf32_dot(a, b):
    """a @ b on tf32 operands rounded to nearest. NVIDIA's tensor cores truncate float32 operands to tf32, which
    biases the products; rounding first makes them the products `dot_operand` describes, on any GPU and under the
    interpreter (which multiplies float32 operands exactly)."""
    return tl.dot(_tf32(a.to(tl.float32)), _tf32(b.to(tl.float32)), input_precision="tf32")


@triton.jit
def mm32(a, b, PREC: tl.constexpr):
    """a @ b on float32 operands (small float32 block products such as the inverse merges)."""
    if PREC == "tf32":
        return tf32_dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _row_base(ptr, row0, stride):
    """ptr advanced to row row0 of rows of `stride` elements: the only offset that grows with the tokens, formed once
    in int64. A tile's own offsets (under 64 rows of at most H * 256 elements; `MAX_TILE_SPAN`) then stay int32, one
    32-bit multiply-add per element instead of a 64-bit one."""
    return ptr + (row0 + tl.zeros([], dtype=tl.int64)) * stride


@triton.jit
def load_tile(ptr, row0, nrows, stride, col0, ncols, R: tl.constexpr, C: tl.constexpr):
    """Rows row0 + [0, R) (valid below nrows) and columns col0 + [0, C) (valid below ncols) as float32."""
    r = tl.arange(0, R)
    c = col0 + tl.arange(0, C)
    mask = (r < nrows)[:, None] & (c < ncols)[None, :]
    offs = r[:, None] * stride + c[None, :]
    return tl.load(_row_base(ptr, row0, stride) + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_raw(ptr, row0, nrows, stride, col0, ncols, R: tl.constexpr, C: tl.constexpr):
    """As load_tile, in the stored dtype (operands that go straight into a dot)."""
    r = tl.arange(0, R)
    c = col0 + tl.arange(0, C)
    mask = (r < nrows)[:, None] & (c < ncols)[None, :]
    offs = r[:, None] * stride + c[None, :]
    return tl.load(_row_base(ptr, row0, stride) + offs, mask=mask, other=0.0)


@triton.jit
def load_lower(ptr, row0, nrows, VECTOR: tl.constexpr = True):
    """A chunk's [64, 64] block-lower matrix (Aqk, Akk, T, dAqk, dAkk) from its [rows, 64] storage, in the stored
    dtype; upper 16x16 blocks, which are never written, read as zero, and so do columns past the valid rows.

    VECTOR: the load's mask is constant over each 16-column block, so the compiler loads 16-byte vectors (not one
    2-byte load per element), and the columns past the valid rows, which rows below nrows store, are zeroed after the
    load; it holds more registers while the select runs (the prep kernel, at its register limit, takes the
    elementwise load)."""
    r = tl.arange(0, 64)
    rows_ok = (r < nrows)[:, None]
    offs = r[:, None] * 64 + r[None, :]
    if VECTOR:
        x = tl.load(
            _row_base(ptr, row0, 64) + offs, mask=((r[None, :] // 16) <= (r[:, None] // 16)) & rows_ok, other=0.0
        )
        return tl.where((r < nrows)[None, :], x, tl.zeros_like(x))
    mask = ((r[None, :] // 16) <= (r[:, None] // 16)) & rows_ok & (r < nrows)[None, :]
    return tl.load(_row_base(ptr, row0, 64) + offs, mask=mask, other=0.0)


@triton.jit
def store_lower(ptr, x, row0, nrows):
    """The block-lower part of a chunk's [64, 64] matrix x (the blocks load_lower reads) into its [rows, 64] storage,
    rows below nrows."""
    r = tl.arange(0, 64)
    mask = ((r[None, :] // 16) <= (r[:, None] // 16)) & (r < nrows)[:, None]
    offs = r[:, None] * 64 + r[None, :]
    tl.store(_row_base(ptr, row0, 64) + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_tile(ptr, x, row0, nrows, stride, col0, ncols, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    c = col0 + tl.arange(0, C)
    mask = (r < nrows)[:, None] & (c < ncols)[None, :]
    offs = r[:, None] * stride + c[None, :]
    tl.store(_row_base(ptr, row0, stride) + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_rows(ptr, row0, nrows, stride, R: tl.constexpr):
    """One value per row (beta, rstd): [R] float32, zero past nrows."""
    r = tl.arange(0, R)
    return tl.load(_row_base(ptr, row0, stride) + r * stride, mask=r < nrows, other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, x, row0, nrows, stride, R: tl.constexpr):
    """One value per row ([R], as load_rows reads them) into rows row0 + [0, R) below nrows."""
    r = tl.arange(0, R)
    tl.store(_row_base(ptr, row0, stride) + r * stride, x.to(ptr.dtype.element_ty), mask=r < nrows)


@triton.jit
def rows_or_one(ptr, row0, nrows, H, L2NORM: tl.constexpr):
    """1 / ||x|| per row with the fused l2norm, else ones ([64] float32)."""
    if L2NORM:
        return load_rows(ptr, row0, nrows, H, 64)
    else:
        return tl.full([64], 1.0, dtype=tl.float32)


@triton.jit
def fast_rcp(x):
    """1 / x for float32 by rcp.approx.ftz (within 1 ulp). Plain division lowers to div.full.f32, whose range checks
    cost about six instructions per element (with this and the ex2 sigmoid below, the prep kernel compiles to 9%
    fewer instructions)."""
    if INTERPRET:  # the interpreter runs no PTX
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def floor_step(g2):
    """A log2 decay raised to STEP_FLOOR where it is lower (NaN stays NaN: a comparison, not tl.maximum)."""
    return tl.where(g2 < STEP_FLOOR, STEP_FLOOR, g2)


@triton.jit
def gate_parts(
    g,
    a_log,
    dt_bias,
    h,
    lower_bound,
    row0,
    nrows,
    stride,
    col0,
    K,
    GATE: tl.constexpr,
    NARROW: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
):
    """(log2 decay, d g / d u, d g / d A_log) of a tile, u = z + dt_bias (the last two for GATE only). Steps are
    raised to STEP_FLOOR, except with NARROW (`narrow_span`), where every step is at least lower_bound, far above it.

    GATE 0: g holds the decay. GATE 1, bounded: g = lower_bound * sigmoid(exp(A_log) u). GATE 2, softplus:
    g = -exp(A_log) softplus(u). Both from one ex2 per element (sigmoid(x) = 1 / (1 + 2^(-x log2 e)) with a fast
    reciprocal; softplus(u) = log(1 + e^u), u itself above 20 as torch's softplus): tl.sigmoid's exp and division
    expand to about twenty instructions."""
    x = load_tile(g, row0, nrows, stride, col0, K, R, C)
    if GATE == 0:
        return floor_step(x * LOG2E), x, x
    else:
        r = tl.arange(0, R)
        c = col0 + tl.arange(0, C)
        valid = (r < nrows)[:, None] & (c < K)[None, :]
        bias = tl.load(dt_bias + h * K + c, mask=c < K, other=0.0).to(tl.float32)
        rate = tl.exp(tl.load(a_log + h).to(tl.float32))
        u = x + bias[None, :]
        if GATE == 1:
            xx = rate * u
            s = fast_rcp(1.0 + tl.exp2(u * (-rate * LOG2E)))
            ds = lower_bound * s * (1.0 - s)  # d g / d x
            g2 = tl.where(valid, (lower_bound * LOG2E) * s, 0.0)
            if not NARROW:
                g2 = floor_step(g2)
            return g2, ds * rate, ds * xx
        else:
            e = tl.exp2(tl.minimum(u, 20.0) * LOG2E)
            sp2 = tl.where(u > 20.0, u * LOG2E, tl.log2(1.0 + e))  # softplus(u) in log2 units
            s = e * fast_rcp(1.0 + e)  # sigmoid(u), the derivative of softplus
            g2 = tl.where(valid, -rate * sp2, 0.0)
            return floor_step(g2), -rate * tl.where(u > 20.0, 1.0, s), g2 * (1.0 / LOG2E)


@triton.jit
def load_gate(
    g,
    a_log,
    dt_bias,
    h,
    lower_bound,
    row0,
    nrows,
    stride,
    col0,
    K,
    GATE: tl.constexpr,
    NARROW: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
):
    """The log2 decay of a [R, C] tile; with GATE, g holds raw logits z and the gate is applied here (gate_parts).
    Zero outside the valid rows and columns."""
    decay, _, _ = gate_parts(g, a_log, dt_bias, h, lower_bound, row0, nrows, stride, col0, K, GATE, NARROW, R, C)
    return decay


@triton.jit
def row_of(x, i):
    """Row i of a [64, C] tile as a [C] vector; zeros for an i outside [0, 64) (the anchor before sub-chunk 0)."""
    return tl.sum(tl.where((tl.arange(0, 64) == i)[:, None], x, 0.0), 0)


@triton.jit
def fitting_prefix(G):
    """f, the end of the chunk prefix that can share the chunk's start as its anchor: the first row of a [64, C]
    cumulative gate whose span from the start, -G_t, exceeds WIDE on some channel, or whose G is not finite or above
    0 (64 when every row fits). It depends on the rows up to it only."""
    fits = tl.min(((G >= -WIDE) & (G <= 0.0)).to(tl.int32), 1) > 0
    return first_bad_row(fits, 0, 64)


@triton.jit
def anchor_factors(G, rows, cols, ca):
    """The anchored factors of the pairs (t, i), t in `rows`, i in `cols` ([64] masks), for the anchor ca ([1, C]):
    row factor 2^(G_t - ca + SHIFT) and column factor 2^(ca - SHIFT - G_i), whose product is exactly 2^(G_t - G_i),
    both [64, C]. Outside the masks the exponent is -inf (a factor of 0). The column exponent is clamped at SHIFT,
    so no factor is inf (a zero row factor times inf would put a NaN outside the masks); the clamp bites only for
    pairs of rows wider than WIDE, which the kernels take pair by pair."""
    rowf = tl.exp2(tl.where(rows[:, None], G - ca + SHIFT, float("-inf")))
    colf = tl.exp2(tl.where(cols[:, None], tl.minimum(ca - SHIFT - G, SHIFT), float("-inf")))
    return rowf, colf


@triton.jit
def finite(x):
    """|x| < inf: false for NaN and +-inf (an unordered comparison is false)."""
    return tl.abs(x) < float("inf")


@triton.jit
def all_finite(x):
    """Per row of a 2-D tile: every element finite (no NaN, no inf)."""
    return tl.min(finite(x).to(tl.int32), 1) > 0


@triton.jit
def first_bad_row(ok, row0, R: tl.constexpr):
    """The smallest row0 + r with ok[r] false, or 64 (past the chunk) when there is none."""
    return tl.min(tl.where(ok, 64, row0 + tl.arange(0, R)), 0)


@triton.jit
def state_slice(iv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """(offsets, mask) of V tile iv of a row-major [K, V] state: every row (BK >= K), columns iv * BV + [0, BV)."""
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    return rk[:, None] * V + rv[None, :], (rk < K)[:, None] & (rv < V)[None, :]


@triton.jit
def load_state(
    ptr, idx, offs, mask, HAS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr
):
    """Slice `offs` of state idx of a [*, K, V] float32 buffer, or zeros when there is none (HAS false)."""
    if HAS:
        return tl.load(ptr + idx.to(tl.int64) * K * V + offs, mask=mask, other=0.0)
    else:
        return tl.zeros([BK, BV], dtype=tl.float32)


@triton.jit
def store_state(ptr, idx, x, offs, mask, K: tl.constexpr, V: tl.constexpr):
    """Write slice `offs` of state idx of a [*, K, V] buffer (in the buffer's dtype)."""
    tl.store(ptr + idx.to(tl.int64) * K * V + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def chunk_decay(glast, cj, h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Gam, the log2 decay of chunk cj for head h over the whole chunk: [BK] float32 (zero past K)."""
    rk = tl.arange(0, BK)
    return tl.load(glast + (cj * H + h).to(tl.int64) * K + rk, mask=rk < K, other=0.0)


@triton.jit
def chunk_info(c, cu, chunk_seq, chunk_tok, T, NT, VARLEN: tl.constexpr):
    """(sequence, first token, end of sequence) of chunk c; sequence -1 marks a spare grid slot (varlen)."""
    if VARLEN:
        seq = tl.load(chunk_seq + c)
        t0 = tl.load(chunk_tok + c)
        eos = tl.load(cu + tl.maximum(seq, 0) + 1)
    else:
        seq = c // NT
        t0 = seq * T + (c % NT) * 64
        eos = seq * T + T
    return seq, t0, eos


@triton.jit
def seq_info(n, cu, chunk_off, T, NT, VARLEN: tl.constexpr):
    """(first token, end, index of the first chunk) of sequence n."""
    if VARLEN:
        bos = tl.load(cu + n)
        eos = tl.load(cu + n + 1)
        c0 = tl.load(chunk_off + n)
    else:
        bos = n * T
        eos = bos + T
        c0 = n * NT
    return bos, eos, c0


@triton.jit
def _lower_row(ptr, i, a: tl.constexpr, bcast):
    """Row i of diagonal block a of a chunk's [64, 64] scratch, broadcast so that element [j, c] holds L_a[i, j]."""
    return tl.load(ptr + (16 * a + i) * 64 + 16 * a + bcast)


@triton.jit
def inv_unit_lower4(ptr):
    """(I + L_a)^{-1} for the four strictly lower [16, 16] float32 diagonal blocks L_a of a [64, 64] row-major
    scratch at ptr (block a in rows and columns 16a..16a+15, every row written), by forward substitution.

    Row i of X = (I + L)^{-1} is e_i - L[i, :] X: rows j < i are final and L[i, j >= i] = 0, so the whole
    current X can be used. Row i of L is read back from memory already broadcast to X's layout, so a step costs
    one cross-thread reduction (extracting the row from registers would cost a second one). The four blocks are
    independent chains, interleaved for parallelism.
    """
    r = tl.arange(0, 16)
    bcast = r[:, None] + 0 * r[None, :]
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    X0 = eye
    X1 = eye
    X2 = eye
    X3 = eye
    for i in range(1, 16):
        sel = r[:, None] == i
        X0 = tl.where(sel, X0 - tl.sum(_lower_row(ptr, i, 0, bcast) * X0, 0)[None, :], X0)
        X1 = tl.where(sel, X1 - tl.sum(_lower_row(ptr, i, 1, bcast) * X1, 0)[None, :], X1)
        X2 = tl.where(sel, X2 - tl.sum(_lower_row(ptr, i, 2, bcast) * X2, 0)[None, :], X2)
        X3 = tl.where(sel, X3 - tl.sum(_lower_row(ptr, i, 3, bcast) * X3, 0)[None, :], X3)
    return X0, X1, X2, X3


class ChunkLayout:
    """Where the chunks of a (possibly packed) batch lie; built on the device without a host sync.

    Attributes: n_seq (N), n_chunks (grid size of the per-chunk kernels; varlen uses the upper bound
    T_total // 64 + N, spare slots get sequence -1), varlen, T (length of every sequence when not varlen),
    nt (chunks per sequence when not varlen), and the int32 tensors cu [N + 1], chunk_seq / chunk_tok
    [n_chunks] (sequence and first token of each chunk) and chunk_off [N] (index of each sequence's first chunk).
    """

    def __init__(self, B: int, T: int, device: torch.device, cu_seqlens: torch.Tensor | None):
        self.varlen = cu_seqlens is not None
        if not self.varlen:
            self.n_seq, self.T, self.nt = B, T, triton.cdiv(T, CHUNK)
            self.n_chunks = self.count(B, T, B, False)
            dummy = torch.empty(1, dtype=torch.int32, device=device)  # never read: the kernels compute the layout
            self.cu = self.chunk_seq = self.chunk_tok = self.chunk_off = dummy
            return
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        self.n_seq, self.T, self.nt = cu.shape[0] - 1, 0, 0
        self.n_chunks = self.count(B, T, self.n_seq, True)
        nch = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK  # chunks per sequence
        ends = torch.cumsum(nch, 0)
        off = ends - nch
        c = torch.arange(self.n_chunks, device=device, dtype=torch.int32)
        seq = torch.searchsorted(ends, c, right=True)  # first sequence whose chunks end after c
        seq_c = seq.clamp(max=self.n_seq - 1)
        self.cu = cu
        self.chunk_off = off.to(torch.int32)
        self.chunk_seq = torch.where(c < ends[-1], seq_c, -1).to(torch.int32)
        self.chunk_tok = (cu[seq_c] + CHUNK * (c - off[seq_c])).to(torch.int32)

    @staticmethod
    def count(B: int, T: int, n_seq: int, varlen: bool) -> int:
        """Grid size of the per-chunk kernels (and rows of the per-chunk buffers), from shapes alone."""
        return T // CHUNK + n_seq if varlen else B * triton.cdiv(T, CHUNK)

    def args(self) -> tuple:
        return self.cu, self.chunk_seq, self.chunk_tok, self.chunk_off, self.T, max(self.nt, 1)
