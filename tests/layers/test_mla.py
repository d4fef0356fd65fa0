"""Gated MLA (NoPE): prefill against an explicit per-head reference, absorbed decoding against the full forward,
the latent-only cache, causality and input checks. CPU, float64 unless a test says otherwise."""

from __future__ import annotations

import copy

import pytest
import torch

from hybrid_attention.layers.mla import GatedMLA, MLACache
from hybrid_attention.ops.mla.naive import bottom_right_causal_mask, naive_absorbed_attention
from tests.helpers import assert_close, poisoned_like

# Odd, distinct sizes so that a wrong view or split cannot line up by accident.
SIZES = dict(hidden_size=24, num_heads=3, kv_lora_rank=10, qk_nope_head_dim=5, qk_shared_head_dim=3, v_head_dim=7)


def make_layer(q_lora_rank=None, dtype=torch.float64, seed=0, **options) -> GatedMLA:
    torch.manual_seed(seed)
    layer = GatedMLA(**{**SIZES, **options}, q_lora_rank=q_lora_rank).to(dtype)
    with torch.no_grad():  # non-trivial norm weights, so that a missing or misplaced norm shows
        layer.kv_norm.weight.uniform_(0.5, 1.5)
        if q_lora_rank is not None:
            layer.q_norm.weight.uniform_(0.5, 1.5)
    return layer


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, T, ..., d] at positions 0..T-1 rotated as complex numbers: channel i (real) and i + d/2 (imaginary)
    times exp(i t theta^(-2i/d))."""
    d, T = x.shape[-1], x.shape[1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * freq  # (T, d/2)
    angle = angle.view(1, T, *([1] * (x.dim() - 3)), d // 2)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def reference_rows(layer: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """[c ; k_s] recomputed from the weights (k_s rotated with RoPE): [B, T, d_c + d_s]."""
    c = _rms(x @ layer.kv_down.weight.T, layer.kv_norm.weight, layer.kv_norm.eps)
    k_s = x @ layer.k_shared.weight.T
    if layer.rope_theta is not None:
        k_s = reference_rope(k_s, layer.rope_theta)
    return torch.cat([c, k_s], dim=-1)


def reference_forward(layer: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Explicit per-head softmax attention: decompress K and V for each head, causal mask, softmax, gate, W_o."""
    B, T, _ = x.shape
    H, d_n, d_s, d_v, d_c = (
        layer.num_heads,
        layer.qk_nope_head_dim,
        layer.qk_shared_head_dim,
        layer.v_head_dim,
        layer.kv_lora_rank,
    )
    if layer.q_lora_rank is None:
        q = x @ layer.q_proj.weight.T
    else:
        q = _rms(x @ layer.q_down.weight.T, layer.q_norm.weight, layer.q_norm.eps) @ layer.q_up.weight.T
    q = q.view(B, T, H, d_n + d_s)
    if layer.rope_theta is not None:
        q = torch.cat([q[..., :d_n], reference_rope(q[..., d_n:], layer.rope_theta)], dim=-1)
    rows = reference_rows(layer, x)
    c, k_s = rows[..., :d_c], rows[..., d_c:]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for h in range(H):
        w_uk = layer.k_up.weight[h * d_n : (h + 1) * d_n]  # (d_n, d_c)
        w_uv = layer.v_up.weight[h * d_v : (h + 1) * d_v]  # (d_v, d_c)
        k_h = torch.cat([c @ w_uk.T, k_s], dim=-1)  # (B, T, d_n + d_s)
        v_h = c @ w_uv.T  # (B, T, d_v)
        scores = (q[:, :, h] @ k_h.transpose(1, 2)) / (d_n + d_s) ** 0.5  # (B, T, T)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        heads.append(probs @ v_h)
    o = torch.cat(heads, dim=-1)  # (B, T, H*d_v)
    if not layer.output_gate:
        return o @ layer.o_proj.weight.T
    return (torch.sigmoid(x @ layer.g_proj.weight.T) * o) @ layer.o_proj.weight.T


def feed(layer: GatedMLA, x: torch.Tensor, cache: MLACache) -> torch.Tensor:
    """The layer on x [B, T, hidden] with `cache`, whose lengths the caller advances by T first."""
    cache.seqlens.advance(x.shape[1])
    return layer(x, cache=cache)


def decode_in_chunks(layer: GatedMLA, x: torch.Tensor, chunks: list[int], *, cache_dtype=None) -> torch.Tensor:
    """Run x through the layer chunk by chunk with one cache whose unused rows are NaN."""
    assert sum(chunks) == x.shape[1]
    cache = layer.empty_cache(x.shape[0], x.shape[1] + 3, dtype=cache_dtype)
    cache.rows.copy_(poisoned_like(cache.rows))  # a row read before it is written poisons the output
    outs, start = [], 0
    for n in chunks:
        outs.append(feed(layer, x[:, start : start + n], cache))
        start += n
        assert cache.seqlens.host == [start] * x.shape[0]
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("q_lora_rank", [None, 6])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_prefill_matches_per_head_reference(q_lora_rank, T):
    layer = make_layer(q_lora_rank, seed=T)
    x = torch.randn(2, T, SIZES["hidden_size"], dtype=torch.float64)
    ref = reference_forward(layer, x)
    assert_close("prefill, no cache", layer(x), ref, 1e-12)
    cache = layer.empty_cache(2, T + 2)
    assert_close("prefill, empty cache", feed(layer, x, cache), ref, 1e-12)
    assert cache.seqlens.longest == T
    assert_close("cache rows", cache.rows[:, :T], reference_rows(layer, x), 1e-12)


@pytest.mark.parametrize("q_lora_rank", [None, 6])
def test_without_shared_key_part(q_lora_rank):
    """d_s = 0: the cache row is c alone (keys equal values in latent space); both paths still match."""
    torch.manual_seed(11)
    layer = GatedMLA(**{**SIZES, "qk_shared_head_dim": 0}, q_lora_rank=q_lora_rank).double()
    x = torch.randn(2, 11, SIZES["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        ref = reference_forward(layer, x)
        assert_close("prefill d_s=0", layer(x), ref, 1e-12)
        out, cache = decode_in_chunks(layer, x, [4, 1, 5, 1])
    assert_close("incremental d_s=0", out, ref, 1e-10)
    assert cache.rows.shape[-1] == SIZES["kv_lora_rank"]


@pytest.mark.parametrize("q_lora_rank", [None, 6])
def test_without_output_gate(q_lora_rank):
    """output_gate=False: no g_proj, the heads go straight to W_o; prefill and decoding still match."""
    torch.manual_seed(12)
    layer = GatedMLA(**SIZES, q_lora_rank=q_lora_rank, output_gate=False).double()
    assert not hasattr(layer, "g_proj") and len(layer.packed_linears()) == 3
    x = torch.randn(2, 9, SIZES["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        ref = reference_forward(layer, x)
        assert_close("prefill, no gate", layer(x), ref, 1e-12)
        out, _ = decode_in_chunks(layer, x, [3, 1, 4, 1])
    assert_close("incremental, no gate", out, ref, 1e-10)
    with pytest.raises(ValueError, match="output_gate must be a bool"):
        GatedMLA(**SIZES, output_gate=1)


def test_prefill_gradients_match_reference():
    layer = make_layer(6, seed=3)
    x = torch.randn(2, 9, SIZES["hidden_size"], dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 9, SIZES["hidden_size"], dtype=torch.float64)
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad((layer(x) * dy).sum(), params)
    ref_grads = torch.autograd.grad((reference_forward(layer, x) * dy).sum(), params)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        assert r.abs().max() > 0, f"{name}: reference gradient is zero, the test would prove nothing"
        assert_close(f"grad {name}", g, r, 1e-10)


def test_float32_and_bf16_prefill():
    layer64 = make_layer(None, seed=4)
    x = torch.randn(2, 17, SIZES["hidden_size"], dtype=torch.float64)
    ref = reference_forward(layer64, x)
    assert_close("float32 prefill", copy.deepcopy(layer64).float()(x.float()), ref, 1e-5)
    layer16 = copy.deepcopy(layer64).bfloat16()
    out16 = layer16(x.bfloat16())
    assert out16.dtype == torch.bfloat16
    # bf16 weights are rounded too, so compare against the float64 reference of the rounded weights.
    assert_close("bf16 prefill", out16, reference_forward(layer16.double(), x.bfloat16().double()), 1e-2)


def assert_incremental_equals_full(layer, chunks: list[int], name: str):
    """Decoding x in `chunks` equals the full forward and the reference, and leaves the reference's rows in the
    cache (float64); returns (x, cache)."""
    x = torch.randn(3, sum(chunks), SIZES["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        out, cache = decode_in_chunks(layer, x, chunks)
    assert_close(f"{name} incremental vs full", out, full, 1e-10)
    assert_close(f"{name} incremental vs reference", out, reference_forward(layer, x), 1e-10)
    assert_close(f"{name} cache rows", cache.rows[:, : x.shape[1]], reference_rows(layer, x), 1e-12)
    return x, cache


@pytest.mark.parametrize("q_lora_rank", [None, 6])
@pytest.mark.parametrize(
    "chunks",
    [
        [5] + [1] * 12,  # prefill, then one token at a time
        [1] * 9,  # decode from the very first token
        [4, 3, 1, 6, 2, 1],  # uneven chunked prefill on a non-empty cache
        [11, 5, 1],
    ],
)
def test_incremental_decoding_equals_full_forward(q_lora_rank, chunks):
    x, cache = assert_incremental_equals_full(make_layer(q_lora_rank, seed=len(chunks)), chunks, "NoPE")
    assert torch.isnan(cache.rows[:, x.shape[1] :]).all(), "rows past the filled length were written"


def test_bf16_cache_decoding():
    """A bf16 model with a bf16 cache stays within bf16 tolerance of the float64 full forward."""
    layer = make_layer(6, dtype=torch.bfloat16, seed=5)
    x = torch.randn(2, 20, SIZES["hidden_size"]).bfloat16()
    with torch.no_grad():
        out, cache = decode_in_chunks(layer, x, [8, 1, 1, 5, 1, 4])
    assert out.dtype == torch.bfloat16 and cache.rows.dtype == torch.bfloat16
    assert_close("bf16 decode", out, reference_forward(layer.double(), x.double()), 1e-2)


def test_absorbed_path_never_builds_per_head_kv():
    layer = make_layer(None, seed=6)
    x = torch.randn(2, 12, SIZES["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = layer.empty_cache(2, 16)
        feed(layer, x[:, :5], cache)

        def forbidden(*args, **kwargs):
            raise AssertionError("per-head keys or values were built on the absorbed path")

        layer.k_up.forward = forbidden
        layer.v_up.forward = forbidden
        outs = [feed(layer, x[:, 5:6], cache), feed(layer, x[:, 6:10], cache), feed(layer, x[:, 10:], cache)]
    assert_close("absorbed vs full", torch.cat(outs, dim=1), full[:, 5:], 1e-10)
    d_latent = SIZES["kv_lora_rank"] + SIZES["qk_shared_head_dim"]
    assert cache.rows.shape == (2, 16, d_latent)
    assert cache.bytes_per_token == d_latent * 8
    bf16_cache = layer.empty_cache(1, 4, dtype=torch.bfloat16)
    assert bf16_cache.bytes_per_token == d_latent * 2


def test_no_position_leak():
    """NoPE: during a one-token decode every cached row is visible, so permuting them changes nothing."""
    layer = make_layer(6, seed=7)
    x = torch.randn(2, 10, SIZES["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        cache = layer.empty_cache(2, 10)
        feed(layer, x[:, :9], cache)
        permuted = MLACache(rows=cache.rows.clone())
        permuted.seqlens.set(cache.seqlens.host)
        perm = torch.randperm(9)
        permuted.rows[:, :9] = cache.rows[:, perm]
        out = feed(layer, x[:, 9:], cache)
        out_perm = feed(layer, x[:, 9:], permuted)
    assert_close("permuted cache", out_perm, out, 1e-13)


def test_wrong_scale_is_caught():
    """Negative control: the default scale (d_c + d_s)^-1/2 of a decode kernel gives a visibly different result."""
    layer = make_layer(None, seed=8)
    x = torch.randn(1, 6, SIZES["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        layer.scale = (SIZES["kv_lora_rank"] + SIZES["qk_shared_head_dim"]) ** -0.5
        out, _ = decode_in_chunks(layer, x, [2, 1, 3])
    assert (out[:, 2:] - full[:, 2:]).norm() > 1e-3 * full.norm()


@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("path", ["prefill", "chunked"])
def test_causality(path, rope):
    """Perturbing tokens after t0 leaves outputs at or before t0 bit-identical (and, on the training path,
    their gradients with respect to later tokens exactly zero), with RoPE on the shared key part too."""
    layer = make_layer(6, seed=9, **(dict(qk_shared_head_dim=6, rope_theta=50.0) if rope else {}))
    T, t0 = 13, 6
    x = torch.randn(2, T, SIZES["hidden_size"], dtype=torch.float64)
    x2 = x.clone()
    x2[:, t0 + 1 :] += 10 * torch.randn_like(x2[:, t0 + 1 :])
    with torch.no_grad():
        if path == "prefill":
            out, out2 = layer(x), layer(x2)
        else:
            out, out2 = (decode_in_chunks(layer, inp, [3, 2, 4, 1, 3])[0] for inp in (x, x2))
    assert torch.equal(out[:, : t0 + 1], out2[:, : t0 + 1]), "outputs at or before t0 depend on later tokens"
    assert not torch.allclose(out[:, t0 + 1 :], out2[:, t0 + 1 :])
    if path == "prefill":
        x.requires_grad_(True)
        (grad,) = torch.autograd.grad(layer(x)[:, : t0 + 1].sum(), x)
        assert torch.equal(grad[:, t0 + 1 :], torch.zeros_like(grad[:, t0 + 1 :]))
        assert grad[:, : t0 + 1].abs().min() > 0


def explicit_absorbed_reference(q, rows, value_dim, scale, causal):
    """Loop over batch, head and query: score every key row, mask j > Tk - Tq + i, softmax, average values."""
    B, Tq, H, _ = q.shape
    Tk = rows.shape[1]
    out = torch.zeros(B, Tq, H, value_dim, dtype=torch.float64)
    for b in range(B):
        for i in range(Tq):
            visible = Tk - Tq + i + 1 if causal else Tk
            for h in range(H):
                scores = rows[b, :visible].double() @ q[b, i, h].double() * scale  # (visible,)
                out[b, i, h] = torch.softmax(scores, dim=0) @ rows[b, :visible, :value_dim].double()
    return out


@pytest.mark.parametrize("Tq, Tk, causal", [(1, 9, True), (4, 11, True), (5, 5, True), (3, 8, False), (1, 1, True)])
def test_absorbed_attention_matches_explicit(Tq, Tk, causal):
    B, H, d_c, d_s = 2, 4, 9, 3
    q = torch.randn(B, Tq, H, d_c + d_s, dtype=torch.float64)
    rows = torch.randn(B, Tk, d_c + d_s, dtype=torch.float64)
    ref = explicit_absorbed_reference(q, rows, d_c, 0.37, causal)
    out = naive_absorbed_attention(q, rows, value_dim=d_c, scale=0.37, causal=causal)
    assert_close("naive_absorbed_attention float64", out, ref, 1e-13)
    out32 = naive_absorbed_attention(q.float(), rows.float(), value_dim=d_c, scale=0.37, causal=causal)
    assert out32.dtype == torch.float32
    assert_close("naive_absorbed_attention float32", out32, ref, 1e-5)
    out16 = naive_absorbed_attention(q.bfloat16(), rows.bfloat16(), value_dim=d_c, scale=0.37, causal=causal)
    assert out16.dtype == torch.bfloat16
    assert_close("naive_absorbed_attention bf16", out16, ref, 1e-2)


def test_bottom_right_causal_mask():
    mask = bottom_right_causal_mask(3, 7)
    expected = torch.tensor([[j <= 4 + i for j in range(7)] for i in range(3)])
    assert mask.dtype == torch.bool and torch.equal(mask, expected)
    assert torch.equal(bottom_right_causal_mask(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="Tq <= Tk"):
        bottom_right_causal_mask(4, 3)


def test_bad_inputs():
    layer = make_layer(None, seed=10)
    D = SIZES["hidden_size"]
    x = torch.randn(2, 5, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"\[B, T, {D}\]"):
        layer(torch.randn(2, 5, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"\[B, T, {D}\]"):
        layer(torch.randn(5, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="no tokens"):
        layer(x[:, :0])

    cache = layer.empty_cache(2, 7)
    feed(layer, x, cache)
    with pytest.raises(ValueError, match=r"capacity is 7 tokens.*need 8"):
        feed(layer, x[:, :3], cache)
    assert cache.seqlens.host == [5, 5], "a rejected call must leave the cache untouched"
    with pytest.raises(ValueError, match="counts only 0; advance cache.seqlens"):
        layer(x, cache=layer.empty_cache(2, 7))  # tokens the lengths do not count
    with pytest.raises(ValueError, match=r"batch size 3 .* batch size 2"):
        layer(torch.randn(3, 1, D, dtype=torch.float64), cache=cache)
    other = GatedMLA(**{**SIZES, "kv_lora_rank": 12}).double()
    with pytest.raises(ValueError, match="row width"):
        other(x[:, :1], cache=cache)
    with pytest.raises(ValueError, match="qk_shared_head_dim"):
        GatedMLA(**{**SIZES, "qk_shared_head_dim": -1})
    with pytest.raises(ValueError, match="v_head_dim"):
        GatedMLA(**{**SIZES, "v_head_dim": 0})

    q = torch.randn(2, 3, 4, 12, dtype=torch.float64)
    with pytest.raises(ValueError, match="do not match"):
        naive_absorbed_attention(q, torch.randn(2, 6, 11, dtype=torch.float64), value_dim=8, scale=0.3)
    with pytest.raises(ValueError, match="Tq <= Tk"):
        naive_absorbed_attention(q, torch.randn(2, 2, 12, dtype=torch.float64), value_dim=8, scale=0.3)
    with pytest.raises(ValueError, match="value_dim"):
        naive_absorbed_attention(q, torch.randn(2, 6, 12, dtype=torch.float64), value_dim=13, scale=0.3)


def test_sequences_of_different_lengths_decode_together():
    """Three sequences with 2, 9 and 5 cached tokens take decode steps and a 3-token chunk in one batch; each row
    equals that sequence's own full forward (rows past every length are NaN and never read)."""
    layer = make_layer(6, seed=12)
    lens, extra = [2, 9, 5], 5
    xs = [torch.randn(1, n + extra, SIZES["hidden_size"], dtype=torch.float64) for n in lens]
    with torch.no_grad():
        fulls = [layer(x) for x in xs]
        cache = layer.empty_cache(3, max(lens) + extra)
        cache.rows.copy_(poisoned_like(cache.rows))
        for b, (x, n) in enumerate(zip(xs, lens, strict=True)):  # prefill each sequence alone into its row
            single = layer.empty_cache(1, n)
            feed(layer, x[:, :n], single)
            cache.rows[b, :n] = single.rows[0]
        cache.seqlens.set(lens)
        outs = []
        for start, size in [(0, 1), (1, 3), (4, 1)]:
            step = torch.cat([x[:, n + start : n + start + size] for x, n in zip(xs, lens, strict=True)])
            outs.append(feed(layer, step, cache))
    out = torch.cat(outs, dim=1)
    assert cache.seqlens.lengths.tolist() == cache.seqlens.host == [n + extra for n in lens]
    for b, (full, n) in enumerate(zip(fulls, lens, strict=True)):
        assert_close(f"sequence {b}", out[b : b + 1], full[:, n:], 1e-10)


def test_long_chunk_in_query_blocks(monkeypatch):
    """A score budget smaller than one query row's scores forces blocks of a single query: still exact."""
    import hybrid_attention.layers.mla as mla

    layer = make_layer(None, seed=13)
    x = torch.randn(2, 21, SIZES["hidden_size"], dtype=torch.float64)
    calls = []
    original = mla.mla_decode

    def counting(q, *args, **kwargs):
        calls.append(q.shape[1])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(mla, "_TORCH_SCORE_BUDGET", 2 * SIZES["num_heads"] * 24 * 2)  # two queries per block
    monkeypatch.setattr(mla, "mla_decode", counting)
    with torch.no_grad():
        out, _ = decode_in_chunks(layer, x, [6, 11, 1, 3])
    assert calls == [2] * 5 + [1] + [1] + [2, 1], calls  # the 6-token prefill takes the decompressed path
    assert_close("blocked chunks vs reference", out, reference_forward(layer, x), 1e-10)


def test_one_token_on_an_empty_cache_takes_the_absorbed_path():
    """The first token alone decodes through mla_decode (so a captured one-token step never depends on the host
    counter) and equals the full forward of that token."""
    layer = make_layer(None, seed=14)
    x = torch.randn(2, 1, SIZES["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        cache = layer.empty_cache(2, 4)
        layer._prefill_attention = None  # the decompressed path must not run
        out = feed(layer, x, cache)
        del layer._prefill_attention
        assert_close("first token", out, layer(x), 1e-12)


@pytest.mark.parametrize("d_s", [3, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_one_token_append_equals_eager(d_s, dtype, monkeypatch):
    """The Triton append (interpreter on CPU) writes the same rows at each sequence's length as the eager path, and
    the layer's decode outputs match (float32 to 1e-5; float16 exactly the same rows up to one rounding)."""
    triton = pytest.importorskip("triton")  # noqa: F841
    import hybrid_attention.layers.mla as mla
    from hybrid_attention.ops.triton_support import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(15)
    layer = GatedMLA(**{**SIZES, "qk_shared_head_dim": d_s}).to(dev, dtype)
    with torch.no_grad():
        layer.kv_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 4, SIZES["hidden_size"], device=dev, dtype=dtype)
    lens = torch.tensor([2, 0, 5], dtype=torch.int32, device=dev)
    start_rows = torch.randn(3, 9, SIZES["kv_lora_rank"] + d_s, device=dev).to(dtype)  # the same for both runs
    caches = {}
    outs = {}
    for fused in (True, False):
        monkeypatch.setattr(mla, "_fused_append_ok", lambda x, fused=fused: fused)
        cache = layer.empty_cache(3, 9)
        cache.rows.copy_(start_rows)
        cache.seqlens.set(lens.tolist())
        with torch.no_grad():
            outs[fused] = torch.cat([feed(layer, x[:, t : t + 1], cache) for t in range(4)], dim=1)
        caches[fused] = cache
    f, e = caches[True], caches[False]
    assert f.seqlens.lengths.tolist() == e.seqlens.lengths.tolist() == [6, 4, 9] == f.seqlens.host
    for b, n in enumerate([6, 4, 9]):
        assert torch.equal(f.rows[b, n:], start_rows[b, n:]), f"sequence {b}: a row past its length was written"
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert_close("appended rows", f.rows.float(), e.rows.float(), tol)
    assert_close("decode outputs", outs[True].float(), outs[False].float(), tol)
