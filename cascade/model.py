"""A compact forward pass for the Llama family (Llama, Mistral, Qwen2, SmolLM2).

Q/K/V and gate/up projections are fused into one matmul each; keys and values go through the
cache policy, which decides what attention reads. Logits are computed only for the positions
the caller asks for (the output projection dominates a small model at a 49K vocabulary).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from cache.base import CacheLayout, CachePolicy, TreePass
from cascade import fused
from cascade import kernels as compiled_kernels
from cascade.attention import KERNELS, AttentionKernel, resolve_kernels
from cascade.panels import dense_weight
from cascade.quantise import is_quantised, projection
from cascade.rope import Rotary, apply_rotary


@dataclass(frozen=True)
class ModelSpec:
    """Architecture hyper-parameters, read once from a checkpoint's config and weights."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    tied_embeddings: bool
    max_context: int
    """Most positions the model supports (after any rope scaling)."""

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


WIDE_PASS_ROWS = compiled_kernels.MAX_KERNEL_ROWS
"""Rows above which a bf16 projection on a CPU without AVX512-BF16 runs in float32 (``Linear``)."""


class Linear(nn.Linear):
    """``nn.Linear`` whose wide bf16 passes (prefill chunks) on a CPU without AVX512-BF16 multiply in
    float32: oneDNN emulates bf16 products there (a 512-token chunk's products ran 7x slower than
    float32's on a 2-core Zen 3). The weight is widened per call (a few percent of such a product's
    time); the output is rounded to bf16 as a bf16 product's is. Short passes are cascade's kernels'."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if compiled_kernels.bf16_products_emulated(x) and x.numel() > WIDE_PASS_ROWS * x.shape[-1]:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return super().forward(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer = layer
        self.qkv_proj = Linear(spec.hidden_size, spec.qkv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)
        self.scale = spec.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: CachePolicy, attend: AttentionKernel
    ) -> torch.Tensor:
        spec = self.spec
        qkv = rearrange(self.qkv_proj(x), "b t (h d) -> b h t d", d=spec.head_dim)  # [B, H+2Hkv, T, D]
        rotated = apply_rotary(qkv[:, : spec.num_heads + spec.num_kv_heads], cos, sin)  # queries and keys
        query, keys = rotated.split([spec.num_heads, spec.num_kv_heads], dim=1)
        values = qkv[:, spec.num_heads + spec.num_kv_heads :]
        view = cache.update(self.layer, keys, values, query)
        out = fused.attend_prefill(query, view, self.scale, attend)  # [B, H, T, D]
        return self.o_proj(rearrange(out, "b h t d -> b t (h d)"))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_product(self.gate_up_proj(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, cache: CachePolicy, attend: AttentionKernel) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, attend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, cos, sin, cache: CachePolicy, attend: AttentionKernel) -> torch.Tensor:
        """The same block for the residual stream x [T, C] of one sequence through the compiled
        kernels of ``cascade.fused``."""
        attn, spec = self.self_attn, self.self_attn.spec
        query, key, value = fused.pre_attention(
            x,
            self.input_layernorm.weight,
            projection(attn.qkv_proj),
            attn.qkv_proj.bias,
            cos,
            sin,
            self.input_layernorm.eps,
            spec.num_heads,
            spec.num_kv_heads,
        )
        view = cache.update(attn.layer, key, value, query)
        attended = fused.attend(query, view, attn.scale, attend)  # [1, H, T, D]
        mlp = self.mlp
        return fused.post_attention(
            x,
            attended,
            projection(attn.o_proj),
            self.post_attention_layernorm.weight,
            projection(mlp.gate_up_proj),
            projection(mlp.down_proj),
            self.post_attention_layernorm.eps,
        )

    def kernel_operands(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list, list]:
        """This block's operands of ``fused.decoder_layers``: its norms, projection weights, their
        int8 scales and the qkv bias (see ``fused.LayerOperands``)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        weights, scales = zip(*(projection(linear) for linear in linears), strict=True)
        norms = [self.input_layernorm.weight, self.post_attention_layernorm.weight]
        return norms, list(weights), list(scales), [attn.qkv_proj.bias]


@dataclass(frozen=True)
class SequencePass:
    """One sequence's part of ``CausalLM.forward_batch``: its ids after what its cache holds, and
    what its own ``forward`` would be asked for."""

    token_ids: torch.Tensor
    """[T] int64 on the model's device."""
    cache: CachePolicy
    num_logits: int | None = 1
    """Logits of the last this many positions (all if None)."""
    tree: TreePass | None = None
    """The last tokens are token-tree nodes (see ``TreePass``)."""


def shared_groups(rows: list[int]) -> list[list[int]]:
    """Rows per sequence (0: it runs alone) -> indices of the sequences that share a call, in order,
    each group at most ``MAX_KERNEL_ROWS`` rows."""
    groups: list[list[int]] = []
    total = compiled_kernels.MAX_KERNEL_ROWS
    for index, count in enumerate(rows):
        if not count:
            continue
        if total + count > compiled_kernels.MAX_KERNEL_ROWS:
            groups.append([])
            total = 0
        groups[-1].append(index)
        total += count
    return groups


@dataclass(frozen=True)
class PassOptions:
    """How a model runs its passes, chosen when it is built (the runtime picks them per device)."""

    fused_tokens: int = 0
    """Longest pass that runs fused (0: none)."""
    attention: str = "auto"
    """Attention kernel family (``cascade.attention``); auto picks by device."""


class CausalLM(nn.Module):
    """Token ids in, logits out; all state lives in the cache policy passed to ``forward``.

    Passes of one sequence of up to ``options.fused_tokens`` tokens (decode steps, proposals and,
    on CUDA, verification passes) run through the compiled kernels of ``cascade.fused``; longer
    passes always run eagerly.
    """

    def __init__(self, spec: ModelSpec, rotary: Rotary, options: PassOptions = PassOptions()) -> None:
        super().__init__()
        self.options = options
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = rotary
        self.output_ids: torch.Tensor | None = None
        """[K] int64, sorted: the tokens of the output projection's rows once it keeps only some
        (``keep_output_tokens``); None while it has a row per token."""
        self._operands: tuple[nn.Module, fused.LayerOperands] | None = None  # see _kernel_operands

    @property
    def fused_tokens(self) -> int:
        return self.options.fused_tokens

    @property
    def attention(self) -> str:
        return self.options.attention

    def run_eagerly(self) -> None:
        """Run every pass eagerly from now on (the fused kernels could not be built here)."""
        self.options = replace(self.options, fused_tokens=0)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def pass_weight_bytes(self) -> int:
        """Weight bytes a one-token pass reads: every tensor once (buffers too: an int8 projection's
        weight and scales), but of an embedding that is not also the output projection only one row."""
        tensors = {id(t): t for t in (*self.parameters(), *self.buffers())}
        total = sum(t.nbytes for t in tensors.values())
        embedding = self.embed_tokens.weight
        if self.lm_head.weight is not embedding:
            total -= embedding.nbytes - embedding[0].nbytes
        return total

    def replace_projections(self, convert: Callable[[nn.Module], nn.Module]) -> None:
        """Replace every layer's projections and the output projection with ``convert``'s of them."""
        for block in self.layers:
            attn, mlp = block.self_attn, block.mlp
            attn.qkv_proj, attn.o_proj = convert(attn.qkv_proj), convert(attn.o_proj)
            mlp.gate_up_proj, mlp.down_proj = convert(mlp.gate_up_proj), convert(mlp.down_proj)
        self.lm_head = convert(self.lm_head)

    def keep_output_tokens(self, token_ids: torch.Tensor) -> None:
        """Keep the output projection's rows of ``token_ids`` [K] alone: each pass then reads K rows
        instead of the vocabulary's, and every other token's logit is -inf. For a model that only
        proposes (a draft, after FR-Spec): its distribution no longer covers the vocabulary."""
        ids = torch.unique(token_ids.to(self.device))  # [K] sorted
        head = Linear(self.spec.hidden_size, len(ids), bias=False, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            head.weight.copy_(dense_weight(self.lm_head)[ids])
        self.lm_head, self.output_ids = head, ids

    def _every_token(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, N, K] of the kept tokens -> [B, N, V], -inf for the tokens not kept."""
        if self.output_ids is None:
            return logits
        every = logits.new_full((*logits.shape[:-1], self.spec.vocab_size), float("-inf"))
        return every.index_copy_(-1, self.output_ids, logits)

    def _kernel_operands(self) -> fused.LayerOperands:
        """Every layer's ``Block.kernel_operands``, gathered once (~0.4 ms of module lookups, 4% of a
        SmolLM2 step at 1K) and gathered again when the output projection is no longer the one they
        were gathered with: ``quantise`` replaces it together with every layer's projections.
        Moving weights (``move_to_huge_pages``) keeps the tensors, so the lists stay valid."""
        if self._operands is None or self._operands[0] is not self.lm_head:
            operands = [block.kernel_operands() for block in self.layers]
            gathered = tuple([tensor for layer in operands for tensor in layer[part]] for part in range(4))
            self._operands = (self.lm_head, gathered)
        return self._operands[1]

    def cache_layout(self, capacity: int, max_pending: int | None = None) -> CacheLayout:
        spec = self.spec
        return CacheLayout(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            capacity,
            self.dtype,
            self.device,
            self.rotary,
            max_pending,
        )

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, cache: CachePolicy, num_logits: int | None = None, tree: TreePass | None = None
    ) -> torch.Tensor:
        """token_ids [B, T] -> logits [B, N, V] for the last N = ``num_logits`` positions (all if
        None); ``tree``: the last tokens are token-tree nodes (see ``TreePass``)."""
        num_tokens = token_ids.shape[1]
        positions = cache.allocate(num_tokens) if tree is None else cache.allocate_tree(num_tokens, tree)
        return self.forward_at(token_ids, positions, cache, num_logits)

    @torch.inference_mode()
    def forward_at(
        self, token_ids: torch.Tensor, positions: torch.Tensor, cache: CachePolicy, num_logits: int | None = None
    ) -> torch.Tensor:
        """``forward`` for tokens the cache has already allocated at ``positions`` [T]; a static
        pass (see ``SlotCache.set_static``) runs here with the same shapes and addresses every time."""
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [T, D] each
        x = self.embed_tokens(token_ids)  # [B, T, C]
        attend = KERNELS[resolve_kernels(self.attention, self.device)]
        if token_ids.shape[0] == 1 and token_ids.shape[1] <= self.fused_tokens:
            return self._every_token(self._forward_fused(x[0], cos, sin, cache, attend, num_logits))
        for block in self.layers:
            x = block(x, cos, sin, cache, attend)
        if num_logits is not None:
            x = x[:, -num_logits:]
        return self._every_token(self.lm_head(self.norm(x)))  # [B, N, V]

    @torch.inference_mode()
    def forward_batch(self, passes: list[SequencePass]) -> list[torch.Tensor]:
        """One pass of several sequences, each over its own cache -> each one's logits [N_b, V],
        equal bit for bit to what its own ``forward`` gives. The passes cascade's CPU kernels would
        take alone (over a plain cache, at most ``fused_tokens`` rows) run in ``decoder_layers`` calls
        of at most ``MAX_KERNEL_ROWS`` rows, whose sequences share each read of the weights; every
        other pass runs as it would alone."""
        positions = [self._allocate(sequence) for sequence in passes]
        plains = [self._plain_pass(sequence) for sequence in passes]
        logits: list[torch.Tensor | None] = [None] * len(passes)
        rows = [len(sequence.token_ids) if plain else 0 for sequence, plain in zip(passes, plains, strict=True)]
        for group in shared_groups(rows):
            chosen = ([passes[i] for i in group], [positions[i] for i in group], [plains[i] for i in group])
            for index, row_logits in zip(group, self._forward_shared(*chosen), strict=True):
                logits[index] = row_logits
        for index, sequence in enumerate(passes):
            if plains[index] is None:
                ids, cache = sequence.token_ids[None], sequence.cache
                logits[index] = self.forward_at(ids, positions[index], cache, sequence.num_logits)[0]
        return logits

    def _allocate(self, sequence: SequencePass) -> torch.Tensor:
        """Positions [T] of the sequence's pass, allocated in its cache as ``forward`` allocates them."""
        count, cache, tree = len(sequence.token_ids), sequence.cache, sequence.tree
        return cache.allocate(count) if tree is None else cache.allocate_tree(count, tree)

    @property
    def shares_passes(self) -> bool:
        """Whether ``forward_batch`` runs sequences' short passes together (cascade's CPU kernels)."""
        x = self.embed_tokens.weight.new_empty(1, self.spec.hidden_size)  # [1, C]: the residual stream's dtype, device
        return self.fused_tokens > 0 and fused.decoder_layers_apply(x, self.spec.head_dim, is_quantised(self))

    def _plain_pass(self, sequence: SequencePass) -> fused.PlainPass | None:
        """The sequence's ``plain_pass`` where its pass alone would run in one ``decoder_layers`` call."""
        takes = len(sequence.token_ids) <= self.fused_tokens and self.shares_passes
        return sequence.cache.plain_pass() if takes else None

    def _forward_shared(
        self, passes: list[SequencePass], positions: list[torch.Tensor], plains: list[fused.PlainPass]
    ) -> list[torch.Tensor]:
        """``forward_batch`` of passes over plain caches, in one ``decoder_layers`` call."""
        tokens = [len(sequence.token_ids) for sequence in passes]
        x = self.embed_tokens(torch.cat([sequence.token_ids for sequence in passes]))  # [N, C]
        spec, scale = self.spec, self.layers[0].self_attn.scale
        cos, sin = self.rotary.cos_sin(torch.cat(positions), self.dtype)  # [N, D] each
        operands = self._kernel_operands()
        x = fused.decoder_layers(
            x, cos, sin, operands, plains, tokens, spec.rms_norm_eps, spec.num_heads, spec.num_kv_heads, scale
        )
        ends = list(itertools.accumulate(tokens))
        wanted = [min(sequence.num_logits or count, count) for sequence, count in zip(passes, tokens, strict=True)]
        rows = torch.cat([torch.arange(end - n, end) for end, n in zip(ends, wanted, strict=True)])  # [R]
        logits = fused.logits(x[rows.to(x.device)], self.norm.weight, projection(self.lm_head), self.norm.eps)
        return list(self._every_token(logits).split(wanted))  # [N_b, V] each

    def _forward_fused(
        self, x, cos, sin, cache: CachePolicy, attend: AttentionKernel, num_logits: int | None
    ) -> torch.Tensor:
        """``forward_at``'s blocks and head for one sequence's residual stream x [T, C] through the
        compiled kernels -> logits [1, N, K] of the kept tokens: over a plain cache
        (``CachePolicy.plain_pass``) every layer in one call where cascade's CPU kernels take the
        pass, else layer by layer."""
        spec = self.spec
        plain = cache.plain_pass() if fused.decoder_layers_apply(x, spec.head_dim, is_quantised(self)) else None
        if plain is not None:
            eps, scale, operands = spec.rms_norm_eps, self.layers[0].self_attn.scale, self._kernel_operands()
            x = fused.decoder_layers(
                x, cos, sin, operands, [plain], [len(x)], eps, spec.num_heads, spec.num_kv_heads, scale
            )
        else:
            for block in self.layers:
                x = block.forward_fused(x, cos, sin, cache, attend)
        if num_logits is not None:
            x = x[-num_logits:]
        return fused.logits(x, self.norm.weight, projection(self.lm_head), self.norm.eps)[None]
