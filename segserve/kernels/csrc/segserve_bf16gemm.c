/* A bfloat16 GEMM on AVX-512 BF16 register tiles (vdpbf16ps) for CPUs without AMX (Zen 4 above all):
 *
 *   sg_bf16gemm       y = x W^T (+ bias) for M >= 1 rows, float32 accumulation, with the epilogues
 *                     sg_amx_linear has: none, the residual add (y = r(y + r(acc))) or SiLU(gate) * up
 *                     over a fused [gate; up] weight; W in sg_amx_pack's layout.
 *   sg_bf16gemm_peak  a register-only microkernel (24 accumulators, no memory traffic): the measured peak.
 *
 * Packed layout: sg_amx_pack's (segserve_amx.c; pure AVX-512, so it runs here too). For 16-column block
 * nb and k pair p, the 16 pairs W[nb*16 + c][2p .. 2p+1] (c = 0..15) are one 64-byte row at bf16 offset
 * nb * 16 K + 32 p: one zmm holds 16 output columns x one k pair, exactly vdpbf16ps's B operand, and a
 * block's K/2 rows are contiguous. Sharing the AMX layout means one packed copy serves either kernel and
 * a GGUF weight is dequantized and packed by the same code.
 *
 * Micro-kernel: MR = 6 rows x NV = 4 column blocks (64 columns) in 24 zmm accumulators. Per k pair: 4
 * vector loads of B (one per block) and 6 broadcasts of x's pair (one 32-bit load each), 24 vdpbf16ps:
 * 24 independent chains, more than latency x throughput needs (Zen 4: ~6 cycles x 1 zmm per cycle).
 * x is read in place (its 6 rows x K, at most ~18 KB for K = 1,536, stay in L1 while the micro-kernel
 * sweeps the item's column blocks); B streams from L2, 256 bytes per 24 vdpbf16ps. The epilogue is
 * inlined into each micro-kernel (stores straight from the accumulators) and the output lines are
 * prefetched for writing before its k loop: against a first version that went through a float32
 * buffer, 1.03-1.12x per shape at M = 4,096, one thread (paired median of 21, load 3.7, 2026-12-02).
 *
 * Blocking: work items are a chunk of column units (a unit is a 16-column block, or for EPI_SILU_MUL a
 * gate block j with its up block j) of at most ~BG_W_BYTES of W, kept in L2 and reused by every row
 * panel of the item, by a chunk of rows. OpenMP threads (PyTorch's pool) take items dynamically,
 * column chunk first, at least ~4 per thread where the shape allows (a static split waits for whichever
 * thread the machine's other tenants descheduled, as sg_amx_linear found).
 *
 * Numerics: the pair products of bf16 values are exact; vdpbf16ps adds them into the float32
 * accumulator (k ascending; denormal inputs and outputs flushed to zero, round to nearest even); the bias
 * is added in float32, then the epilogue rounds where the eager model rounds, as sg_amx_linear does:
 * plain r(acc + bias) (or float32 acc + bias); residual r(y + r(acc)); SiLU-mul r(r(silu(r(gate))) *
 * r(up)) with silu(g) = g / (1 + exp(-g)), exp sg_exp512. r is bfloat16 rounding (nearest even).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "segserve_amx_team.h"
#include "segserve_simd.h"

#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "segserve_bf16gemm.c needs AVX-512F and AVX-512 BF16"
#endif

enum { BG_OK = 0, BG_ERR_SHAPE = -1, BG_ERR_LAYOUT = -5 };
enum { BG_DT_F32 = 0, BG_DT_BF16 = 1 };
enum { BG_EPI_NONE = 0, BG_EPI_RESIDUAL = 1, BG_EPI_SILU_MUL = 2 };
enum { MR = 6, NV = 4 };
#define PAIR_ELEMS 32 /* bf16 values of one k pair of a 16-column block: one zmm */
#ifndef BG_W_BYTES
#define BG_W_BYTES (384 * 1024) /* weight bytes per column chunk: under half of Zen 4's 1 MiB L2 */
#endif
#ifndef BG_ROWS
#define BG_ROWS 192 /* rows per row chunk before splitting finer for the threads */
#endif

typedef struct {
    int64_t size;           /* sizeof(sg_bf16gemm_args); the GEMM fields of sg_amx_linear_args, in order (amx.GEMM_FIELDS) */
    int64_t M;              /* rows of x and y, >= 1 */
    int64_t N;              /* outputs of the packed weight, a multiple of 16 (of 32 for EPI_SILU_MUL) */
    int64_t K;              /* inputs, a multiple of 32 */
    const uint16_t *x;      /* (M, K) bfloat16 rows, row stride ldx, each row contiguous */
    int64_t ldx;            /* row stride of x, elements, >= K */
    const uint16_t *packed; /* sg_amx_pack's layout of the (N, K) weight */
    const uint16_t *bias;   /* (N,) bfloat16 or NULL */
    void *y;                /* (M, N) (EPI_SILU_MUL: (M, N/2)), row stride ldy; must not overlap x */
    int64_t ldy;            /* row stride of y, elements */
    int32_t ydt;            /* dtype of y: 0 float32, 1 bfloat16 (the epilogues need bfloat16) */
    int32_t epilogue;       /* EPI_NONE, EPI_RESIDUAL, EPI_SILU_MUL (file comment) */
} sg_bf16gemm_args;

/* ---- epilogue --------------------------------------------------------------------------------- */

/* 16 float32 lanes rounded to bfloat16 (nearest even) and stored. */
static inline void store_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* bias[col .. col + 15] added to v (float32), or v when there is no bias. */
static inline __m512 add_bias(const uint16_t *bias, int64_t col, __m512 v) {
    return bias ? _mm512_add_ps(v, sg_bf16x16_to_f32(bias + col)) : v;
}

/* One row of 16 plain (or residual) outputs at columns col..: sg_amx_linear's store_row, lane for lane. */
static inline void store_plain(const sg_bf16gemm_args *a, int64_t row, int64_t col, __m512 acc) {
    __m512 v = add_bias(a->bias, col, acc);
    const int64_t at = row * a->ldy + col;
    if (a->ydt == BG_DT_F32) {
        _mm512_storeu_ps((float *)a->y + at, v);
    } else if (a->epilogue == BG_EPI_RESIDUAL) {
        uint16_t *y = (uint16_t *)a->y + at;
        store_bf16(y, _mm512_add_ps(sg_bf16x16_to_f32(y), sg_bf16_round16(v)));
    } else {
        store_bf16((uint16_t *)a->y + at, v);
    }
}

/* One row of 16 SiLU-gated outputs at column col of the (M, N/2) result, from the gate block's and the
 * up block's accumulators: r(r(silu(r(gate))) * r(up)), as sg_amx_linear's store_row. */
static inline void store_silu(const sg_bf16gemm_args *a, int64_t row, int64_t col, __m512 gate, __m512 up) {
    __m512 g = sg_bf16_round16(add_bias(a->bias, col, gate));
    __m512 u = sg_bf16_round16(add_bias(a->bias, a->N / 2 + col, up));
    __m512 e = sg_exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    __m512 s = sg_bf16_round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    store_bf16((uint16_t *)a->y + row * a->ldy + col, _mm512_mul_ps(s, u));
}

/* ---- micro-kernel ----------------------------------------------------------------------------- */

/* The stores of one micro-kernel's accumulators c[i][v] (rows m0 + i, blocks from unit u on): plain
 * blocks u .. u + nv - 1, or for EPI_SILU_MUL gate blocks c[i][0 .. nv/2) with their up blocks
 * c[i][nv/2 ..). Inlined into micro, so the accumulators are stored from registers. */
static inline __attribute__((always_inline)) void store_tile(const sg_bf16gemm_args *a, int mr, int nv,
                                                             __m512 c[MR][NV], int64_t m0, int64_t u) {
    for (int i = 0; i < mr; i++) {
        if (a->epilogue == BG_EPI_SILU_MUL)
            for (int j = 0; j < nv / 2; j++) store_silu(a, m0 + i, 16 * (u + j), c[i][j], c[i][nv / 2 + j]);
        else
            for (int v = 0; v < nv; v++) store_plain(a, m0 + i, 16 * (u + v), c[i][v]);
    }
}

/* Where a micro-kernel's stores go, fetched for writing while its k loop runs: y is not in cache at
 * prefill sizes, and a store that misses holds the store queue after the loop instead. */
static inline __attribute__((always_inline)) void prefetch_out(const sg_bf16gemm_args *a, int mr, int nv,
                                                               int64_t m0, int64_t u) {
    const int64_t esz = a->ydt == BG_DT_F32 ? 4 : 2;
    const int64_t cols = a->epilogue == BG_EPI_SILU_MUL ? 16 * (nv / 2) : 16 * nv;
    for (int i = 0; i < mr; i++) {
        const char *row = (const char *)a->y + ((m0 + i) * a->ldy + 16 * u) * esz;
        for (int64_t off = 0; off < cols * esz; off += 64) __builtin_prefetch(row + off, 1, 3);
        __builtin_prefetch(row + cols * esz - 1, 1, 3);
    }
}

/* Rows m0 .. m0 + mr - 1 of x times column blocks b[0 .. nv) over the KP k pairs (16 float32 lanes per
 * row and block), then stored from unit u on (store_tile). apf (or NULL): the next MR rows (stride
 * ldx) to prefetch into L2 on the way, one 64-byte line per row every 16 pairs. mr and nv are
 * constants after inlining, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void micro(int mr, int nv, const sg_bf16gemm_args *a,
                                                        const uint16_t *const b[NV], int64_t KP, int64_t m0,
                                                        int64_t u, const uint16_t *apf) {
    const uint16_t *x = a->x + m0 * a->ldx;
    const int64_t ldx = a->ldx;
    __m512 c[MR][NV];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) c[i][v] = _mm512_setzero_ps();
    prefetch_out(a, mr, nv, m0, u);
    for (int64_t p = 0; p < KP; p++) {
        __m512bh w[NV];
        for (int v = 0; v < nv; v++) w[v] = (__m512bh)_mm512_loadu_si512(b[v] + p * PAIR_ELEMS);
        /* The next row panel's x otherwise reaches the first column block from L3 or memory, serially
         * in k (sg_f32gemm measured 1.1-1.2x from this prefetch at M = 1,024). */
        if (apf && (p & 15) == 0)
            for (int i = 0; i < MR; i++) _mm_prefetch((const char *)(apf + i * ldx + 2 * p), _MM_HINT_T1);
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            __builtin_memcpy(&pair, x + i * ldx + 2 * p, sizeof pair); /* one 32-bit load, no aliasing */
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < nv; v++) c[i][v] = _mm512_dpbf16_ps(c[i][v], xv, w[v]);
        }
    }
#ifdef BG_NO_EPI /* timing-only ablation, built by hand with -DBG_NO_EPI: what the stores cost */
    if (a->M > 0) return;
#endif
    store_tile(a, mr, nv, c, m0, u);
}

#define BG_MICRO_NV(MR_, NV_) micro(MR_, NV_, a, b, KP, m0, u, apf)
#define BG_MICRO_MR(MR_)                                                                                   \
    switch (nv) {                                                                                          \
    case 1: BG_MICRO_NV(MR_, 1); break;                                                                    \
    case 2: BG_MICRO_NV(MR_, 2); break;                                                                    \
    case 3: BG_MICRO_NV(MR_, 3); break;                                                                    \
    default: BG_MICRO_NV(MR_, 4); break;                                                                   \
    }

/* The micro-kernel for mr (1..6) rows and nv (1..4) column blocks. */
static void micro_any(int mr, int nv, const sg_bf16gemm_args *a, const uint16_t *const b[NV], int64_t KP,
                      int64_t m0, int64_t u, const uint16_t *apf) {
    switch (mr) {
    case 1: BG_MICRO_MR(1); break;
    case 2: BG_MICRO_MR(2); break;
    case 3: BG_MICRO_MR(3); break;
    case 4: BG_MICRO_MR(4); break;
    case 5: BG_MICRO_MR(5); break;
    default: BG_MICRO_MR(6); break;
    }
}

/* ---- GEMM ------------------------------------------------------------------------------------- */

/* How an item's columns map to micro-kernels: ``upt`` units per micro-kernel, ``bpu`` blocks per unit. */
typedef struct bg_plan { /* internal (a tag, so the interface test's parser skips it) */
    int silu, upt, bpu;
    int64_t units, KP;
} bg_plan;

/* The micro-kernel over rows [m0, m0 + mr) and units [u, u + n) (n <= upt), with its stores. apf: the
 * next row panel's x to prefetch (or NULL). */
static void tile(const sg_bf16gemm_args *a, const bg_plan *pl, int64_t m0, int mr, int64_t u, int n,
                 const uint16_t *apf) {
    const uint16_t *b[NV];
    const int64_t block = 16 * a->K, half = a->N / 32;
    for (int j = 0; j < n; j++) { /* silu: gate blocks first, their up blocks after them */
        b[j] = a->packed + (u + j) * block;
        if (pl->silu) b[n + j] = a->packed + (half + u + j) * block;
    }
    micro_any(mr, n * pl->bpu, a, b, pl->KP, m0, u, apf);
}

/* One work item: rows [r0, r1) x units [c0, c1), row panels of MR outer (x's panel stays in L1), the
 * item's units inner (their W stays in L2 across the panels). */
static void item(const sg_bf16gemm_args *a, const bg_plan *pl, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    for (int64_t m0 = r0; m0 < r1; m0 += MR) {
        const int mr = r1 - m0 < MR ? (int)(r1 - m0) : MR;
        const uint16_t *next = m0 + MR + MR <= r1 ? a->x + (m0 + MR) * a->ldx : NULL;
        for (int64_t u = c0; u < c1; u += pl->upt) {
            const int n = c1 - u < pl->upt ? (int)(c1 - u) : pl->upt;
            tile(a, pl, m0, mr, u, n, u == c0 ? next : NULL);
        }
    }
}

/* The plan of an (N, K) weight through the epilogue (SiLU-mul or not). */
static bg_plan plan_for(int silu, int64_t N, int64_t K) {
    return (bg_plan){silu, silu ? NV / 2 : NV, silu ? 2 : 1, silu ? N / 32 : N / 16, K / 2};
}

/* Units per column chunk: at most BG_W_BYTES of W (kept in L2 across an item's row panels), a multiple
 * of upt, at least upt. */
static int64_t chunk_units(int64_t K, const bg_plan *pl) {
    const int64_t c = BG_W_BYTES / (K * 32 * pl->bpu) / pl->upt * pl->upt;
    return c < pl->upt ? pl->upt : c;
}

/* Item sizes: *cw units per column chunk (chunk_units, capped at the weight's) and *rh rows per row
 * chunk (a multiple of MR), split finer until there are ~4 items per thread. */
static void item_sizes(const sg_bf16gemm_args *a, const bg_plan *pl, int threads, int64_t *cw, int64_t *rh) {
    const int64_t want = 4 * (int64_t)threads;
    int64_t c = chunk_units(a->K, pl);
    int64_t r = BG_ROWS;
    for (;;) {
        const int64_t items = ((pl->units + c - 1) / c) * ((a->M + r - 1) / r);
        if (items >= want) break;
        if (c > pl->upt) c = (c / 2 + pl->upt - 1) / pl->upt * pl->upt;
        else if (r > MR) r = (r / 2 + MR - 1) / MR * MR;
        else break;
    }
    *cw = c < pl->units ? c : pl->units;
    *rh = r;
}

/* y = x W^T (+ bias) through the epilogue, W from sg_amx_pack. Returns OK, ERR_LAYOUT or ERR_SHAPE. */
int sg_bf16gemm(const sg_bf16gemm_args *a) {
    if (a->size != (int64_t)sizeof *a) return BG_ERR_LAYOUT;
    const int64_t M = a->M, N = a->N, K = a->K;
    const int epi = a->epilogue, silu = epi == BG_EPI_SILU_MUL;
    if (M < 1 || N < 16 || K < 32 || N % (silu ? 32 : 16) || K % 32 || a->ldx < K) return BG_ERR_SHAPE;
    if (epi < BG_EPI_NONE || epi > BG_EPI_SILU_MUL || (epi != BG_EPI_NONE && a->ydt != BG_DT_BF16)) return BG_ERR_SHAPE;
    if ((a->ydt != BG_DT_F32 && a->ydt != BG_DT_BF16) || a->ldy < (silu ? N / 2 : N)) return BG_ERR_SHAPE;
    const bg_plan pl = plan_for(silu, N, K);
    int threads = omp_get_max_threads();
    int64_t cw, rh;
    item_sizes(a, &pl, threads, &cw, &rh);
    const int64_t row_chunks = (M + rh - 1) / rh, items = (pl.units + cw - 1) / cw * row_chunks;
    if (threads > items) threads = (int)items;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) { /* column chunk major: threads share a chunk of W */
        const int64_t c0 = it / row_chunks * cw, r0 = it % row_chunks * rh;
        item(a, &pl, r0, r0 + rh < M ? r0 + rh : M, c0, c0 + cw < pl.units ? c0 + cw : pl.units);
    }
    return BG_OK;
}

/* ---- the decode stack's product ------------------------------------------------------------- */

/* sg_team_gemm_run's product on vdpbf16ps register tiles (CPUs without AMX; the decode stack's
 * projections for decode batches of 2-64 rows): thread t of the calling team's T takes the column units
 * [t U / T, (t + 1) U / T) (contiguous, balanced to one unit, so each streams one run of the packed
 * weight), in column chunks of at most BG_W_BYTES of W (kept in L2 while every row panel of the step
 * passes over them: the weight is read from memory once per step), each chunk by item() as sg_bf16gemm
 * runs it, so the same bits as sg_bf16gemm (and sg_amx_linear). No barrier at the end: the caller's. */
void sg_team_gemm_run_bf16(const sg_team_gemm *g) {
    const sg_bf16gemm_args a = {.size = sizeof a, .M = g->M, .N = g->N, .K = g->K, .x = g->x, .ldx = g->ldx,
                                .packed = g->packed, .bias = g->bias, .y = g->y, .ldy = g->ldy,
                                .ydt = BG_DT_BF16, .epilogue = g->epilogue};
    const bg_plan pl = plan_for(g->epilogue == TEAM_EPI_SILU_MUL, g->N, g->K);
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t c0 = pl.units * t / threads, c1 = pl.units * (t + 1) / threads;
    const int64_t cw = chunk_units(g->K, &pl);
    for (int64_t c = c0; c < c1; c += cw) item(&a, &pl, 0, g->M, c, c + cw < c1 ? c + cw : c1);
}

/* ---- peak ------------------------------------------------------------------------------------- */

typedef struct {
    int64_t size;    /* sizeof(sg_bf16gemm_peak_args) */
    int64_t iters;   /* rounds of 24 vdpbf16ps (zmm) per thread */
    int32_t threads; /* OpenMP threads, >= 1 */
} sg_bf16gemm_peak_args;

/* The register-only ceiling: iters x 24 independent vdpbf16ps into 24 accumulators from 2 registers
 * (the micro-kernel's 6 x 4 without its loads); the caller times it. Flops: threads x iters x 24 x 64.
 * Returns OK, ERR_LAYOUT or ERR_SHAPE. */
int sg_bf16gemm_peak(const sg_bf16gemm_peak_args *a) {
    if (a->size != (int64_t)sizeof *a) return BG_ERR_LAYOUT;
    const int64_t iters = a->iters;
    if (iters < 1 || a->threads < 1) return BG_ERR_SHAPE;
#pragma omp parallel num_threads(a->threads)
    {
        /* bf16 2^-7 pairs: each round adds 2^-13 per lane, so sums stay finite and normal. */
        const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3c00), w = (__m512bh)_mm512_set1_epi16(0x3c00);
        __m512 c[24];
        for (int j = 0; j < 24; j++) c[j] = _mm512_setzero_ps();
        /* Unrolled, so the accumulators are registers (GCC otherwise swaps the loops and keeps c[] in
         * memory, which measured ~70 % of this). */
        for (int64_t i = 0; i < iters; i++) {
#pragma GCC unroll 24
            for (int j = 0; j < 24; j++) c[j] = _mm512_dpbf16_ps(c[j], x, w);
        }
        __m512 s = c[0];
        for (int j = 1; j < 24; j++) s = _mm512_add_ps(s, c[j]);
        float out[16] __attribute__((aligned(64)));
        _mm512_store_ps(out, s); /* keeps the loop from being dropped */
        __asm__ volatile("" ::"r"(out[0]) : "memory");
    }
    return BG_OK;
}
