/* AMX tile GEMM for decode batches (2-64 rows), run by a team already inside a parallel region.
 *
 * Why a second AMX GEMM beside sg_amx_linear (segserve_amx.c): a decode step of 2-64 rows reads every
 * weight once and does little arithmetic per byte (a B tile of 1 KiB feeds 1-4 tile products), so it is
 * bound by streaming the weights from memory, and through forward_chunk (above 8 rows) its four
 * projections a layer were four calls from Python, each opening a parallel region. Here the decode
 * stack (sg_decode_stack in segserve_cpu.c) runs every layer of such a step in its one region and
 * calls this product from it: an orphaned worksharing loop over the weight's 16-column blocks, each
 * thread streaming one contiguous run of the packed weight with software prefetch a few tiles ahead,
 * every row tile of the step against each B tile as it arrives (weights read once per step, whatever
 * the row count).
 *
 * block_products, per 16-column block: every row tile of 16 rows (up to 4; a last partial one is the 16
 * rows ending at row M, overlapping the previous one, whose rows it does not write again; M < 16
 * configures tiles of M rows), float32 accumulators in tiles 0-3, the B tile in 4 or 5 (alternating by K
 * step, so a load does not wait for the products reading the previous one: tiles are not renamed), the A
 * tiles in 6 and 7 in turn, reloaded from x (in L1/L2) per K step. It runs steps of up to 16 rows (and a
 * last odd block). From 17 rows (PAIR_MIN_ROW_TILES) pair_products takes two column blocks at a time
 * instead: 2 x 2 register blocks, each loaded tile feeding two products, in two passes above 32 rows, the
 * second reading the two blocks from cache. Per K step of 64 rows that is 8 products and 8 tile loads,
 * against 4 products and 5 loads a block in block_products, two of which wait for the product still
 * reading their tile (a 64-row step's four projections: 19.9 -> 17.2 ms, see docs/perf.md). Then the
 * accumulators go through a float32 buffer to the epilogue.
 *
 * Numerics: the same as sg_amx_linear, bit for bit: tile products over the K steps in order from zero,
 * the bias added in float32, then y = bf16(acc); the residual y = bf16(y + bf16(acc)); the SiLU gate
 * bf16(bf16(silu(bf16(gate))) * bf16(up)), silu(g) = g / (1 + exp(-g)) with the Cephes exp of
 * segserve_simd.h. So the decode stack over this product equals forward_chunk over amx.linear.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "segserve_amx_team.h"
#include "segserve_simd.h"

#define TEAM_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))
#define TILE_ELEMS 512 /* bf16 values in one packed B tile (16 K pairs x 16 columns) */
#define MAX_ROW_TILES 4
/* pair_products' prefetch of the weight stream: into L2 only (the tile load brings each line to L1 when it
 * is used; T0 left the x rows of the row tiles less room there: 64 rows, 30 layers of the four
 * projections 13.1-13.7 -> 12.5 ms in a /tmp harness). */
#ifndef PAIR_HINT
#define PAIR_HINT _MM_HINT_T1
#endif
#ifndef TEAM_PREFETCH_TILES
#define TEAM_PREFETCH_TILES 8 /* how far ahead of the B tile being loaded the prefetch runs, in tiles */
#endif

int sg_team_gemm_fits(int64_t M, int64_t N, int64_t K, int epilogue) {
    if (M < 1 || M > 16 * MAX_ROW_TILES || N < 16 || K < 32 || K % 32) return 0;
    if (epilogue == TEAM_EPI_SILU_MUL) return N % 32 == 0;
    return (epilogue == TEAM_EPI_NONE || epilogue == TEAM_EPI_RESIDUAL) && N % 16 == 0;
}

typedef struct team_tile_config { /* the LDTILECFG operand (internal, tagged) */
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} team_tile_config;

/* Tiles 0-3 accumulators and 6-7 A tiles of min(M, 16) rows; 4-5 B tiles of 16 rows (K pairs). */
TEAM_TARGET void sg_team_tiles_begin(int64_t M) {
    team_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const uint8_t rows = (uint8_t)(M < 16 ? M : 16);
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = rows;
    }
    cfg.rows[4] = cfg.rows[5] = 16;
    /* GCC 12 dropped the stores above as dead when this function is not inlined (it does not see
     * LDTILECFG read all 64 bytes): the barrier keeps them. */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

TEAM_TARGET void sg_team_tiles_end(void) { _tile_release(); }

/* One K step: the B tile (in BT) against row tiles 0..MT-1 (A tiles 6, 7 in turn). */
#define TEAM_STEP(BT, ks)                                                                                  \
    do {                                                                                                   \
        const uint16_t *bt_ = b + (ks) * TILE_ELEMS;                                                       \
        for (int l_ = 0; l_ < 16; l_++) _mm_prefetch((const char *)(bt_ + pf) + 64 * l_, _MM_HINT_T0);     \
        _tile_loadd(BT, bt_, 64);                                                                          \
        _tile_loadd(6, x0 + (ks) * 32, ldxb);                                                              \
        _tile_dpbf16ps(0, 6, BT);                                                                          \
        if (MT > 1) {                                                                                      \
            _tile_loadd(7, x1 + (ks) * 32, ldxb);                                                          \
            _tile_dpbf16ps(1, 7, BT);                                                                      \
        }                                                                                                  \
        if (MT > 2) {                                                                                      \
            _tile_loadd(6, x2 + (ks) * 32, ldxb);                                                          \
            _tile_dpbf16ps(2, 6, BT);                                                                      \
        }                                                                                                  \
        if (MT > 3) {                                                                                      \
            _tile_loadd(7, x3 + (ks) * 32, ldxb);                                                          \
            _tile_dpbf16ps(3, 7, BT);                                                                      \
        }                                                                                                  \
    } while (0)

/* Accumulators of 16-column block nb (its KS packed tiles from b) for row tiles starting at m0[0..MT),
 * stored to c[0..MT) (rows x 16 float32 each). MT a constant in each inlined copy. */
TEAM_TARGET static inline __attribute__((always_inline)) void block_products(
    const uint16_t *x, int64_t ldx, const int64_t m0[MAX_ROW_TILES], const uint16_t *b, int64_t KS, const int MT,
    float c[MAX_ROW_TILES][256]) {
    const int64_t ldxb = 2 * ldx, pf = TEAM_PREFETCH_TILES * TILE_ELEMS;
    const uint16_t *x0 = x + m0[0] * ldx, *x1 = x + m0[MT > 1 ? 1 : 0] * ldx;
    const uint16_t *x2 = x + m0[MT > 2 ? 2 : 0] * ldx, *x3 = x + m0[MT > 3 ? 3 : 0] * ldx;
    _tile_zero(0);
    if (MT > 1) _tile_zero(1);
    if (MT > 2) _tile_zero(2);
    if (MT > 3) _tile_zero(3);
    int64_t ks = 0;
    for (; ks + 2 <= KS; ks += 2) {
        TEAM_STEP(4, ks);
        TEAM_STEP(5, ks + 1);
    }
    if (ks < KS) TEAM_STEP(4, ks);
    _tile_stored(0, c[0], 64);
    if (MT > 1) _tile_stored(1, c[1], 64);
    if (MT > 2) _tile_stored(2, c[2], 64);
    if (MT > 3) _tile_stored(3, c[3], 64);
}
#undef TEAM_STEP

TEAM_TARGET static void block(const uint16_t *x, int64_t ldx, const int64_t m0[MAX_ROW_TILES], int mt,
                              const uint16_t *b, int64_t KS, float c[MAX_ROW_TILES][256]) {
    switch (mt) {
    case 1: block_products(x, ldx, m0, b, KS, 1, c); break;
    case 2: block_products(x, ldx, m0, b, KS, 2, c); break;
    case 3: block_products(x, ldx, m0, b, KS, 3, c); break;
    default: block_products(x, ldx, m0, b, KS, 4, c); break;
    }
}

/* Row r of accumulator buffer c (bias columns bcol) into y's row ``row``, columns col .. col + 15; for the
 * SiLU gate, ``up`` is the up half's buffer (bias columns bup). */
static inline void epilogue_row(const sg_team_gemm *g, const float *c, const float *up, int r, int64_t row,
                                int64_t col, int64_t bcol, int64_t bup) {
    __m512 v = _mm512_loadu_ps(c + 16 * r);
    if (g->bias) v = _mm512_add_ps(v, sg_bf16x16_to_f32(g->bias + bcol));
    uint16_t *y = g->y + row * g->ldy + col;
    if (g->epilogue == TEAM_EPI_SILU_MUL) {
        __m512 u = _mm512_loadu_ps(up + 16 * r);
        if (g->bias) u = _mm512_add_ps(u, sg_bf16x16_to_f32(g->bias + bup));
        __m512 gate = sg_bf16_round16(v);
        u = sg_bf16_round16(u);
        __m512 e = sg_exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate));
        __m512 s = sg_bf16_round16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        sg_bf16_store16(y, sg_bf16_round16(_mm512_mul_ps(s, u)));
        return;
    }
    v = sg_bf16_round16(v);
    if (g->epilogue == TEAM_EPI_RESIDUAL) v = sg_bf16_round16(_mm512_add_ps(sg_bf16x16_to_f32(y), v));
    sg_bf16_store16(y, v);
}

/* Accumulators of two 16-column blocks (packed tiles b0, b1) for row tiles at ma and mb (MT 2) or ma
 * alone (MT 1): a 2 x 2 register block, tiles 0 / 1 = (ma, b0 / b1), 2 / 3 = (mb, b0 / b1), A tiles 6
 * and 7, B tiles 4 and 5. Each loaded tile feeds two products and is not reloaded before the next K
 * step, whereas block_products' third and fourth row tiles reload A tile 6 / 7 one product after its
 * last use, and that load waits for the product still reading the tile (tiles are not renamed): at 64
 * rows that doubled the time per B tile. Stored to c00 / c01 (ma) and c10 / c11 (mb). */
TEAM_TARGET static inline __attribute__((always_inline)) void pair_products(
    const uint16_t *x, int64_t ldx, int64_t ma, int64_t mb, const int MT, const uint16_t *b0, const uint16_t *b1,
    int64_t KS, float *c00, float *c01, float *c10, float *c11) {
    const int64_t ldxb = 2 * ldx, pf = TEAM_PREFETCH_TILES * TILE_ELEMS;
    const uint16_t *xa = x + ma * ldx, *xb = x + mb * ldx;
    _tile_zero(0);
    _tile_zero(1);
    if (MT > 1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t ks = 0; ks < KS; ks++) {
        const uint16_t *p0 = b0 + ks * TILE_ELEMS, *p1 = b1 + ks * TILE_ELEMS;
        for (int l = 0; l < 16; l++) {
            _mm_prefetch((const char *)(p0 + pf) + 64 * l, PAIR_HINT);
            _mm_prefetch((const char *)(p1 + pf) + 64 * l, PAIR_HINT);
        }
        _tile_loadd(4, p0, 64);
        _tile_loadd(6, xa + ks * 32, ldxb);
        _tile_dpbf16ps(0, 6, 4);
        _tile_loadd(5, p1, 64);
        _tile_dpbf16ps(1, 6, 5);
        if (MT > 1) {
            _tile_loadd(7, xb + ks * 32, ldxb);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(3, 7, 5);
        }
    }
    _tile_stored(0, c00, 64);
    _tile_stored(1, c01, 64);
    if (MT > 1) {
        _tile_stored(2, c10, 64);
        _tile_stored(3, c11, 64);
    }
}

/* Row tiles 0..mt-1 (1-4) against blocks b0 and b1 by pair_products, two row tiles a pass (above two, the
 * second pass reads b0 and b1 from cache): c[i] the b0 block of row tile i, cu[i] the b1 block. */
TEAM_TARGET static void pair_block(const uint16_t *x, int64_t ldx, const int64_t m0[MAX_ROW_TILES], int mt,
                                   const uint16_t *b0, const uint16_t *b1, int64_t KS, float c[MAX_ROW_TILES][256],
                                   float cu[MAX_ROW_TILES][256]) {
    if (mt == 1) {
        pair_products(x, ldx, m0[0], m0[0], 1, b0, b1, KS, c[0], cu[0], c[0], cu[0]);
        return;
    }
    pair_products(x, ldx, m0[0], m0[1], 2, b0, b1, KS, c[0], cu[0], c[1], cu[1]);
    if (mt > 3)
        pair_products(x, ldx, m0[2], m0[3], 2, b0, b1, KS, c[2], cu[2], c[3], cu[3]);
    else if (mt == 3)
        pair_products(x, ldx, m0[2], m0[2], 1, b0, b1, KS, c[2], cu[2], c[2], cu[2]);
}

/* Row tiles from which sg_team_gemm_run takes two column blocks at a time (pair_block): from 17 rows. At
 * 1-16 rows the two forms measured the same, so batch-1 decode keeps block_products. */
#ifndef PAIR_MIN_ROW_TILES
#define PAIR_MIN_ROW_TILES 2
#endif

TEAM_TARGET void sg_team_gemm_run(const sg_team_gemm *g) {
    const int64_t M = g->M, KS = g->K / 32, ldx = g->ldx, blocks = g->N / 16;
    const int silu = g->epilogue == TEAM_EPI_SILU_MUL;
    const int64_t half = g->N / 32;
    const int mt = (int)((M + 15) / 16), rows = M < 16 ? (int)M : 16;
    int64_t m0[MAX_ROW_TILES] = {0, 0, 0, 0};
    int skip[MAX_ROW_TILES] = {0, 0, 0, 0};
    for (int i = 0; i < mt; i++) m0[i] = sg_row_tile_start(i, M, &skip[i]);
    float c[MAX_ROW_TILES][256] __attribute__((aligned(64)));
    float cu[MAX_ROW_TILES][256] __attribute__((aligned(64)));
    const size_t bstride = (size_t)KS * TILE_ELEMS;
    if (mt >= PAIR_MIN_ROW_TILES) {
        /* A unit is two column blocks: the gate block and its up block for the SiLU gate, else two
         * neighbours (a last odd block alone, by block()). Contiguous shares as below. */
        const int64_t units = silu ? half : (blocks + 1) / 2;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (silu) {
                pair_block(g->x, ldx, m0, mt, g->packed + u * bstride, g->packed + (half + u) * bstride, KS, c, cu);
                const int64_t col = 16 * u, bup = 16 * (half + u);
                for (int i = 0; i < mt; i++)
                    for (int r = skip[i]; r < rows; r++) epilogue_row(g, c[i], cu[i], r, m0[i] + r, col, col, bup);
                continue;
            }
            const int64_t col = 32 * u;
            const int two = 2 * u + 1 < blocks;
            if (two)
                pair_block(g->x, ldx, m0, mt, g->packed + 2 * u * bstride, g->packed + (2 * u + 1) * bstride, KS, c,
                           cu);
            else
                block(g->x, ldx, m0, mt, g->packed + 2 * u * bstride, KS, c);
            for (int i = 0; i < mt; i++)
                for (int r = skip[i]; r < rows; r++) {
                    epilogue_row(g, c[i], NULL, r, m0[i] + r, col, col, col);
                    if (two) epilogue_row(g, cu[i], NULL, r, m0[i] + r, col + 16, col + 16, col + 16);
                }
        }
        return;
    }
    const int64_t units = silu ? half : blocks;
    /* Contiguous shares (static): each thread streams one run of the packed weight. */
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        block(g->x, ldx, m0, mt, g->packed + u * bstride, KS, c);
        if (silu) block(g->x, ldx, m0, mt, g->packed + (half + u) * bstride, KS, cu);
        const int64_t col = 16 * u, bup = 16 * (half + u);
        for (int i = 0; i < mt; i++)
            for (int r = skip[i]; r < rows; r++) epilogue_row(g, c[i], cu[i], r, m0[i] + r, col, col, bup);
    }
}

typedef struct {
    int64_t size;           /* sizeof(sg_amx_rows_linear_args) */
    int64_t M;              /* rows of x and y, 1 .. 64 */
    int64_t N;              /* outputs, a multiple of 16 */
    int64_t K;              /* inputs, a multiple of 32 */
    const uint16_t *x;      /* (M, K) bfloat16 rows, row stride ldx */
    int64_t ldx;            /* row stride of x, elements, >= K */
    const uint16_t *packed; /* sg_amx_pack's layout of the (N, K) bfloat16 weight */
    uint16_t *y;            /* (M, N) bfloat16, row stride ldy */
    int64_t ldy;            /* row stride of y, elements, >= N */
} sg_amx_rows_linear_args;

/* y = bf16(x W^T) for a few rows in its own parallel region: the LM head of a decode step of 2-64 rows
 * (49,152 x 576 for SmolLM2, 56 MB streamed once), by the same product as the decode stack's projections
 * (and the same bits as sg_amx_linear's). Returns 0, -1 (a shape it does not take), -5 (another struct
 * size) or -6 (no AMX in this process). */
int sg_amx_rows_linear(const sg_amx_rows_linear_args *a) {
    if (a->size != (int64_t)sizeof *a) return -5;
    if (!sg_team_gemm_fits(a->M, a->N, a->K, TEAM_EPI_NONE) || a->ldx < a->K || a->ldy < a->N) return -1;
    if (!sg_amx_granted()) return -6;
    const sg_team_gemm g = {.M = a->M, .N = a->N, .K = a->K, .x = a->x, .ldx = a->ldx, .packed = a->packed,
                            .y = a->y, .ldy = a->ldy, .epilogue = TEAM_EPI_NONE};
#pragma omp parallel
    {
        sg_team_tiles_begin(g.M);
        sg_team_gemm_run(&g);
        sg_team_tiles_end();
    }
    return 0;
}
