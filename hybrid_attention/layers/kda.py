"""The Kimi Delta Attention layer and its decoding cache (docs/math.md, "KDA layer"; Kimi Linear report, KDA layer).
Decoding one token on CUDA runs fused Triton kernels (docs/inference.md, "A decode step").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hybrid_attention.checks import check_lower_bound
from hybrid_attention.layers.conv import ShortConv
from hybrid_attention.layers.documents import PackedDocuments, packed_documents
from hybrid_attention.layers.norm import GatedRMSNorm
from hybrid_attention.layers.packed import PackedProjections, linear, project
from hybrid_attention.ops.backends import use_triton
from hybrid_attention.ops.kda import chunk_kda, kda_gate, l2_normalize, recurrent_kda, resolve_backend
from hybrid_attention.ops.kda.gate import check_gate_form, head_as_channels
from hybrid_attention.ops.numerics import compute_dtype


@dataclass
class KDACache:
    """Decoding cache of one KDA layer (all tensors updated in place)."""

    conv_q: torch.Tensor  # [B, H*head_dim, conv_size - 1], model dtype: last inputs of the q conv
    conv_k: torch.Tensor  # [B, H*head_dim, conv_size - 1]
    conv_v: torch.Tensor  # [B, H*head_dim, conv_size - 1]
    state: torch.Tensor  # [B, H, head_dim, head_dim], float32 (float64 for float64 modules)


def _fused_decode_ok(x: torch.Tensor, conv_size: int) -> bool:
    """The fused one-token decode kernels (no backward) take x: the rule of `hybrid_attention.ops.backends` with no
    gradient needed, and a conv of size >= 2."""
    return conv_size >= 2 and use_triton(x, needs_backward=torch.is_grad_enabled())


class KimiDeltaAttention(nn.Module):
    """KDA token mixer: [B, T, hidden_size] -> [B, T, hidden_size].

    Args:
        hidden_size: model width.
        num_heads: H; each head has K = V = head_dim.
        head_dim: per-head key/value size, also the rank of the low-rank decay and output-gate projections.
        conv_size: kernel of the causal depthwise short convolutions.
        lower_bound: most negative log decay per step of the "bounded" gate (finite, < 0; unused by the others).
        norm_eps: epsilon of the per-head output RMSNorm.
        backend: `chunk_kda` backend ("auto", "torch", "triton", "fla").
        gate: the decay gate's form, "bounded", "softplus" or "head" (see `kda_gate`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int = 128,
        conv_size: int = 4,
        lower_bound: float = -5.0,
        norm_eps: float = 1e-6,
        backend: str = "auto",
        gate: str = "bounded",
    ):
        super().__init__()
        for label, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KimiDeltaAttention: {label} must be a positive int, got {value!r}")
        check_lower_bound(lower_bound, name="KimiDeltaAttention")
        check_gate_form(gate, name="KimiDeltaAttention")
        resolve_backend(backend)  # fail early on an unknown backend name
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.conv_size = conv_size
        self.lower_bound = float(lower_bound)
        self.backend = backend
        self.gate = gate
        dim = num_heads * head_dim

        self.q_proj = nn.Linear(hidden_size, dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, dim, bias=False)
        self.q_conv = ShortConv(dim, conv_size)
        self.k_conv = ShortConv(dim, conv_size)
        self.v_conv = ShortConv(dim, conv_size)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.f_down = nn.Linear(hidden_size, head_dim, bias=False)
        gate_width = num_heads if gate == "head" else dim  # logits (and biases) per head or per channel
        self.f_up = nn.Linear(head_dim, gate_width, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(gate_width))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_down = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_up = nn.Linear(head_dim, dim, bias=True)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(dim, hidden_size, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] per channel (per head for "head"); A_log = 0
        for the bounded gate (initial per-step retention from about e^-0.005 to e^-0.45), log of uniform [1, 16]
        for the softplus gates (Kimi Linear's and Gated DeltaNet's initialisation: g = -A dt at z = 0)."""
        if self.gate == "bounded":
            self.A_log.zero_()
        else:
            self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float64).uniform_(1.0, 16.0).log())
        u = torch.rand(self.dt_bias.shape, dtype=torch.float64, device=self.dt_bias.device)
        dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus(y) = log(1 + e^y)

    def empty_cache(self, batch_size: int, device=None, dtype=None) -> KDACache:
        """A zero cache for `batch_size` sequences that have not started (defaults: the parameters' device/dtype)."""
        device = device if device is not None else self.q_proj.weight.device
        dtype = dtype if dtype is not None else self.q_proj.weight.dtype
        D = self.head_dim
        return KDACache(
            conv_q=self.q_conv.empty_cache(batch_size, device=device, dtype=dtype),
            conv_k=self.k_conv.empty_cache(batch_size, device=device, dtype=dtype),
            conv_v=self.v_conv.empty_cache(batch_size, device=device, dtype=dtype),
            state=torch.zeros(batch_size, self.num_heads, D, D, device=device, dtype=compute_dtype(dtype)),
        )

    def _check_cache(self, cache: KDACache, x: torch.Tensor) -> None:
        B = x.shape[0]
        conv_shape = (B, self.num_heads * self.head_dim, self.conv_size - 1)
        for label, t in (("conv_q", cache.conv_q), ("conv_k", cache.conv_k), ("conv_v", cache.conv_v)):
            if tuple(t.shape) != conv_shape:
                raise ValueError(
                    f"KimiDeltaAttention: cache.{label} must be [B, H*head_dim, conv_size-1] = {conv_shape} "
                    f"for input of shape {tuple(x.shape)}, got {tuple(t.shape)}"
                )
        state_shape = (B, self.num_heads, self.head_dim, self.head_dim)
        if tuple(cache.state.shape) != state_shape:
            raise ValueError(
                f"KimiDeltaAttention: cache.state must be [B, H, head_dim, head_dim] = {state_shape} "
                f"for input of shape {tuple(x.shape)}, got {tuple(cache.state.shape)}"
            )
        if cache.state.dtype != compute_dtype(x.dtype):
            raise ValueError(
                f"KimiDeltaAttention: cache.state must be {compute_dtype(x.dtype)} for {x.dtype} inputs, "
                f"got {cache.state.dtype}"
            )

    def forward(
        self,
        x: torch.Tensor,
        cache: KDACache | None = None,
        *,
        decode: PackedProjections | None = None,
        cu_seqlens: torch.Tensor | PackedDocuments | None = None,
    ) -> torch.Tensor:
        """x: [B, T, hidden_size] -> [B, T, hidden_size].

        With `cache`, the conv tails are the left context and the cached state is the initial state;
        both are updated in place to include these T tokens (T >= 1, any T). `decode`: a decode step's packed
        projections (layers/packed.py), which then compute the products. `cu_seqlens` (int [N + 1], B == 1; or a
        `PackedDocuments`): N documents packed along T, each run as its own sequence (conv tails and state start
        from zeros at every document); no cache, or one that takes packed documents (each document's final state
        and conv tails then go to its sequence).
        """
        if x.dim() != 3 or x.shape[-1] != self.hidden_size or x.shape[1] == 0:
            raise ValueError(
                f"KimiDeltaAttention: x must be [B, T, hidden_size] = [B, T, {self.hidden_size}] with T >= 1, "
                f"got shape {tuple(x.shape)}"
            )
        docs = packed_documents("KimiDeltaAttention", cu_seqlens, x, cache)
        # Documents that each start a sequence of `cache` (inference/packed_prefill.py): run as without a cache,
        # then each document's final state and last conv inputs go to its sequence.
        packed = docs is not None and cache is not None
        if cache is not None and not packed:
            self._check_cache(cache, x)
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        positions = None if docs is None else docs.positions
        if cache is not None and not packed and T == 1 and _fused_decode_ok(x, self.conv_size):
            return self._decode_fused(x, cache, decode)
        tails = cache is not None and not packed
        conv_q, conv_k, conv_v = (cache.conv_q, cache.conv_k, cache.conv_v) if tails else (None, None, None)

        q_in, k_in, v_in, b_in, f_in, g_in = project(self, x, decode)
        q = self.q_conv(q_in, conv_q, positions=positions).view(B, T, H, D)
        k = self.k_conv(k_in, conv_k, positions=positions).view(B, T, H, D)
        v = self.v_conv(v_in, conv_v, positions=positions).view(B, T, H, D)
        beta = torch.sigmoid(b_in.to(compute_dtype(x.dtype)))  # [B, T, H]
        z, gate_args = self._gate_logits(linear(self.f_up, f_in, decode).view(B, T, H, -1))

        if tails and T <= 16 and not torch.is_grad_enabled():  # a few tokens: the recurrence itself
            q, k = l2_normalize(q), l2_normalize(k)
            g = kda_gate(z, gate_args["A_log"], gate_args["dt_bias"], gate_args["lower_bound"], form=gate_args["gate"])
            o, state = recurrent_kda(q, k, v, g, beta, initial_state=cache.state, output_final_state=True)
        else:
            # Gate and q/k L2 norm go to chunk_kda, which fuses them into the Triton kernels on CUDA (also for a
            # prefill into the cache). With gradients the cached state is cloned: autograd may keep the initial
            # state for backward, and the cache is overwritten below.
            initial_state = None
            if tails:
                initial_state = cache.state.clone() if torch.is_grad_enabled() else cache.state
            o, state = chunk_kda(
                q,
                k,
                v,
                z,
                beta,
                initial_state=initial_state,
                output_final_state=cache is not None,
                cu_seqlens=None if docs is None else docs.cu_seqlens,
                backend=self.backend,
                use_qk_l2norm=True,
                **gate_args,
            )
        if packed:
            cache.store(state.detach(), (q_in, k_in, v_in), docs)
        elif cache is not None:
            cache.state.copy_(state.detach())

        gate = linear(self.g_up, g_in, decode).view(B, T, H, D)
        return linear(self.o_proj, self.o_norm(o, gate).reshape(B, T, H * D), decode)

    def _gate_logits(self, z: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """z [B, T, H, K] (or [B, T, H, 1] for "head") -> (per-channel logits [B, T, H, K], the gate arguments of
        chunk_kda): the per-head gate becomes the per-channel softplus gate on logits repeated over K."""
        if self.gate == "head":
            z, dt_bias = head_as_channels(z[..., 0], self.dt_bias, self.head_dim)
            return z, dict(gate="softplus", A_log=self.A_log, dt_bias=dt_bias, lower_bound=None)
        lower_bound = self.lower_bound if self.gate == "bounded" else None
        return z, dict(gate=self.gate, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=lower_bound)

    def packed_linears(self) -> list[nn.Linear]:
        """The bias-free projections of x, in the order `forward` unpacks them (see layers/packed.py)."""
        return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_down, self.g_down]

    def _decode_fused(self, x: torch.Tensor, cache: KDACache, decode: PackedProjections | None = None) -> torch.Tensor:
        """One-token decode on CUDA: the same computation as the eager path, with the decay up projection, conv + SiLU
        + L2 norm + gate + beta in one Triton kernel and the gate up projection + gated output norm in another
        (`ops.kda.decode_fused`); the recurrence is the fused Triton step (`ops.kda.triton_step`, state updated
        in place).
        x [B, 1, hidden] -> [B, 1, hidden]."""
        from hybrid_attention.ops.kda.decode_fused import kda_decode_inputs, kda_gated_output_norm
        from hybrid_attention.ops.kda.triton_step import fused_recurrent_kda_step

        q_in, k_in, v_in, b_in, f_in, g_in = project(self, x, decode)
        f_up, gate, dt_bias, lower_bound = self.f_up.weight, self.gate, self.dt_bias, self.lower_bound
        if gate == "head":  # rows of the per-head logits repeated over K: the per-channel softplus gate
            f_up = f_up.repeat_interleave(self.head_dim, 0)
            gate, dt_bias = "softplus", dt_bias.repeat_interleave(self.head_dim)
        q, k, v, g, beta = kda_decode_inputs(
            q_in,
            k_in,
            v_in,
            b_in,
            f_in,
            f_up,
            (cache.conv_q, cache.conv_k, cache.conv_v),
            (self.q_conv.weight, self.k_conv.weight, self.v_conv.weight),
            self.A_log,
            dt_bias,
            num_heads=self.num_heads,
            gate=gate,
            lower_bound=lower_bound if gate == "bounded" else None,
        )
        o = fused_recurrent_kda_step(q, k, v, g, beta, cache.state)  # state updated in place, in the kernel
        y = kda_gated_output_norm(
            o, g_in, self.g_up.weight, self.g_up.bias, self.o_norm.weight, self.o_norm.eps, dtype=x.dtype
        )
        return linear(self.o_proj, y, decode)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"conv_size={self.conv_size}, gate={self.gate!r}, lower_bound={self.lower_bound}, backend={self.backend!r}"
        )
