"""Short passes as few kernels: decode steps, speculative proposals and verification passes (up to
``MAX_KERNEL_ROWS`` tokens on CPU, ``MAX_GRAPH_TOKENS`` on CUDA).

A short pass multiplies a few rows by every weight matrix: it is bound by reading the weights once,
and each layer also pays for a dozen small ops. On a CPU with AVX512-BF16, bf16 passes run each
layer's work before attention (RMSNorm, the QKV product, bias, rotary) and after it (the output
product, residual, RMSNorm, gate/up product, SiLU, down product, residual) as one C++ op each, and
the logits as a third (``cascade.kernels``, ``layer.cpp``): the products are cascade's kernels (AMX or AVX-512),
for bf16 weights or the int8 and 4-bit ones of ``cascade.quantise``, and no graph guard or wrapper runs per
layer (a SmolLM2 step at 1K: 20 ms, against 25 ms as compiled graphs around the same kernels).
Over a plain cache (``CachePolicy.plain_pass``: the full cache, a streaming one, a retrieval one
between selections) every layer of such a pass, its attention and K/V writes included, is a single
call (``decoder_layers``): no Python runs per layer, and with AVX512-BF16 the threads run the whole
pass in one parallel region, splitting each product and the attention among them.

Elsewhere (float32, or a CPU without those kernels) the same functions are compiled by
torch.compile (Inductor): one-row projections as a fused multiply-and-sum, one vectorised C++ loop
streaming the weight once, with the ops around it fused into the same kernels. Shapes are dynamic
but weights' are not: per model shape, a graph for one-token passes and one for wider passes
serves every layer and every cache length. A process's first pass traces and loads them: about 5 s
once Inductor's on-disk cache holds the compiled code, 8-16 s on a machine that has never compiled
them.

On CUDA the same functions become Triton kernels, and every pass ``cascade.graphs`` captures
takes them (several rows are projected by cuBLAS, the ops around the products fused). There a
graphed pass of a small model is bound by its kernel count, not by bytes: a SmolLM2 step over
4K-16K keys took 1.8-1.9 ms on an H100 as some twenty eager kernels per layer of 2-4 us each,
against 0.13-0.22 ms of memory traffic. Verification passes must shed their kernels too, or
fusing the steps alone would make every verification dearer next to a step.

Products accumulate in float32 (as the eager bf16 kernels do) and round to the model's dtype
where the eager path rounds; the result differs from the eager path only in summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cache.base import AttentionView
from cascade import kernels
from cascade.attention import FOLD_MAX_QUERIES, AttentionKernel
from cascade.panels import widened_product
from cascade.quantise import dense_quantised_product
from cascade.rope import apply_rotary
from cascade.tuning import machine_tuning

MAX_COMPILED_ATTENTION_KEYS = machine_tuning().compiled_attention_max_keys
"""Up to this many cached keys a one-query pass cascade's attention kernel does not take runs the
compiled attention kernel, beyond it the ``cpu`` family (``Tuning.compiled_attention_max_keys``)."""


cpu_layers = False
"""Whether bf16 passes of up to ``MAX_KERNEL_ROWS`` tokens on CPU run each layer's work around
attention (and the logits) as cascade's C++ ops (``cascade.kernels``, ``layer.cpp``) instead of the
compiled graphs: no graph guards, wrappers or small kernels per layer (set by ``use_cpu_kernels``)."""
quantised_kernels = False
"""Whether those ops take int8 and 4-bit weights (``cascade.quantise``) too, with cascade's kernels for
them (AVX512-VNNI or AVX2; set by ``use_cpu_kernels``); without them a quantised model's passes run the
compiled graphs."""
attention_kernel = False
"""Whether bf16 attention of these passes over an unmasked or causal view goes through cascade's
flash-decoding kernel on CPU (set by ``use_cpu_kernels``)."""
prefill_kernel = False
"""Whether a prefill chunk's bf16 attention goes through that kernel too (``attend_prefill``; set by
``use_cpu_kernels``): on builds with AVX512-BF16 and without AMX, where it was timed against PyTorch's
CPU flash kernel; elsewhere PyTorch's stays."""
PREFILL_SLICE_TOKENS = 32
"""Tokens of a prefill chunk per call of the kernel (its rows meet each block of keys together): a
chunk of 1,024 tokens over 8K and 32K keys, SmolLM2's heads and the Qwen2.5 1.5B's, took 0.30-0.33x
the time of PyTorch's CPU flash kernel (440-560 GFLOP/s against 140-170) on a 2-core Zen 5; slices
of 16 or 64 tokens took 1.03-1.11x as long as 32."""


def use_cpu_kernels() -> bool:
    """Route short bf16 passes' layers (and, where their kernels build, their quantised products and attention) through
    ``cascade.kernels`` where they build and run here; returns whether the layer ops do."""
    global cpu_layers, quantised_kernels, attention_kernel, prefill_kernel
    cpu_layers = kernels.weight_kernel_available()
    quantised_kernels = kernels.quantised_kernels_available()
    attention_kernel = kernels.attention_kernel_available()
    features = kernels.compiled_features() if attention_kernel else frozenset()
    prefill_kernel = "avx512_bf16" in features and "amx_bf16" not in features
    return cpu_layers


Weight = tuple[torch.Tensor, "torch.Tensor | None"]
"""A projection's weight [O, I] (or in panels, ``cascade.panels``) and, for a quantised one
(``cascade.quantise``), its scales."""


def _project(rows: torch.Tensor, weight: Weight) -> torch.Tensor:
    """rows [T, I] times weight [O, I] -> [T, O] in float32, reading the weight once: one row as a
    multiply-and-sum, several as a matrix product, a quantised weight (``cascade.quantise``) unpacked."""
    values, scales = weight
    if scales is not None:
        return dense_quantised_product(rows, values, scales)
    if values.dim() == 3:  # in panels (cascade.panels)
        return widened_product(rows, values)
    if rows.shape[0] == 1:
        return (values * rows[:, None]).sum(-1, dtype=torch.float32)  # [1, O, I] summed
    return F.linear(rows, values).float()


def _pre_attention(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    qkv_weight: Weight,
    qkv_bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual stream x [T, C] -> rotated query [1, H, T, D], rotated key and value [1, H_kv, T, D]."""
    normed = F.rms_norm(x, norm_weight.shape, norm_weight, eps)  # [T, C]
    qkv = _project(normed, qkv_weight)  # [T, (H + 2 H_kv) D]
    if qkv_bias is not None:
        qkv = qkv + qkv_bias
    qkv = qkv.to(x.dtype).unflatten(-1, (num_heads + 2 * num_kv_heads, -1)).transpose(0, 1)  # [H + 2 H_kv, T, D]
    rotated = apply_rotary(qkv[: num_heads + num_kv_heads], cos, sin)  # cos/sin [T, D]
    query, key, value = rotated[:num_heads], rotated[num_heads:], qkv[num_heads + num_kv_heads :]
    return query[None], key[None], value[None]


def _post_attention(
    x: torch.Tensor,
    attended: torch.Tensor,
    o_weight: Weight,
    norm_weight: torch.Tensor,
    gate_up_weight: Weight,
    down_weight: Weight,
    eps: float,
) -> torch.Tensor:
    """Residual stream x [T, C] and attention output rows [T, H D] -> the block's output [T, C]."""
    x = x + _project(attended, o_weight).to(x.dtype)
    normed = F.rms_norm(x, norm_weight.shape, norm_weight, eps)  # [T, C]
    gate, up = _project(normed, gate_up_weight).to(x.dtype).chunk(2, dim=-1)  # [T, F] each
    return x + _project(F.silu(gate) * up, down_weight).to(x.dtype)


def _logits(x: torch.Tensor, norm_weight: torch.Tensor, head_weight: Weight, eps: float) -> torch.Tensor:
    """Final hidden states x [N, C] -> logits [N, V]."""
    normed = F.rms_norm(x, norm_weight.shape, norm_weight, eps)  # [N, C]
    return _project(normed, head_weight).to(x.dtype)


def _attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per head [1, H, 1, D] over keys/values [1, H_kv, S, D] -> [1, H, 1, D].

    Each KV head's query group [G, D] meets its keys directly (no expansion); softmax in float32.
    """
    num_kv_heads, head_dim = keys.shape[1], keys.shape[3]
    groups = query.reshape(num_kv_heads, -1, head_dim)  # [H_kv, G, D]
    scores = (groups[:, :, None, :] * keys[0][:, None]).sum(-1, dtype=torch.float32) * scale  # [H_kv, G, S]
    weights = torch.softmax(scores, dim=-1)
    out = (weights[:, :, None, :] * values[0].transpose(1, 2)[:, None]).sum(-1)  # [H_kv, G, D]
    return out.to(query.dtype).reshape(1, -1, 1, head_dim)


_compiled_pre_attention = torch.compile(_pre_attention, dynamic=True)
_compiled_post_attention = torch.compile(_post_attention, dynamic=True)
_compiled_logits = torch.compile(_logits, dynamic=True)
compiled_attention = torch.compile(_attention, dynamic=True)


def _on_cpu_rows(x: torch.Tensor) -> bool:
    """Whether x [..., C] of a pass of any length takes cascade's elementwise layer ops (bf16 on a CPU
    where they run): a prefill chunk's rows are split across threads."""
    return cpu_layers and x.dtype == torch.bfloat16 and x.device.type == "cpu"


def _on_cpu_layers(x: torch.Tensor, *weights: Weight) -> bool:
    """Whether a pass with residual stream x [T, C] and these weights runs on cascade's layer ops."""
    short = _on_cpu_rows(x) and x.shape[0] <= kernels.MAX_KERNEL_ROWS
    return short and (quantised_kernels or all(scales is None for _, scales in weights))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] over its root mean square, times weight: on cascade's layer op where it runs (its
    float32 sums and one rounding, as the short passes' norms), else PyTorch's fused kernel."""
    if _on_cpu_rows(x):
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [N, C]
        return torch.ops.cascade_kernels.norm_rows(rows, weight, eps).view(x.shape)
    return F.rms_norm(x, weight.shape, weight, eps)


def silu_product(gate_up: torch.Tensor) -> torch.Tensor:
    """The gate and up projections [..., 2F] -> SiLU(gate) * up [..., F]: on cascade's layer op where
    it runs (one float32 product rounded once, as the short passes'), else two PyTorch ops."""
    if _on_cpu_rows(gate_up):
        rows = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()  # [N, 2F]
        return torch.ops.cascade_kernels.gated_rows(rows).view(*gate_up.shape[:-1], -1)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def pre_attention(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    qkv: Weight,
    qkv_bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual stream x [T, C] -> rotated query [1, H, T, D], rotated key and value [1, H_kv, T, D]."""
    if _on_cpu_layers(x, qkv):
        return torch.ops.cascade_kernels.pre_attention(
            x, norm_weight, *qkv, qkv_bias, cos, sin, eps, num_heads, num_kv_heads
        )
    return _compiled_pre_attention(x, norm_weight, qkv, qkv_bias, cos, sin, eps, num_heads, num_kv_heads)


def post_attention(
    x: torch.Tensor,
    attended: torch.Tensor,
    o: Weight,
    norm_weight: torch.Tensor,
    gate_up: Weight,
    down: Weight,
    eps: float,
) -> torch.Tensor:
    """Residual stream x [T, C] and attention output [1, H, T, D] -> the block's output [T, C]."""
    if _on_cpu_layers(x, o, gate_up, down):
        return torch.ops.cascade_kernels.post_attention(x, attended, *o, norm_weight, *gate_up, *down, eps)
    return _compiled_post_attention(x, attention_rows(attended), o, norm_weight, gate_up, down, eps)


def logits(x: torch.Tensor, norm_weight: torch.Tensor, head: Weight, eps: float) -> torch.Tensor:
    """Final hidden states x [N, C] -> logits [N, V]."""
    if _on_cpu_layers(x, head):
        return torch.ops.cascade_kernels.logits(x, norm_weight, *head, eps)
    return _compiled_logits(x, norm_weight, head, eps)


LayerOperands = tuple[list[torch.Tensor], list[torch.Tensor], list["torch.Tensor | None"], list["torch.Tensor | None"]]
"""Every layer's (norms, projection weights, their quantisation scales, qkv bias) in ``decoder_layers``' order:
per layer the input and post-attention norms; the qkv, o, gate/up and down weights and scales; the bias."""


def decoder_layers_apply(x: torch.Tensor, head_dim: int, quantised: bool) -> bool:
    """Whether ``decoder_layers`` can run a pass with residual stream x [T, C] over layers of this
    head size, their projections quantised (``cascade.quantise``) or not."""
    ours = head_dim in kernels.ATTENTION_HEAD_SIZES and (quantised_kernels or not quantised)
    return attention_kernel and ours and _on_cpu_layers(x)


PlainPass = tuple[torch.Tensor, torch.Tensor, int]
"""A cache's ``plain_pass``: keys, values [L, 1, H_kv, slots, D] and the pass's first slot."""


def decoder_layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    operands: LayerOperands,
    passes: list[PlainPass],
    tokens: list[int],
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Every layer of a pass over plain KV caches (``CachePolicy.plain_pass``) in one C++ call:
    residual stream x [N, C] of one or more sequences, ``tokens[b]`` rows of sequence b after those
    of the sequences before it -> the last layer's output [N, C], each sequence's K/V written into
    its ``passes[b]``' keys / values from its first slot. What each layer's ``pre_attention``, cache
    update, ``attend`` and ``post_attention`` compute, without Python between them; the sequences
    share each read of the weights, and each row's result is the same as in a pass of its own."""
    keys, values, starts = (list(column) for column in zip(*passes, strict=True))
    return torch.ops.cascade_kernels.decoder_layers(
        x, *operands, keys, values, starts, tokens, cos, sin, eps, num_heads, num_kv_heads, scale
    )


def attention_rows(attended: torch.Tensor) -> torch.Tensor:
    """Attention output [1, H, T, D] -> rows [T, H D] with the strides of a fresh tensor (a view
    where the layout allows, else a copy). The compiled kernels guard on their inputs' strides,
    a size-1 dimension's included, and each attention kernel lays its output out its own way:
    without this each layout would compile (and count toward Dynamo's recompile limit) anew."""
    return attended[0].transpose(0, 1).reshape(-1).view(attended.shape[2], -1)


def kernel_takes(query: torch.Tensor) -> bool:
    """Whether cascade's attention kernel takes queries [B, H, T, D]: bf16 on CPU, one sequence, a
    head size it was built for."""
    on_cpu, one = query.device.type == "cpu", query.shape[0] == 1
    return on_cpu and one and query.dtype == torch.bfloat16 and query.shape[-1] in kernels.ATTENTION_HEAD_SIZES


def attend(query: torch.Tensor, view: AttentionView, scale: float, family: AttentionKernel) -> torch.Tensor:
    """Queries [1, H, T, D] over the view -> [1, H, T, D]: on CPU, bf16 over an unmasked, causal or
    token-tree view (masked in its tail alone: each node reads what its decode step would, so the
    verifier's logits equal the steps' bit for bit) through cascade's flash-decoding kernel, else one
    query per head over a short unmasked cache through the compiled kernel; everything else through
    the model's attention ``family``."""
    if attention_kernel and kernel_takes(query):
        keys, values = view.keys[0], view.values[0]
        if view.mask is None:
            return torch.ops.cascade_kernels.decode_attention(query[0], keys, values, scale, view.causal)[None]
        if view.masked_tail:  # a token tree's pass: each node reads what its decode step would, bit for bit
            tail = view.mask[:, -view.masked_tail :] == 0  # [T, M]
            return torch.ops.cascade_kernels.decode_attention_tree(query[0], keys, values, scale, tail)[None]
    one_query = query.shape[2] == 1 and query.device.type == "cpu"
    if one_query and view.mask is None and view.keys.shape[2] <= MAX_COMPILED_ATTENTION_KEYS:
        return compiled_attention(query, view.keys, view.values, scale)
    return family(query, view, scale)


def attend_prefill(query: torch.Tensor, view: AttentionView, scale: float, family: AttentionKernel) -> torch.Tensor:
    """A pass's attention outside the fused layers, queries [1, H, T, D] over the view -> [1, H, T, D]:
    a prefill chunk (more than ``FOLD_MAX_QUERIES`` tokens) in bf16 over a causal or unmasked view
    through cascade's kernel where ``prefill_kernel``, ``PREFILL_SLICE_TOKENS`` of its tokens a call;
    everything else through the model's attention ``family``. A token's row is the same bits however
    the chunk is sliced (the kernel's key blocks start at key 0, and keys past a row's last visible
    one weigh exact zeros): the row its decode step would compute."""
    long_pass = query.shape[2] > FOLD_MAX_QUERIES and view.mask is None
    if not (prefill_kernel and long_pass and kernel_takes(query)):
        return family(query, view, scale)
    tokens, num_keys = query.shape[2], view.keys.shape[2]
    out = torch.empty_like(query[0])  # [H, T, D]
    for start in range(0, tokens, PREFILL_SLICE_TOKENS):
        end = min(tokens, start + PREFILL_SLICE_TOKENS)
        seen = num_keys - tokens + end if view.causal else num_keys  # the slice's tokens end its keys
        keys, values = view.keys[0, :, :seen], view.values[0, :, :seen]
        out[:, start:end] = torch.ops.cascade_kernels.decode_attention(
            query[0, :, start:end], keys, values, scale, view.causal
        )
    return out[None]
