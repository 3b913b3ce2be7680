"""How one step of a Llama-family model runs, and its LM head: compiled CPU kernels where they fit.

The model (``segserve.models.llama``) is plain PyTorch; :class:`CpuStep` reads its layer modules and picks,
per step, when the compiled CPU kernels (``segserve.kernels.cpu``, float32/bfloat16 on an AVX-512 CPU)
are switched on and every projection has a shape they take:

- a decode-only step (one row per request, at most ``MAX_DECODE_STACK_ROWS_DENSE`` rows, or for
  GGUF-block models ``MAX_DECODE_STACK_ROWS_BLOCKS``, or for dense bfloat16 models with tile copies
  ``MAX_DECODE_STACK_ROWS_TILES``)
  over the segmented backend: every layer in one C call (``DecodeStack``), with the projections of a
  dense bfloat16 model as tile products of the prepacked weights from ``AMX_STACK_MIN_ROWS`` rows on
  AMX, from ``TILE_STACK_MIN_ROWS`` on vdpbf16ps register tiles without it;
- any other step of at most ``MAX_SMALL_ROWS`` rows: each layer as four compiled linears with the norms,
  the SiLU gate and the residual adds fused in, plus the backend's attention (:func:`forward_small`);
- larger steps (prefill chunks, big decode batches): oneDNN's GEMMs for the projections, and between
  them the compiled row kernels: each residual add fused with the next RMSNorm, the SiLU gate, RoPE in
  place (:func:`forward_chunk`; the eager ops they replace were ~15 % of a 512-token bfloat16 step).
  bfloat16 steps of at least ``AMX_MIN_ROWS`` rows on a CPU with AMX (``segserve.kernels.amx``) run the
  projections as AMX GEMMs instead, on the tile-packed weights :meth:`CpuStep.prepack` made, with the
  SiLU gate fused into the gate/up GEMM's stores. On a CPU without AMX the same steps run those GEMMs
  in AVX-512 BF16 register tiles (``segserve.kernels.bf16gemm``, vdpbf16ps) on the same tile-packed
  weights (:func:`tile_gemm` picks). GGUF-block projections (``QuantLinear``) of such a step are
  dequantized to bfloat16 and packed per call, then run on that GEMM (:func:`quant_on_tiles`), instead
  of oneDNN on the dequantized weight.

Otherwise (kernels off or unbuilt, another dtype or device, a weight shape they do not take) the model's
own forward. The LM head alike: the compiled linear for a few rows, else the oneDNN-packed copy
(:meth:`CpuStep.prepack`), else the model's ``compute_logits``.
"""

from __future__ import annotations

import torch

from segserve.attention.kv_store import write_kv
from segserve.attention.metadata import AttentionMetadata, check_real_rows, decode_view
from segserve.attention.segmented import SegmentedAttentionBackend
from segserve.kernels import amx, bf16gemm, quant
from segserve.kernels import cpu as cpu_kernels
from segserve.kernels.gguf_blocks import QuantWeight
from segserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from segserve.models.packed_linear import PackedLinear, pack_weight, packed_linear
from segserve.models.quant_linear import SMALL_ROWS as QUANT_SMALL_ROWS
from segserve.models.quant_linear import QuantLinear, dequantize_weight, quantized_matmul, row_kernel_takes

# rope_'s own limit, checked once per dtype here rather than failing inside a step.
_MAX_ROPE_HEAD_DIM = 1024
# Fewest rows a bfloat16 step needs to take the AMX GEMMs: every step the small-batch path leaves.
# benchmarks/bench_amx_gemm.py (2 threads, this model's shapes): the AMX GEMM beats oneDNN's packed one
# from 9 rows up (table in segserve/models/packed_linear.py), so with AMX the oneDNN copy of the
# bfloat16 projections is never read and prepack() does not make it. Without AMX the vdpbf16ps GEMM
# (bf16gemm) takes the same steps: at 9 rows it beat oneDNN's packed GEMM 1.41-1.88x on this model's
# shapes (benchmarks/bench_bf16gemm.py, Zen 4, 2 threads, load 2.9; table in docs/perf.md).
AMX_MIN_ROWS = cpu_kernels.MAX_SMALL_ROWS[torch.bfloat16] + 1
# Fewest rows a dense bfloat16 decode-only step needs for the decode stack to run its projections (and
# the LM head) as AMX tile products rather than vdpbf16ps register tiles: 1, every such step. Interleaved
# per step (benchmarks/profile_bf16_decode.py --mode ab, the export, 256-token contexts, 2 threads, quiet
# AMX Xeon, load 0.4-1.4, 2026-12-04): b=1 32.4 -> 12.7 ms median, b=2 30.0 -> 13.1 (one row of a 16-row
# tile still streams each weight once, through the tile unit, where the register tiles' 4 x 4 dot
# products on this CPU's vdpbf16ps ran at ~10 GB/s). An earlier loaded-host A/B (1 thread, load 3.9-4.4)
# had kept b=1 on the register tiles: b=2 51.7 -> 33.7 ms, b=4 68.8 -> 39.4, b=8 92.2 -> 45.7.
AMX_STACK_MIN_ROWS = 1
# The same without AMX: fewest rows for the decode stack's projections to run as vdpbf16ps products of
# the packed weights (bf16gemm's micro-kernel, 6 rows x 64 columns a tile, the weights read once per
# step) rather than its per-row register tiles (4 x 4 dot products reduced across lanes). Interleaved per
# step (the bf16 export, 300-token contexts, 2 threads, AMD EPYC Zen 4, load ~1.1, 2026-12-03; the register
# tiles' step includes the fused LM head): 8 rows 14.3 vs 15.3 ms with the tiles, 12 rows 20.7 vs 19.8, 16
# rows 22.2 vs 21.7, 32 rows 43.1 vs 37.2, 64 rows 84.5 vs 63.2.
TILE_STACK_MIN_ROWS = 16
# Most rows whose AMX LM head runs as amx.rows_linear (the weight streamed once through one-row-pair
# tiles) rather than amx.linear (the tile GEMM); the two give the same bits. Since the GEMM keeps a
# weight column chunk in one thread for few rows (2026-12-04), it reads the 56 MB head as fast or
# faster from memory: /tmp harness, cache evicted between calls, 2 threads, AMX Xeon, 2026-12-05: 1 row
# 2.34 vs 2.26 ms, 16 rows 2.72 vs 2.34, 32 rows 3.24 vs 2.86, 64 rows 4.86 vs 3.71. In the engine
# (benchmarks/profile_bf16_decode.py --batches 64 --prompt-len 300 --reps 15, fresh processes
# alternating, 3 pairs, with 32 as this limit) a 64-row step 57.1-58.8 -> 55.5-56.1 ms; with 8, 16- and
# 32-row steps were equal within noise (21.0-21.7 vs 21.7-21.9, 33.0-33.9 vs 33.7-33.8 ms) and batch 1
# noisy either way (10.2-10.9 vs 11.0-12.2 ms), so up to 32 rows keep rows_linear.
HEAD_ROWS_LINEAR_MAX = 32


class CpuStep:
    """Runs the steps and the LM head of one model the fastest way that fits (module docstring).

    Holds the packed LM head, the per-dtype answer to "do the weights fit the kernels" and the compiled
    decode step (pointers to every weight, built once per dtype and cache shape); the KV caches are
    passed with each step and never held. One per model runner; several may share a model.

    Args:
        model: the model whose modules the compiled paths read.
    """

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._packed_lm_head: torch.Tensor | None = None
        self._kernel_fit: dict[torch.dtype, bool] = {}
        # Whether any projection is GGUF blocks: asked every step, and walking model.modules() for it
        # cost 0.7-0.9 ms a batch-1 step (timed alone, load 6.5); forgotten with the fit answers.
        self._has_blocks: bool | None = None
        self._stack: cpu_kernels.DecodeStack | None = None
        self._stack_key: tuple | None = None
        # Per layer (qkv, o, gate_up, down) in amx.pack's tile layout, when prepack() made them: read by
        # the AMX GEMM or, without AMX, by bf16gemm (tile_gemm()); the decode stack takes them on AMX only.
        self._tile_weights: list[tuple[torch.Tensor, ...]] | None = None
        # The LM head in the same layout, made with them (instead of the oneDNN copy).
        self._tile_lm_head: torch.Tensor | None = None
        # (hidden, logits) of the last decode-stack step that computed its head in the same call, for
        # logits_of; forgotten when read or when another step runs.
        self._step_logits: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepack(self) -> int:
        """Pre-pack every projection and the LM head for oneDNN (float32 or bfloat16 on CPU; see
        ``segserve.models.packed_linear``), or, for bfloat16 projections where a tile GEMM runs (AMX, or
        without it bf16gemm: :func:`tile_gemm`), in ``amx.pack``'s tile layout instead
        (:func:`forward_chunk` reads that copy for every step over ``MAX_SMALL_ROWS`` rows, so a oneDNN
        copy would go unread); the LM head goes to tiles with AMX only. Idempotent; call again after
        changing or replacing weights, or after switching AMX or bf16gemm on or off (it also forgets the
        kernel-fit answers and the compiled decode step, which hold the weights).

        Costs one extra copy of the packed weights (the plain ones stay for ``state_dict``).
        Returns how many weights are packed (0 for other dtypes or devices, or without oneDNN).
        """
        model = self.model
        self._tile_weights = tile_layer_weights(model)
        linears = [m for m in _linears(model) if isinstance(m, PackedLinear)]  # blocks are not repacked
        if self._tile_weights is not None:
            tiled = {id(m) for ly in model.layers for m in _layer_linears(ly)}
            for m in linears:
                if id(m) in tiled:
                    m.unpack()
            linears = [m for m in linears if id(m) not in tiled]
        count = sum(m.pack() for m in linears) + (0 if self._tile_weights is None else 4 * len(model.layers))
        self._kernel_fit.clear()  # weights may have changed shape, dtype or layout
        self._has_blocks = None
        self._stack_key = self._stack = None  # and the compiled decode step holds pointers to them
        self._tile_lm_head = None
        if model.quantized_lm_head is not None:  # kept in blocks: nothing to pack
            self._packed_lm_head = None
        elif self._tile_weights is not None and tile_gemm() is amx and amx.supports(model.lm_head_weight) \
                and (model.lm_head is None or model.lm_head.bias is None):
            # Decode steps of up to HEAD_ROWS_LINEAR_MAX rows (amx.rows_linear) and more (amx.linear) read it.
            if model.lm_head is not None:
                model.lm_head.unpack()
            self._packed_lm_head = None
            self._tile_lm_head = amx.pack(model.lm_head_weight)
            return count + (model.lm_head is None)
        elif model.lm_head is None:  # tied: the LM head reads the embedding matrix
            self._packed_lm_head = pack_weight(model.embed_tokens.weight)
        else:
            self._packed_lm_head = model.lm_head.packed_weight
        return count + (model.lm_head is None and self._packed_lm_head is not None)

    def unpack(self) -> None:
        """Drop every packed copy: projections and LM head go back to ``F.linear``."""
        for m in _linears(self.model):
            if isinstance(m, PackedLinear):
                m.unpack()
        self._packed_lm_head = None
        self._tile_weights = None
        self._tile_lm_head = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata, logits_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """One step, as ``LlamaForCausalLM.forward`` takes and returns it (equal within summation order).

        Args:
            input_ids: ``(T,)`` int64 token ids (T may include padding rows).
            positions: ``(T,)`` int64 absolute positions.
            kv_caches: one ``[2, num_blocks, block_size, Hkv, D]`` tensor per layer, written in place.
            metadata: the step's attention metadata.
            logits_rows: the rows whose hidden states the caller reads, or None for all. A step on the
                many-row path (:func:`forward_chunk`) then runs its last layer on those rows alone
                (:func:`last_layer_rows`); every row's K/V is written either way.

        Returns:
            ``(T, H)`` hidden states after the final norm; with ``logits_rows``, rows outside it may hold
            other values.

        Raises:
            ValueError: when ``len(kv_caches)`` is not the number of layers, when a row of
                ``logits_rows`` is not a real row of the step, or (from the kernels, before anything is
                written) a slot or block id lies outside the caches.
        """
        model = self.model
        self._step_logits = None
        check_real_rows(metadata, logits_rows or (), "logits row")
        dtype, device = model.activation_dtype, model.norm.weight.device
        if not self._kernels_fit(dtype, device):
            return model(input_ids, positions, kv_caches, metadata)
        rows = input_ids.shape[0]
        small = rows <= cpu_kernels.MAX_SMALL_ROWS[dtype]
        model.check_kv_caches(kv_caches)
        stack = self.decode_stack(input_ids, kv_caches, metadata)
        if not small and stack is None:
            tiles = self._tile_weights if self._tiles_fit(dtype, rows) else None
            return forward_chunk(model, input_ids, positions, kv_caches, metadata, tiles, logits_rows)
        h = model.embed_tokens(input_ids)  # (T, H)
        cos, sin = model.rope_at(positions)  # (T, D) float32 each, shared by all layers
        if stack is not None:  # a decode-only step: every layer in one compiled call
            tiles = self._stack_tiles(stack, rows)  # a dense bfloat16 step: tile products, or None
            head = None if tiles else self._stack_head(rows, dtype)
            stack.run(kv_caches, h, cos, sin, metadata.slot_mapping, metadata.block_table,
                      metadata.seq_lens.long(), metadata.kv_segment_size, model.layers[0].self_attn.scale,
                      int8_formats=quant.int8_formats(rows), tiles=tiles, head=head)
            if head is not None:  # the final norm and the logits came out of the same call
                self._step_logits = (head.hidden, head.logits)
                return head.hidden
            # forward_chunk's final norm (sg_rows): the AMX step then equals it bit for bit, and one call
            # instead of PyTorch's six ops is ~0.1 ms of a ~7 ms batch-1 step.
            return cpu_kernels.add_rmsnorm_(h, model.norm.weight, model.norm.eps)
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            h = forward_small(layer, h, cos, sin, kv_cache, metadata)
        return cpu_kernels.add_rmsnorm_(h, model.norm.weight, model.norm.eps)  # as the stack's

    def decode_stack(
        self, rows: torch.Tensor, kv_caches: list[torch.Tensor], metadata: AttentionMetadata
    ) -> cpu_kernels.DecodeStack | None:
        """The compiled whole-step path for a step of ``rows`` (its ``(T,)`` ids or ``(T, H)`` states)
        when :meth:`_stack_takes` the step (decodes only, within its row limit, over the segmented
        backend) and its caches; else None. The C step computes the segmented backend's attention
        itself, so a step over any other backend (the reference oracle) goes through that backend.
        Built once per dtype and cache shape, with the tile copies of the projections when
        :meth:`prepack` made them and a tile GEMM runs: it holds the weight tensors, so after replacing
        one (not editing it in place) call :meth:`prepack` again, as for the packed copies."""
        model = self.model
        if not self._stack_takes(rows, metadata):
            return None
        dtype = model.activation_dtype
        tile_weights = self._tile_weights if self._tiles_fit(dtype, AMX_MIN_ROWS) else None
        key = (dtype, kv_caches[0].shape, len(kv_caches), tile_weights is not None)
        if self._stack_key != key:
            self._stack_key = key
            self._stack = None
            c = model.config
            if all(cpu_kernels.supports_cache(kv, dtype, c.num_attention_heads) for kv in kv_caches):
                try:
                    self._stack = cpu_kernels.DecodeStack(
                        decode_stack_layers(model, kv_caches), c.num_attention_heads, c.num_key_value_heads,
                        c.head_dim, c.rms_norm_eps, tile_weights,
                    )
                except ValueError:  # a shape the whole-step kernel does not take: per-layer path
                    self._stack = None
        return self._stack

    def _stack_tiles(self, stack: cpu_kernels.DecodeStack, rows: int) -> str | None:
        """``DecodeStack.run``'s ``tiles`` for a decode-only step of ``rows`` rows: ``"amx"`` from
        ``AMX_STACK_MIN_ROWS`` rows where AMX runs, ``"vdpbf16ps"`` from ``TILE_STACK_MIN_ROWS`` where
        bf16gemm does, for a stack built with tile weights; else None (the per-row register tiles)."""
        if not stack.tiled:
            return None
        gemm = tile_gemm()
        if gemm is amx and rows >= AMX_STACK_MIN_ROWS:
            return "amx"
        if gemm is bf16gemm and rows >= TILE_STACK_MIN_ROWS:
            return "vdpbf16ps"
        return None

    def decode_stack_rows(self) -> int:
        """Rows up to which a decode-only step may run the one-call decode stack:
        ``MAX_DECODE_STACK_ROWS_BLOCKS`` for a model with GGUF-block projections,
        ``MAX_DECODE_STACK_ROWS_TILES`` for a dense bfloat16 one whose tile copies :meth:`prepack` made
        (while a tile GEMM, AMX or vdpbf16ps, stays on), ``MAX_DECODE_STACK_ROWS_DENSE`` for other dense
        ones, in the model's activation dtype (0 for a dtype the kernels do not take). The simulator's
        ``eager_step`` feature follows it (``StepComposition.stack_rows``)."""
        if self._has_blocks is None:
            self._has_blocks = any(isinstance(m, QuantLinear) for m in _linears(self.model))
        dtype = self.model.activation_dtype
        if self._has_blocks:
            limits = cpu_kernels.MAX_DECODE_STACK_ROWS_BLOCKS
        elif self._tiles_fit(dtype, AMX_MIN_ROWS):
            limits = cpu_kernels.MAX_DECODE_STACK_ROWS_TILES
        else:
            limits = cpu_kernels.MAX_DECODE_STACK_ROWS_DENSE
        return limits.get(dtype, cpu_kernels.MAX_SMALL_ROWS.get(dtype, 0))

    def _stack_takes(self, rows: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Whether a step of ``rows`` (its ``(T,)`` ids or ``(T, H)`` states) is one the decode stack
        takes: decodes only (one row per request) over the segmented backend, and at most
        :meth:`decode_stack_rows` rows (the float32 block kernel takes any row count and beats the
        per-layer GEMMs up to 64; so do the AMX tile products of a dense bfloat16 model)."""
        return (
            rows.shape[0] <= self.decode_stack_rows()
            and metadata.max_query_len == 1 and metadata.num_actual_tokens == metadata.num_reqs
            and getattr(self.model.layers[0].self_attn.attn_backend, "name", None)
            == SegmentedAttentionBackend.name
        )

    def _stack_head(self, rows: int, dtype: torch.dtype) -> cpu_kernels.StackHead | None:
        """The final norm and LM head for the decode stack to run in its own call (``DecodeStack.run``'s
        ``head``), when :meth:`compute_logits` would take the same kernel for ``rows`` rows (so the logits
        are its bits): GGUF blocks up to ``quant_linear.SMALL_ROWS`` rows (``quant.linear``), or a dense
        head of the activation dtype up to ``MAX_SMALL_ROWS`` without an AMX tile copy
        (``cpu_kernels.linear``); else None."""
        model = self.model
        weight = model.quantized_lm_head
        if weight is not None:
            if not row_kernel_takes(rows, dtype):
                return None
        else:
            weight = model.lm_head_weight
            if self._tile_lm_head is not None or not self._dense_head_on_linear(rows, dtype):
                return None
        return cpu_kernels.StackHead(
            model.norm.weight, weight, torch.empty(rows, weight.shape[1], dtype=dtype),
            torch.empty(rows, weight.shape[0], dtype=torch.float32),
        )

    def logits_of(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``compute_logits(hidden[rows])``: ``(len(rows), vocab)`` float32, a tensor the caller owns
        (it may edit it in place). When ``hidden`` is what :meth:`forward` just returned from a
        decode-stack step that computed its logits in the same call, those rows of them (the same bits):
        the step's own buffer when ``rows`` are its first rows (a batch of decodes: no copy; indexing
        one 49,152-logit row with a list took ~0.2 ms of a ~7 ms batch-1 step), else a copy; otherwise
        the LM head runs now."""
        fused, self._step_logits = self._step_logits, None
        if fused is not None and fused[0] is hidden:
            logits = fused[1]  # (M, vocab), allocated for this step alone (_stack_head)
            if rows == list(range(len(rows))):
                return logits[: len(rows)]
            return logits[rows]
        return self.compute_logits(hidden[rows])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, H)`` hidden states -> ``(N, vocab)`` float32 logits, as the model's ``compute_logits``
        (equal within summation order; bfloat16 packed results bitwise): from ``AMX_STACK_MIN_ROWS`` rows
        the AMX tile copy :meth:`prepack` made when there is one (``amx.rows_linear`` up to
        ``HEAD_ROWS_LINEAR_MAX`` rows, ``amx.linear`` above; rounded to bfloat16 first, as the others),
        else the compiled linear for up to ``MAX_SMALL_ROWS`` rows, else oneDNN's packed copy."""
        quantized = self.model.quantized_lm_head
        if quantized is not None:
            return quantized_matmul(hidden, quantized, out_dtype=torch.float32)
        weight = self.model.lm_head_weight
        tiles = self._tile_lm_head
        if tiles is not None and hidden.dtype == tiles.dtype and hidden.shape[0] >= AMX_STACK_MIN_ROWS \
                and amx.available():
            n, k = weight.shape
            if hidden.shape[0] <= HEAD_ROWS_LINEAR_MAX:  # weights streamed once, prefetched
                return amx.rows_linear(hidden.contiguous(), tiles, n, k).float()
            return amx.linear(hidden.contiguous(), tiles, n, k).float()
        if hidden.device.type == "cpu" and self._dense_head_on_linear(hidden.shape[0], hidden.dtype):
            return cpu_kernels.linear(hidden.contiguous(), weight, out_dtype=torch.float32)
        packed = self._packed_lm_head
        if packed is not None and hidden.dtype == weight.dtype == packed.dtype:
            return packed_linear(hidden, packed, None).float()
        return self.model.compute_logits(hidden)

    def _dense_head_on_linear(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether the dense LM head multiplies ``rows`` rows of ``dtype`` with the compiled linear
        (``cpu_kernels.linear``): its weight in that dtype and shape, up to ``MAX_SMALL_ROWS`` rows."""
        weight = self.model.lm_head_weight
        return (
            weight.dtype == dtype and rows <= cpu_kernels.MAX_SMALL_ROWS.get(dtype, 0)
            and cpu_kernels.supports_linear(weight) and cpu_kernels.enabled()
        )

    def _tiles_fit(self, dtype: torch.dtype, rows: int) -> bool:
        """Whether a step of ``rows`` rows in ``dtype`` takes a tile GEMM (:func:`tile_gemm`): bfloat16,
        at least ``AMX_MIN_ROWS`` rows, tile copies made by :meth:`prepack` and a tile GEMM switched on."""
        return (
            dtype == torch.bfloat16 and rows >= AMX_MIN_ROWS and self._tile_weights is not None
            and self._tile_weights[0][0].dtype == dtype and tile_gemm() is not None
        )

    def _kernels_fit(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a step with activations of ``dtype`` on ``device`` can use the compiled CPU kernels:
        switched on and built, a supported dtype on the CPU, and weights of that dtype in shapes the
        kernels take (asked once per dtype)."""
        if dtype not in cpu_kernels.MAX_SMALL_ROWS or device.type != "cpu" or not cpu_kernels.enabled():
            return False
        model = self.model
        if model.activation_dtype != dtype:
            return False
        if self._has_blocks is None:
            self._has_blocks = any(isinstance(m, QuantLinear) for m in _linears(model))
        if self._has_blocks and not quant.enabled():
            return False  # SEGSERVE_QUANT=0: the model's own (dequantize-then-matmul) forward
        fits = self._kernel_fit.get(dtype)
        if fits is None:
            linears = _linears(model)
            fits = model.config.head_dim <= _MAX_ROPE_HEAD_DIM and all(
                isinstance(m, QuantLinear)
                or (cpu_kernels.supports_linear(m.weight) and m.weight.dtype == dtype)
                for m in linears
            )
            self._kernel_fit[dtype] = fits
        return fits


def forward_small(
    layer: LlamaDecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """``layer`` for a few rows in compiled linears that stream each weight once, with the norms, the
    SiLU gate and the residual adds fused in: ``h`` ``(T, H)`` contiguous, ``T <= MAX_SMALL_ROWS``,
    updated in place and returned; ``cos``/``sin`` ``(T, D)`` float32 rows of the RoPE table."""
    attn, mlp, ln1, ln2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
    qkv = _small_linear(
        attn.qkv_proj, h, attn.qkv_proj.bias, prologue="rmsnorm", norm_weight=ln1.weight, eps=ln1.eps,
    )  # (T, (Hq + 2 Hkv) D)
    out = attn.attend(qkv, cos, sin, kv_cache, metadata, cpu_kernels.rope_)  # (T, Hq D)
    _small_linear(attn.o_proj, out, residual=h)  # h += o_proj(out)
    gate_up = _small_linear(
        mlp.gate_up_proj, h, prologue="rmsnorm", norm_weight=ln2.weight, eps=ln2.eps
    )  # (T, 2 I)
    return _small_linear(mlp.down_proj, gate_up, prologue="silu_mul", residual=h)


def _small_linear(module: PackedLinear | QuantLinear, x: torch.Tensor, bias: torch.Tensor | None = None,
                  **kwargs) -> torch.Tensor:
    """The compiled small-batch linear of ``module``'s weight: plain (``cpu.linear``) or GGUF blocks
    (``quant.linear``), with the same prologue and residual keywords."""
    if isinstance(module, QuantLinear):
        return quant.linear(x, module.quant_weight, bias, **kwargs)
    return cpu_kernels.linear(x, module.weight, bias, **kwargs)


def _kernel_weight(module: PackedLinear | QuantLinear) -> torch.Tensor | QuantWeight:
    """What the compiled decode step reads for ``module``: its plain weight or its blocks."""
    return module.quant_weight if isinstance(module, QuantLinear) else module.weight.detach()


def forward_chunk(
    model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
    metadata: AttentionMetadata, tile_weights: list[tuple[torch.Tensor, ...]] | None = None,
    logits_rows: list[int] | None = None,
) -> torch.Tensor:
    """The model's forward for a step of many rows: the projections as the layers' own linears (oneDNN
    packed GEMMs), or with ``tile_weights`` (:func:`tile_layer_weights`) as :func:`tile_gemm`'s GEMMs
    (AMX, else bf16gemm) with the SiLU gate fused into the gate/up one's stores and, on AMX, RoPE and the
    KV write into the QKV one's (:func:`rope_kv_tables`); the elementwise work between them in compiled
    row passes instead of ~15 eager ops: ``h += branch`` fused with the next RMSNorm (the last layer's
    with the final norm), the SiLU gate, RoPE in place. Same rounding points as the eager model, so
    equal to it within the norms' (and the GEMMs') summation order.
    ``input_ids``/``positions`` ``(T,)``; returns ``(T, H)`` after the final norm. With ``logits_rows``
    the last layer runs only those rows (:func:`last_layer_rows`) and the other rows of the result are
    unspecified."""
    model.check_kv_caches(kv_caches)
    h = model.embed_tokens(input_ids)  # (T, H)
    cos, sin = model.rope_at(positions)  # (T, D) float32 each
    fused = rope_kv_tables(model, cos, sin, kv_caches, tile_weights)  # (T, D) bfloat16 each, or None
    layers = model.layers
    first = layers[0].input_layernorm
    x = cpu_kernels.add_rmsnorm_(h, first.weight, first.eps)  # (T, H)
    branch = None
    for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
        attn, mlp = layer.self_attn, layer.mlp
        packed = (None,) * 4 if tile_weights is None else tile_weights[i]
        if branch is not None:  # the previous layer's MLP output joins h, then this layer's norm
            ln1 = layer.input_layernorm
            cpu_kernels.add_rmsnorm_(h, ln1.weight, ln1.eps, add=branch, out=x)
        if fused is not None:  # RoPE and the KV write in the QKV GEMM's stores
            rope = amx.RopeKV(attn.num_heads, attn.num_kv_heads, attn.head_dim, *fused, kv_cache,
                              metadata.slot_mapping)
            proj = attn.qkv_proj
            qkv = amx.linear(x, packed[0], proj.out_features, proj.in_features, proj.bias, rope_kv=rope)
        else:
            qkv = _project(attn.qkv_proj, x, packed[0])  # (T, (Hq + 2 Hkv) D)
        if logits_rows is not None and i == len(layers) - 1:
            return last_layer_rows(model, h, qkv, fused is None, cos, sin, kv_cache, metadata, packed,
                                   logits_rows)
        if fused is not None:
            out = attn.attend_rotated(qkv, kv_cache, metadata)  # (T, Hq D)
        else:
            out = attn.attend(qkv, cos, sin, kv_cache, metadata, cpu_kernels.rope_)  # (T, Hq D)
        ln2 = layer.post_attention_layernorm
        cpu_kernels.add_rmsnorm_(h, ln2.weight, ln2.eps, add=_project(attn.o_proj, out, packed[1]), out=x)
        act = _project(mlp.gate_up_proj, x, packed[2], silu_mul=True)  # (T, I)
        branch = _project(mlp.down_proj, act, packed[3])  # (T, H)
    return cpu_kernels.add_rmsnorm_(h, model.norm.weight, model.norm.eps, add=branch)


def last_layer_rows(
    model: LlamaForCausalLM, h: torch.Tensor, qkv: torch.Tensor, rotate: bool, cos: torch.Tensor,
    sin: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
    packed: tuple[torch.Tensor | None, ...], rows: list[int],
) -> torch.Tensor:
    """The last layer and the final norm of :func:`forward_chunk` for ``rows`` of the step only.

    Every row's K and V still go to the cache (later steps attend to them), so the QKV projection (the
    caller's, as in every layer), RoPE and the KV write run on all ``T`` rows; the attention, the output
    projection, the MLP and the final norm run on the ``n`` rows whose logits the step samples or scores.
    A chunk's row then attends as a decode of its own position
    (:func:`segserve.attention.metadata.decode_view`), which is the same causal attention. What it saves
    is ~1/L of a prefill chunk's work (a 4,096-token step of a 30-layer model: ~3 %). llama.cpp computes
    its last layer for the output rows alone the same way (``inp_out_ids`` in its graph builders); vLLM
    runs every row and selects the rows before the LM head.

    Args:
        h: ``(T, H)`` the residual stream entering the last layer (the previous layers' sum).
        qkv: ``(T, (Hq + 2 Hkv) D)`` the last layer's QKV projection of ``input_layernorm(h)``.
        rotate: whether RoPE and the KV write are still to do (False: the fused projection of
            :func:`rope_kv_tables` did both).
        cos, sin: ``(T, D)`` float32 RoPE rows.
        kv_cache: the last layer's cache, written at ``metadata.slot_mapping``.
        packed: the layer's tile weights ``(qkv, o, gate_up, down)``, or Nones.
        rows: real rows of the step (each ``< metadata.num_actual_tokens``).

    Returns:
        ``h`` with ``h[rows]`` replaced by their final-norm hidden states ``(n, H)``; its other rows hold
        the residual stream before the last layer (unspecified to the caller).

    Raises:
        ValueError: (from ``decode_view``) when a row is not a real row of the step (``CpuStep.forward``
            checks them before the step writes anything).
    """
    layer = model.layers[-1]
    attn, mlp, ln2 = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    view = decode_view(metadata, rows)
    if rotate:
        cpu_kernels.rope_(qkv, hq + hkv, d, cos, sin)
        k, v = qkv.view(qkv.shape[0], hq + 2 * hkv, d)[:, hq:].split((hkv, hkv), dim=1)  # (T, Hkv, D) each
        write_kv(kv_cache, k, v, metadata.slot_mapping)
    if not rows:
        return h
    index = torch.tensor(rows, dtype=torch.long)
    out = attn.attend_rotated(qkv.index_select(0, index), kv_cache, view)  # (n, Hq D)
    hr = h.index_select(0, index)  # (n, H)
    xr = torch.empty_like(hr)
    t = h.shape[0]  # the step's rows pick each GGUF weight's kernel, as in the full step (_project)
    o = _project(attn.o_proj, out, packed[1], path_rows=t)  # (n, H)
    cpu_kernels.add_rmsnorm_(hr, ln2.weight, ln2.eps, add=o, out=xr)
    act = _project(mlp.gate_up_proj, xr, packed[2], silu_mul=True, path_rows=t)  # (n, I)
    branch = _project(mlp.down_proj, act, packed[3], path_rows=t)  # (n, H)
    final = cpu_kernels.add_rmsnorm_(hr, model.norm.weight, model.norm.eps, add=branch)
    return h.index_copy_(0, index, final)


def rope_kv_tables(
    model: LlamaForCausalLM, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
    tile_weights: list[tuple[torch.Tensor, ...]] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cos, sin)`` rounded to bfloat16 (``(T, D)`` each, ``amx.RopeKV``'s tables, made once a step)
    when this step's QKV projections can rotate Q and K and write K and V in their stores: AMX GEMMs
    over tile weights, the compiled kernels on, bfloat16 caches, a head dim that is a multiple of 32.
    Else None (the projection, then ``cpu.rope_`` and the backend's KV write, as passes of their own).
    A 4,096-token bfloat16 prefill: 30 layers of QKV + RoPE + KV write 116 -> 94 ms (docs/perf.md,
    "Twenty-first session")."""
    attn = model.layers[0].self_attn
    if tile_weights is None or tile_gemm() is not amx or not cpu_kernels.enabled() or attn.head_dim % 32 \
            or any(c.dtype != torch.bfloat16 or not c.is_contiguous() for c in kv_caches):
        return None
    return cos.bfloat16(), sin.bfloat16()


def _project(linear: PackedLinear | QuantLinear, x: torch.Tensor, packed: torch.Tensor | None,
             silu_mul: bool = False, path_rows: int | None = None) -> torch.Tensor:
    """``linear(x)`` (``silu_mul``: the SiLU gate of that fused gate|up output), on :func:`tile_gemm`'s
    GEMM when ``packed`` (its weight in ``amx.pack``'s layout) is given or when :func:`quant_on_tiles`
    says a GGUF weight's step goes there (dequantized to bfloat16 and packed for this call).
    ``path_rows``: the row count that picks a GGUF weight's kernel (default x's): :func:`last_layer_rows`
    passes its step's, so its few rows get the bits the step's product gives them (one row alone would
    take the integer-activation kernel of a lone decode, ~1e-3 off in a first token's logprob)."""
    gemm = tile_gemm()
    rows = x.shape[0] if path_rows is None else path_rows
    if packed is None and quant_on_tiles(linear, x, rows) and not (silu_mul and linear.out_features % 32):
        packed = amx.pack(dequantize_weight(linear.quant_weight, torch.bfloat16))
    if packed is None or gemm is None:
        if isinstance(linear, QuantLinear):
            y = quantized_matmul(x, linear.quant_weight, linear.bias, path_rows=rows)
        else:
            y = linear(x)
        return cpu_kernels.silu_mul(y) if silu_mul else y
    return gemm.linear(x, packed, linear.out_features, linear.in_features, linear.bias, silu_mul=silu_mul)


def tile_gemm():
    """The GEMM module that runs on ``amx.pack``'s tile layout here: ``amx`` where AMX runs and is on,
    else ``bf16gemm`` (AVX-512 BF16 register tiles) where it is on, else None. Both take the same
    arguments and round alike; bf16gemm is how a bfloat16 step's projections leave oneDNN on a CPU
    without AMX (Zen 4: oneDNN's bf16 GEMM there reached ~150 GFLOP/s of a ~350-400 vdpbf16ps peak)."""
    if amx.available():
        return amx
    return bf16gemm if bf16gemm.available() else None


def quant_on_tiles(linear: torch.nn.Module, x: torch.Tensor, rows: int | None = None) -> bool:
    """Whether a GGUF-block projection of a bfloat16 step of ``x`` ``(M, K)`` (of ``rows`` rows when
    given: the step's, for some of its rows) runs as dequantize, pack and tile GEMM
    (:func:`tile_gemm`): the rows where ``QuantLinear`` itself would dequantize and call
    oneDNN (above ``quant_linear.SMALL_ROWS``), a tile GEMM available, and a weight (and bfloat16 bias)
    the kernel tiles. The dequantization is the one that path does; packing adds one pass over the (at
    most 3.5 MB here) bfloat16 weight per call, against a GEMM of at least 13 rows that then runs at the
    tile kernel's rate with the SiLU gate fused (oneDNN reorders the plain weight on every call as
    well)."""
    return (
        isinstance(linear, QuantLinear) and x.dtype == torch.bfloat16
        and (x.shape[0] if rows is None else rows) > QUANT_SMALL_ROWS[torch.bfloat16]
        and linear.out_features % 16 == 0
        and linear.in_features % 32 == 0 and (linear.bias is None or linear.bias.dtype == torch.bfloat16)
        and tile_gemm() is not None
    )


def tile_layer_weights(model: LlamaForCausalLM) -> list[tuple[torch.Tensor, ...]] | None:
    """Per layer, ``(qkv, o, gate_up, down)`` packed by ``amx.pack`` when a tile GEMM runs here
    (:func:`tile_gemm`) and every one of them is a bfloat16 CPU weight it takes (a bias only on qkv,
    bfloat16); else None."""
    if tile_gemm() is None:
        return None
    for layer in model.layers:
        for m in _layer_linears(layer):
            if not isinstance(m, PackedLinear) or not amx.supports(m.weight) or (
                m.bias is not None and m is not layer.self_attn.qkv_proj
            ):
                return None
        bias = layer.self_attn.qkv_proj.bias
        if bias is not None and bias.dtype != torch.bfloat16:
            return None
    return [tuple(amx.pack(m.weight) for m in _layer_linears(layer)) for layer in model.layers]


def _layer_linears(layer: LlamaDecoderLayer) -> tuple[PackedLinear | QuantLinear, ...]:
    """``(qkv, o, gate_up, down)``: the projections :func:`forward_chunk` runs on tiles, in its order."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def decode_stack_layers(model: LlamaForCausalLM, kv_caches: list[torch.Tensor]) -> list[tuple]:
    """Per layer, the tensors ``cpu_kernels.DecodeStack`` reads, in its order: ``(ln1 (H,), qkv
    (Nqkv, H), qkv_bias (Nqkv,) or None, o (H, Hq D), ln2 (H,), gate_up (2 I, H), down (H, I),
    kv_cache)``; ``kv_caches`` one per layer."""
    bias = [ly.self_attn.qkv_proj.bias for ly in model.layers]
    return [
        (ly.input_layernorm.weight.detach(), _kernel_weight(ly.self_attn.qkv_proj),
         None if b is None else b.detach(), _kernel_weight(ly.self_attn.o_proj),
         ly.post_attention_layernorm.weight.detach(), _kernel_weight(ly.mlp.gate_up_proj),
         _kernel_weight(ly.mlp.down_proj), kv)
        for ly, b, kv in zip(model.layers, bias, kv_caches, strict=True)
    ]


def _linears(model: LlamaForCausalLM) -> list[PackedLinear | QuantLinear]:
    """Every projection (and an untied LM head): plain ``PackedLinear`` or GGUF-block ``QuantLinear``."""
    return [m for m in model.modules() if isinstance(m, (PackedLinear, QuantLinear))]
