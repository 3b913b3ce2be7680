/* The tile GEMM that a team of threads runs from inside a parallel region it is already in: the decode
 * stack's projections for decode batches of 2-64 rows, on AMX (segserve_amx_team.c) or on vdpbf16ps
 * register tiles (segserve_bf16gemm.c), both over sg_amx_pack's layout.
 * Internal to the library (hidden symbols, no ctypes mirror). */
#ifndef SEGSERVE_AMX_TEAM_H
#define SEGSERVE_AMX_TEAM_H

#include <stdint.h>

enum { TEAM_EPI_NONE = 0, TEAM_EPI_RESIDUAL = 1, TEAM_EPI_SILU_MUL = 2 };

/* One product y = x W^T (+ bias) through an epilogue, W in sg_amx_pack's tile layout (internal: tagged,
 * so tests/kernels/test_c_interface.py does not look for a ctypes mirror). */
typedef struct sg_team_gemm {
    int64_t M;              /* rows of x and y, 1 .. 64 */
    int64_t N;              /* outputs of W, a multiple of 16 (of 32 for TEAM_EPI_SILU_MUL) */
    int64_t K;              /* inputs, a multiple of 32 */
    const uint16_t *x;      /* (M, K) bfloat16 rows, row stride ldx */
    int64_t ldx;            /* >= K */
    const uint16_t *packed; /* sg_amx_pack's layout of the (N, K) bfloat16 weight */
    const uint16_t *bias;   /* (N,) bfloat16 or NULL */
    uint16_t *y;            /* (M, N) bfloat16 (TEAM_EPI_SILU_MUL: (M, N/2)), row stride ldy */
    int64_t ldy;
    int32_t epilogue;       /* TEAM_EPI_*: y = r(acc); y = r(y + r(acc)); y = r(r(silu(r(gate))) * r(up)) */
} sg_team_gemm;

/* Whether a product of these shapes is one sg_team_gemm_run takes (1 or 0). */
__attribute__((visibility("hidden"))) int sg_team_gemm_fits(int64_t M, int64_t N, int64_t K, int epilogue);

/* Every thread of the team, once per region before its first product: load the tile configuration for
 * products of M rows (all of them that region's), and at the end release it. */
__attribute__((visibility("hidden"))) void sg_team_tiles_begin(int64_t M);
__attribute__((visibility("hidden"))) void sg_team_tiles_end(void);

/* The product, shared by the calling team through an orphaned worksharing loop over 16-column blocks
 * (ending in the team's barrier); every thread of the region must call it. Shapes are the caller's to
 * check (sg_team_gemm_fits), the tiles its to configure (sg_team_tiles_begin). */
__attribute__((visibility("hidden"))) void sg_team_gemm_run(const sg_team_gemm *g);

/* The same product on vdpbf16ps register tiles (segserve_bf16gemm.c; no tile configuration, no AMX):
 * the calling thread's share of the columns, ending without a barrier (the caller's team_sync). */
__attribute__((visibility("hidden"))) void sg_team_gemm_run_bf16(const sg_team_gemm *g);

#endif
