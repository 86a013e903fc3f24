"""The Mamba-2 mixer (the ``M`` layers).

in_proj packs [z, xBC, dt]; a depthwise causal conv1d with SiLU runs over xBC;
dt = softplus(dt + dt_bias) clamped to the blueprint's limits; A = -exp(A_log);
the chunked SSD scan (``factory.kernels.ssd``) with a per-head D skip; then the
gated group RMSNorm and out_proj.

On CUDA the conv, the scan and the gated norm run the field's Triton kernels (our conv,
mamba_ssm's ``mamba_chunk_scan_combined`` and ``rmsnorm_fn``), packed documents kept apart
through ``seq_idx``; on CPU the PyTorch paths, the reference. :func:`kernel_choices` says
which, and why a CUDA run fell back.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from factory.kernels.causal_conv import conv_kernel, triton_conv
from factory.kernels.choice import KernelChoice
from factory.kernels.gated_norm import gated_norm_kernel
from factory.kernels.ssd import ScanInputs, ssd_chunked_scan, ssd_decode_steps, ssd_kernel
from factory.nn.decoding import DecodingCache
from factory.nn.norms import GatedGroupRMSNorm
from factory.nn.sequence_split import SequenceSplit
from factory.schemas.model import MambaConfig, ModelConfig

__all__ = ["STEP_STATES", "Mamba2Mixer", "MambaCache", "build", "kernel_choices"]

STEP_STATES = 16
"""A decoding step over at most this many positions runs the recurrence position by position
and keeps the SSM state after each (a speculative verification: 1 + the MTP depth); a longer
one (a prompt) runs the chunked scan, keeps only its final state and recomputes from the
step's starting state if it must take positions back."""


class _CausalDepthwiseConv(torch.autograd.Function):
    """Depthwise causal conv1d over [B, L, C] as K shifted multiply-adds, backward written out.

    Same result as ``nn.Conv1d(groups=C, padding=K-1)`` truncated to L, without
    transposing to [B, C, L]: with K = 4 the shifted adds are faster on CPU than
    oneDNN's depthwise backward. Autograd through the shifted slices would build a
    zero-filled [B, L+K-1, C] gradient per tap; here the input gradient is one tensor
    the taps add into, and each weight gradient is a product summed over (B, L) in one
    reused buffer. The parameters stay those of ``self.conv1d`` so checkpoints keep their
    names. ``same[j]`` [B, L, 1] (document mode) zeroes tap j where it reaches into the
    previous document, as at the start of a sequence.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        same: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        length, k = x.shape[1], weight.shape[-1]
        padded = F.pad(x, (0, 0, k - 1, 0))
        taps = _taps(weight)
        shifted = [_tap(padded, j, length, same) for j in range(k)]
        y = shifted[0] * taps[0] if bias is None else torch.addcmul(bias, shifted[0], taps[0])
        for j in range(1, k):
            y = torch.addcmul(y, shifted[j], taps[j])
        ctx.save_for_backward(padded, weight)
        ctx.has_bias, ctx.same = bias is not None, same
        return y

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        padded, weight = ctx.saved_tensors
        length, k = grad.shape[1], weight.shape[-1]
        taps = _taps(weight)
        product = torch.empty_like(grad)
        grad_taps = []
        for j in range(k):
            torch.mul(grad, _tap(padded, j, length, ctx.same), out=product)
            grad_taps.append(product.sum((0, 1)))
        # Tap j reads x at t - (k-1-j): its output gradient flows back shifted by that much.
        grad_x = grad * taps[k - 1]
        for j in range(k - 1):
            shift = k - 1 - j
            g = grad[:, shift:] if ctx.same is None else grad[:, shift:] * ctx.same[j][:, shift:]
            grad_x[:, : length - shift].addcmul_(g, taps[j])
        grad_weight = torch.stack(grad_taps, dim=-1).reshape(weight.shape)
        grad_bias = grad.sum((0, 1)) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


def _taps(weight: torch.Tensor) -> torch.Tensor:
    """The conv weight [C, 1, K] as K contiguous rows [K, C].

    A stack, not ``.t().contiguous()``: inductor fuses a clone into its readers, which
    then load the taps at stride K and, past its ratio of strided loads, give up
    vectorising the whole [B, L, C] loop (4x slower per compiled conv); a stack is
    written out as its own buffer.
    """
    return torch.stack(weight.reshape(weight.shape[0], weight.shape[-1]).unbind(-1))


def _tap(
    padded: torch.Tensor, j: int, length: int, same: list[torch.Tensor] | None
) -> torch.Tensor:
    """The input that tap j multiplies: x shifted right by K-1-j (zeros before the start)."""
    shifted = padded[:, j : j + length]
    return shifted if same is None or j == len(same) else shifted * same[j]


def _causal_depthwise_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d over [B, L, C]; with ``document_ids`` a tap that reaches into the
    previous document reads zeros. The Triton kernel on CUDA (``factory.kernels.causal_conv``),
    :class:`_CausalDepthwiseConv` elsewhere (the reference)."""
    kernel = triton_conv(x)
    if kernel is not None:
        return kernel(x, weight, bias, document_ids)
    same = None
    if document_ids is not None:
        length, k = x.shape[1], weight.shape[-1]
        docs = F.pad(document_ids, (k - 1, 0), value=-1)
        same = [
            (docs[:, j : j + length] == document_ids)[..., None].to(x.dtype) for j in range(k - 1)
        ]
    return _CausalDepthwiseConv.apply(x, weight, bias, same)


class MambaCache(DecodingCache):
    """A Mamba layer's decoding state: the conv's last K-1 inputs [B, K-1, conv channels] and the
    SSM state [B, heads, head_dim, state] (fp32).

    SSM states cannot be cut back like a KV cache: to take positions back, a step keeps the
    state after each of its positions when it is short (:data:`STEP_STATES`), and otherwise
    its starting state and scan inputs, from which :meth:`keep` recomputes. The conv window
    is kept whole for the step, so any prefix of it is there."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, chunk_size: int) -> None:
        self.conv = conv
        self.ssm = ssm
        self.chunk_size = chunk_size
        self._window: torch.Tensor | None = None
        """The last step's [B, K-1 + T, C] conv inputs: the old window and its positions'."""
        self._states: torch.Tensor | None = None
        """The SSM state after each of the last step's positions [B, T, H, P, N], if kept."""
        self._start: torch.Tensor | None = None
        """The SSM state before the last step."""
        self._inputs: ScanInputs | None = None
        """The last step's scan inputs, to recompute a prefix from ``_start``."""

    def step(
        self,
        window: torch.Tensor,
        inputs: ScanInputs,
        states: torch.Tensor | None,
        final: torch.Tensor,
    ) -> None:
        """Record a step: its conv window, its scan inputs, its per-position states (or None)
        and the state after its last position."""
        self._window, self._states, self._start, self._inputs = window, states, self.ssm, inputs
        self.conv = window[:, window.shape[1] - self.conv.shape[1] :]
        self.ssm = final

    def keep(self, count: int) -> None:
        """Keep the first ``count`` positions of the last step."""
        window, inputs, start = self._window, self._inputs, self._start
        if window is None or inputs is None or start is None:
            raise RuntimeError("keep() before any decoding step")
        taps = self.conv.shape[1]
        appended = window.shape[1] - taps
        if count == appended:
            return
        self.conv = window[:, count : count + taps]
        if count == 0:
            self.ssm = start
        elif self._states is not None:
            self.ssm = self._states[:, count - 1]
        else:
            prefix = _prefix(inputs, count)
            _, self.ssm = ssd_chunked_scan(prefix, self.chunk_size, return_final_state=True)
        self._window = window[:, : count + taps]
        if self._states is not None:
            self._states = self._states[:, :count]
        self._inputs = _prefix(inputs, count)


def _prefix(inputs: ScanInputs, count: int) -> ScanInputs:
    """The scan inputs of the first ``count`` positions, from the same starting state."""
    x, dt, B, C = (t[:, :count] for t in (inputs.x, inputs.dt, inputs.B, inputs.C))
    return ScanInputs(x, dt, inputs.A, B, C, D=inputs.D, initial_state=inputs.initial_state)


class Mamba2Mixer(nn.Module):
    def __init__(self, width: int, cfg: MambaConfig, norm_eps: float) -> None:
        super().__init__()
        self.cfg = cfg
        # The heads and groups this module computes: all of them, or one rank's share once
        # tensor parallelism (factory.distributed.tensor_parallel) splits the mixer.
        self.heads, self.groups = cfg.heads, cfg.groups
        self.in_proj = nn.Linear(width, cfg.in_proj_dim, bias=cfg.bias)
        self.conv1d = nn.Conv1d(
            cfg.conv_dim,
            cfg.conv_dim,
            kernel_size=cfg.conv_kernel,
            groups=cfg.conv_dim,
            padding=cfg.conv_kernel - 1,
            bias=cfg.conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.empty(cfg.heads))
        self.A_log = nn.Parameter(torch.empty(cfg.heads))
        self.D = nn.Parameter(torch.empty(cfg.heads))
        self.norm = GatedGroupRMSNorm(cfg.d_inner, cfg.groups, norm_eps)
        self.out_proj = nn.Linear(cfg.d_inner, width, bias=cfg.bias)
        self.sequence_split: SequenceSplit | None = None
        """Set by context parallelism: the rows are this rank's chunks of the sequence; the
        conv and the scan run on the whole sequence of this rank's share of the heads
        (``heads_all_to_all``, Megatron-Core's ``MambaContextParallel``)."""

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        d_inner = self.heads * self.cfg.head_dim
        projected = self.in_proj(x)
        z, mixer_input = projected.split([d_inner, projected.shape[-1] - d_inner], dim=-1)
        if self.sequence_split is None:
            heads, groups = slice(0, self.heads), slice(0, self.groups)
            y = self._mix(mixer_input, document_ids, heads, groups)
        else:
            y = self._mix_head_shard(mixer_input, document_ids, self.sequence_split)
        y = self.norm(y, z)
        return self.out_proj(y.to(x.dtype))

    def decoding_problem(self) -> str | None:
        """Why this mixer cannot decode incrementally (None: it can)."""
        if self.sequence_split is not None:
            return "context parallelism splits its sequence across ranks"
        return None

    def init_cache(
        self, batch: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> MambaCache:
        """The state before the first position: zeros (the conv's padding, an empty scan).
        ``capacity`` does not matter: the state's size does not grow."""
        cfg = self.cfg
        channels = self.heads * cfg.head_dim + 2 * self.groups * cfg.state_size
        conv = torch.zeros(batch, cfg.conv_kernel - 1, channels, device=device, dtype=dtype)
        shape = (batch, self.heads, cfg.head_dim, cfg.state_size)
        ssm = torch.zeros(shape, device=device, dtype=torch.float32)
        return MambaCache(conv, ssm, cfg.chunk_size)

    def decode(self, x: torch.Tensor, cache: MambaCache) -> torch.Tensor:
        """The next T positions ``x`` [B, T, d] after the cached ones, as :meth:`forward` over
        the whole sequence computes them (one document per row)."""
        cfg = self.cfg
        b, s = x.shape[:2]
        d_inner = self.heads * cfg.head_dim
        widths = [d_inner, self.groups * cfg.state_size, self.groups * cfg.state_size]
        projected = self.in_proj(x)
        z, xbc, dt = projected.split([d_inner, sum(widths), self.heads], dim=-1)
        window = torch.cat([cache.conv.to(xbc.dtype), xbc], dim=1)
        # The conv's taps over the window, in the order the full forward adds them.
        taps = _taps(self.conv1d.weight)
        bias = self.conv1d.bias
        k = taps.shape[0]
        conv = (
            window[:, :s] * taps[0] if bias is None else torch.addcmul(bias, window[:, :s], taps[0])
        )
        for j in range(1, k):
            conv = torch.addcmul(conv, window[:, j : j + s], taps[j])
        xs, B, C = F.silu(conv).split(widths, -1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        upper = cfg.dt_limit_max if cfg.dt_limit_max is not None else float("inf")
        dt = dt.clamp(min=cfg.dt_limit_min, max=upper)
        inputs = ScanInputs(
            xs.reshape(b, s, self.heads, cfg.head_dim),
            dt,
            -torch.exp(self.A_log.float()),
            B.reshape(b, s, self.groups, cfg.state_size),
            C.reshape(b, s, self.groups, cfg.state_size),
            D=self.D,
            initial_state=cache.ssm,
        )
        if s <= STEP_STATES:
            y, states = ssd_decode_steps(inputs)
            final = states[:, -1]
        else:
            y, final = ssd_chunked_scan(inputs, cfg.chunk_size, return_final_state=True)
            states = None
        cache.step(window, inputs, states, final.float())
        y = self.norm(y.reshape(b, s, d_inner), z)
        return self.out_proj(y.to(x.dtype))

    def _mix(
        self,
        mixer_input: torch.Tensor,
        document_ids: torch.Tensor | None,
        heads: slice,
        groups: slice,
    ) -> torch.Tensor:
        """Conv, dt and the SSD scan over the whole sequence of the heads ``heads`` and their
        groups ``groups`` (of this module's); ``mixer_input`` holds their x, B, C and dt in
        the projection's order. -> [B, S, those heads * head_dim]."""
        cfg = self.cfg
        b, s = mixer_input.shape[:2]
        n_heads, n_groups = heads.stop - heads.start, groups.stop - groups.start
        widths = [n_heads * cfg.head_dim, n_groups * cfg.state_size, n_groups * cfg.state_size]
        xbc, dt = mixer_input.split([sum(widths), n_heads], dim=-1)
        weight, bias = self._conv_rows(heads, groups)
        xs, B, C = F.silu(_causal_depthwise_conv(xbc, weight, bias, document_ids)).split(widths, -1)
        dt_bias, A_log, D = (self._head_rows(p, heads) for p in (self.dt_bias, self.A_log, self.D))
        dt = F.softplus(dt.float() + dt_bias.float())
        upper = cfg.dt_limit_max if cfg.dt_limit_max is not None else float("inf")
        dt = dt.clamp(min=cfg.dt_limit_min, max=upper)
        A = -torch.exp(A_log.float())
        inputs = ScanInputs(
            xs.view(b, s, n_heads, cfg.head_dim),
            dt,
            A,
            B.view(b, s, n_groups, cfg.state_size),
            C.view(b, s, n_groups, cfg.state_size),
            D=D,
            seq_idx=document_ids,
        )
        y = ssd_chunked_scan(inputs, cfg.chunk_size)
        return y.reshape(b, s, n_heads * cfg.head_dim)

    def _head_rows(self, parameter: torch.Tensor, heads: slice) -> torch.Tensor:
        """``parameter`` [heads]'s entries of ``heads``: the parameter itself for all of them
        (a slice would add a zero-filled gradient and a copy to every backward)."""
        return parameter if heads == slice(0, self.heads) else parameter[heads]

    def _conv_rows(self, heads: slice, groups: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The conv's weight and bias rows of ``heads``' x channels and ``groups``' B and C."""
        weight, bias = self.conv1d.weight, self.conv1d.bias
        if heads == slice(0, self.heads):
            return weight, bias
        hd, n = self.cfg.head_dim, self.cfg.state_size
        d_inner, width = self.heads * hd, self.groups * n
        rows = torch.cat([
            torch.arange(heads.start * hd, heads.stop * hd),
            d_inner + torch.arange(groups.start * n, groups.stop * n),
            d_inner + width + torch.arange(groups.start * n, groups.stop * n),
        ]).to(weight.device)  # fmt: skip
        return weight[rows], None if bias is None else bias[rows]

    def _mix_head_shard(
        self, mixer_input: torch.Tensor, document_ids: torch.Tensor | None, split: SequenceSplit
    ) -> torch.Tensor:
        """Context parallelism: every rank's rows of this rank's heads (and their groups)
        arrive all-to-all, the whole sequence is mixed, and the result goes back."""
        cfg, cp = self.cfg, split.size
        hd, n = cfg.head_dim, cfg.state_size
        per_rank = self.heads // cp
        group_count = max(self.groups // cp, 1)
        repeats = max(cp // self.groups, 1)  # ranks that share a group when groups < cp
        xs, B, C, dt = mixer_input.split(
            [self.heads * hd, self.groups * n, self.groups * n, self.heads], dim=-1
        )

        def piece(rank: int) -> torch.Tensor:
            h, g = rank * per_rank, rank // repeats * group_count
            return torch.cat([
                xs[..., h * hd : (h + per_rank) * hd],
                B[..., g * n : (g + group_count) * n],
                C[..., g * n : (g + group_count) * n],
                dt[..., h : h + per_rank],
            ], -1)  # fmt: skip

        whole = split.to_heads(torch.stack([piece(rank) for rank in range(cp)]))
        first_head = split.rank * per_rank
        first_group = split.rank // repeats * group_count
        heads = slice(first_head, first_head + per_rank)
        groups = slice(first_group, first_group + group_count)
        return split.to_sequence(self._mix(whole, document_ids, heads, groups))


def build(model: ModelConfig) -> Mamba2Mixer:
    """The ``M`` mixer of ``model`` (``LayerType.build``)."""
    return Mamba2Mixer(model.hidden_size, model.mamba, model.norm_eps)


def kernel_choices(model: ModelConfig, device: str) -> list[KernelChoice]:
    """The Mamba mixer's kernels on ``device``: the conv, the SSD scan and the gated norm."""
    return [
        conv_kernel(device),
        ssd_kernel(device, model.mamba.chunk_size),
        gated_norm_kernel(device),
    ]
