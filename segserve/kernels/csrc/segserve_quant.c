/* segserve kernels for GGUF block-quantized weights (Q8_0, Q4_0, Q4_1), used in their stored form.
 *
 *   sg_quant_matmul  (called by sg_linear in segserve_cpu.c when its weight is a block format) the
 *                    product of a few float32 rows with the blocks, dequantizing 32 values at a time in
 *                    registers; sg_linear supplies the prologue (RMSNorm, SiLU gate) and this file the
 *                    epilogue (bias, rounding, residual add), as for plain weights.
 *   sg_qdequant      rows of a block tensor to float32 or bfloat16: the embedding lookup, and the
 *                    weight tiles that large steps hand to the GEMMs.
 *
 * Formats (ggml's ggml-common.h; 32 values per block, blocks of a row contiguous, rows contiguous):
 *   Q8_0  fp16 d, int8 q[32]                    value i = d * q[i]                        34 bytes
 *   Q4_0  fp16 d, uint8 qs[16]                  value i = d * (nibble(i) - 8)             18 bytes
 *   Q4_1  fp16 d, fp16 m, uint8 qs[16]          value i = d * nibble(i) + m               20 bytes
 * where nibble(i) is the low nibble of qs[i] for i < 16 and the high nibble of qs[i - 16] above.
 *
 * Exactness: d has an 11-bit significand and q at most 8 bits, so d * q is exact in float32, and the
 * Q4_1 value fma(d, q, m) is the one rounding of d * q + m that gguf-py's ``d * q + m`` also makes: the
 * dequantized weights here equal gguf.quants.dequantize's bit for bit, and the products differ from
 * dequantize-then-matmul in float32 only in summation order.
 *
 * Register tiles (weights dequantized once per tile, used by every row of x; see dequant_block for how): NT weight rows by MT rows
 * of x, NT x MT accumulators of 16 lanes: M = 1: 4 x 1 (qtile_row: 4 FMA chains of 2 FMAs a block
 * cover the FMA latency, and 4 rows' interleaved reads prefetch better than 8: the Q8_0 LM head
 * streamed at ~33 instead of ~24 GB/s on Zen 4), M = 2: 4 x 2, M = 3..4: 4 x M, M = 5..8: 2 x M; more rows go in tiles of 8. A last partial
 * group of weight rows repeats the group's last row (computed, not stored), so any N works.
 * Threads: OpenMP worksharing (orphaned ``omp for``) over groups of weight rows: sg_quant_matmul opens
 * no parallel region of its own but shares the work of the team that calls it, so the decode stack runs
 * every layer's products inside one region (see segserve_cpu.c's sg_decode_stack) and sg_linear opens
 * one per call. Called outside any region it runs on the calling thread alone.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "segserve_quant.h"
#include "segserve_quant_inl.h"
#include "segserve_simd.h"
#include "segserve_team_sync.h"

#if !defined(__AVX512F__) || !defined(__F16C__)
#error "segserve quantized kernels need AVX-512F and F16C"
#endif

#ifndef Q_PF_GROUPS
#define Q_PF_GROUPS 2
#endif
enum { Q_OK = 0, Q_ERR_SHAPE = -1, Q_ERR_ROW = -3, Q_ERR_LAYOUT = -5 };

int64_t sg_quant_block_bytes(int wqt) {
    switch (wqt) {
    case WQT_Q8_0: return 34;
    case WQT_Q4_0: return 18;
    case WQT_Q4_1: return 20;
    default: return 0;
    }
}

/* One block's 32 values, exact: lo holds values 0..15, hi values 16..31; d and m its scales. wqt is a
 * constant after inlining, so the branches fold away.
 * The 4-bit formats look their values up: the block's 16 possible values d * i + m (Q4_1, one rounding:
 * the fma) or d * (i - 8) (Q4_0, exact) are made once in a register, then vpermps picks one per nibble
 * (it reads only an index's low 4 bits, so the widened bytes index the low nibbles as they are and, shifted
 * by 4, the high ones). That moves the per-value work from the FMA port (convert, fma) to the shuffle
 * port, which the dot products leave idle: ~4 instead of ~7 cycles per block and weight row. */
static inline __attribute__((always_inline)) void dequant_block(int wqt, const uint8_t *b, float d, float m,
                                                                __m512 *lo, __m512 *hi) {
    __m512 vd = _mm512_set1_ps(d);
    if (wqt == WQT_Q8_0) {
        __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        *lo = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = wqt == WQT_Q4_1 ? _mm512_fmadd_ps(vd, iota, _mm512_set1_ps(m))
                                   : _mm512_mul_ps(vd, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (wqt == WQT_Q4_1 ? 4 : 2))));
    *lo = _mm512_permutexvar_ps(q, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

/* out[i][j] = dot(xf row i, dequant(weight row wr[j])) for i < mt, j < nt over nb blocks of bb bytes.
 * Inlined with constant wqt, nt and mt, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void qtile(int wqt, int nt, int mt, const uint8_t *const wr[8],
                                                        int64_t nb, int64_t bb, const float *xf, int64_t ldx,
                                                        float out[8][8]) {
    __m512 acc[8][8];
    float sd[8][SCALE_CHUNK], sm[8][SCALE_CHUNK];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += SCALE_CHUNK) {
        int64_t cb = nb - b0 < SCALE_CHUNK ? nb - b0 : SCALE_CHUNK;
        /* Every format's scales gathered first: converting Q8_0's d in the loop costs a convert and a
         * broadcast on the shuffle port per block and row; gathered, the loop broadcasts it from
         * memory (measured at M = 1 on the AMX Xeon: 5.1 -> 4.7 cycles per block and row; on Zen 4,
         * whose gathers are slow, M = 1 is faster without them: qtile_row). */
        for (int j = 0; j < nt; j++) load_scales(wqt, wr[j], bb, b0, cb, sd[j], sm[j]);
        for (int64_t c = 0; c < cb; c++) {
            int64_t b = b0 + c;
            __m512 lo[8], hi[8];
            for (int j = 0; j < nt; j++) {
                const uint8_t *blk = wr[j] + b * bb;
                /* The same bytes Q_PF_GROUPS tiles on (a thread's tiles are consecutive rows): the
                 * hardware prefetcher alone left a batch-1 step waiting on memory (~1.5x slower). */
                _mm_prefetch((const char *)blk + Q_PF_GROUPS * nt * nb * bb, _MM_HINT_T0);
                float d = sd[j][c], m = wqt == WQT_Q4_1 ? sm[j][c] : 0.0f;
                dequant_block(wqt, blk, d, m, &lo[j], &hi[j]);
            }
            for (int i = 0; i < mt; i++) {
                const float *xr = xf + i * ldx + b * 32;
                __m512 xl = _mm512_loadu_ps(xr), xh = _mm512_loadu_ps(xr + 16);
                for (int j = 0; j < nt; j++) {
                    acc[i][j] = _mm512_fmadd_ps(lo[j], xl, acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(hi[j], xh, acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* qtile for one row of x (the batch-1 decode step): each block's scales converted where it is read
 * and its values going straight into their weight row's FMAs, so few registers are live. On Zen 4 the
 * general tile's gathered scales and 8 rows of values in flight cost ~25 % (gathers are slow there);
 * the sums are the same, in the same order. */
static inline __attribute__((always_inline)) void qtile_row(int wqt, int nt, const uint8_t *const wr[8], int64_t nb,
                                                            int64_t bb, const float *xf, float out[8][8]) {
    __m512 acc[8];
    for (int j = 0; j < nt; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 xl = _mm512_loadu_ps(xf + b * 32), xh = _mm512_loadu_ps(xf + b * 32 + 16);
        /* The tile's bytes Q_PF_ROW_GROUPS tiles on, read in the order they lie (one line per 64
         * bytes, where one prefetch per block and row asks for most lines two or three times): the
         * LM head's 30 MB stream went from ~11 to ~27 GB/s with it on Zen 4 (2 threads). The hint,
         * Q_PF_HINT, is the weight streams' (segserve_simd.h): non-temporal on AMD, where each weight
         * is read once a step and a step streams ~95 MB through the 32 MB L3, so kept lines only
         * evicted what the Python between steps runs on (batch-1 decode end to end +8-10 %, rate.py A/B
         * of 10 rounds on Zen 4); into L1 on Intel, where non-temporal ones stalled the stream. */
        const char *ahead = (const char *)wr[0] + Q_PF_ROW_GROUPS * nt * nb * bb + b * nt * bb;
        for (int64_t o = 0; o < nt * bb; o += 64) _mm_prefetch(ahead + o, Q_PF_HINT);
        for (int j = 0; j < nt; j++) {
            const uint8_t *blk = wr[j] + b * bb;
            __m512 lo, hi;
            dequant_block(wqt, blk, half_at(blk), wqt == WQT_Q4_1 ? half_at(blk + 2) : 0.0f, &lo, &hi);
            acc[j] = _mm512_fmadd_ps(lo, xl, acc[j]);
            acc[j] = _mm512_fmadd_ps(hi, xh, acc[j]);
        }
    }
    for (int j = 0; j < nt; j++) out[0][j] = _mm512_reduce_add_ps(acc[j]);
}

/* Rows m0 .. m0 + mt - 1 of the product, all N outputs, in tiles of NT weight rows. */
#define QPASS(WQT, NT, MT)                                                                                 \
    do {                                                                                                   \
        _Pragma("omp for schedule(static) nowait") for (int64_t g = 0; g < groups; g++) {                  \
            const uint8_t *wr[8];                                                                          \
            float out[8][8];                                                                               \
            int64_t n0 = g * (NT);                                                                         \
            for (int j = 0; j < (NT); j++) wr[j] = wb + (n0 + j < N ? n0 + j : N - 1) * rb;                  \
            if ((MT) == 1) qtile_row(WQT, NT, wr, nb, bb, xf + m0 * ldxf, out);                             \
            else qtile(WQT, NT, MT, wr, nb, bb, xf + m0 * ldxf, ldxf, out);                                \
            for (int i = 0; i < (MT); i++)                                                                 \
                for (int j = 0; j < (NT) && n0 + j < N; j++)                                               \
                    epilogue(dt, ydt, accumulate, bias, out[i][j], n0 + j, y, (m0 + i) * ldy + n0 + j);    \
        }                                                                                                  \
        team_sync();                                                                                       \
    } while (0)

int sg_quant_matmul(int dt, int ydt, int wqt, int64_t M, int64_t N, int64_t K, const float *xf,
                    int64_t ldxf, const void *w, const void *bias, void *y, int64_t ldy, int accumulate) {
    const int64_t bb = sg_quant_block_bytes(wqt), nb = K / 32, rb = nb * bb;
    const uint8_t *wb = (const uint8_t *)w;
    if (bb == 0 || M < 1 || N < 1 || K < 32 || K % 32) return Q_ERR_SHAPE;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        int mt = M - m0 < 8 ? (int)(M - m0) : 8;
        int64_t groups;
        if (wqt == WQT_Q8_0) { Q_PASS_FOR_ROWS(QPASS, WQT_Q8_0) }
        else if (wqt == WQT_Q4_0) { Q_PASS_FOR_ROWS(QPASS, WQT_Q4_0) }
        else { Q_PASS_FOR_ROWS(QPASS, WQT_Q4_1) }
    }
    return Q_OK;
}

#undef QPASS

typedef struct {
    int64_t size;        /* sizeof(sg_qdequant_args) */
    int32_t wqt;         /* WQT_Q4_0, WQT_Q4_1 or WQT_Q8_0 */
    int32_t ydt;         /* dtype of y: float32, or bfloat16 rounded to nearest even */
    int64_t N;           /* rows of w */
    int64_t K;           /* values per row, a positive multiple of 32 */
    const void *w;       /* (N, K / 32) blocks */
    int64_t n;           /* rows to produce, >= 0 */
    const int64_t *rows; /* (n,) row of w for each output row, or NULL for rows r0 .. r0 + n - 1 */
    int64_t r0;          /* first row when rows is NULL */
    void *y;             /* (n, K) with row stride ldy */
    int64_t ldy;         /* row stride of y, elements */
} sg_qdequant_args;

/* y[i, :] = dequant(w[rows[i], :]) (or of row r0 + i): exact in float32 (see the top of the file), the
 * bfloat16 result is that value rounded to nearest even, as ``tensor.to(torch.bfloat16)``. Every row id
 * is checked before anything is written. Returns OK, ERR_LAYOUT, ERR_SHAPE or ERR_ROW. */
int sg_qdequant(const sg_qdequant_args *a) {
    if (a->size != (int64_t)sizeof *a) return Q_ERR_LAYOUT;
    const int wqt = a->wqt, ydt = a->ydt;
    const int64_t N = a->N, K = a->K, n = a->n, r0 = a->r0, ldy = a->ldy, bb = sg_quant_block_bytes(wqt);
    const int64_t *rows = a->rows;
    const uint8_t *w = (const uint8_t *)a->w;
    char *y = (char *)a->y;
    if (bb == 0 || K < 32 || K % 32 || n < 0 || (ydt != Q_DT_F32 && ydt != Q_DT_BF16)) return Q_ERR_SHAPE;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows ? rows[i] : r0 + i;
        if (r < 0 || r >= N) return Q_ERR_ROW;
    }
    const int64_t nb = K / 32, es = ydt == Q_DT_F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *src = w + (rows ? rows[i] : r0 + i) * nb * bb;
        char *dst = y + i * ldy * es;
        for (int64_t b = 0; b < nb; b++) {
            __m512 lo, hi;
            /* A switch per block, not per row: the formats' loops stay short and this pass is far from
             * being the step's cost (one read of the weight per large step). */
            const uint8_t *blk = src + b * bb;
            float d = half_at(blk), m = wqt == WQT_Q4_1 ? half_at(blk + 2) : 0.0f;
            switch (wqt) {
            case WQT_Q8_0: dequant_block(WQT_Q8_0, blk, d, m, &lo, &hi); break;
            case WQT_Q4_0: dequant_block(WQT_Q4_0, blk, d, m, &lo, &hi); break;
            default: dequant_block(WQT_Q4_1, blk, d, m, &lo, &hi); break;
            }
            if (ydt == Q_DT_F32) {
                _mm512_storeu_ps((float *)dst + b * 32, lo);
                _mm512_storeu_ps((float *)dst + b * 32 + 16, hi);
            } else {
                _mm256_storeu_si256((__m256i *)((uint16_t *)dst + b * 32), (__m256i)_mm512_cvtneps_pbh(lo));
                _mm256_storeu_si256((__m256i *)((uint16_t *)dst + b * 32 + 16), (__m256i)_mm512_cvtneps_pbh(hi));
            }
        }
    }
    return Q_OK;
}
