/* segserve AMX kernels: a bfloat16 GEMM on Intel AMX tiles for prefill and batched steps.
 *
 *   sg_amx_probe   whether AMX-BF16 can run in this process (CPUID, XCR0, and Linux's tile permission,
 *                  requested here); 1 or 0. Nothing else in this file runs before it said 1.
 *   sg_amx_pack    a (N, K) row-major bfloat16 weight -> the VNNI tile layout the GEMM streams.
 *   sg_amx_linear  y = x W^T (+ bias) for M >= 1 rows, float32 accumulation in tiles, with an optional
 *                  epilogue: the residual add (y += result) or SiLU(gate) * up over a fused gate|up weight.
 *   sg_amx_peak    a register-only microkernel (4 accumulators, no memory traffic) for the benchmark's
 *                  measured peak.
 *
 * The entry points follow segserve_cpu.c's calling convention (one sg_*_args struct whose first field is
 * its size; ERR_LAYOUT before anything is read otherwise). The AMX code is compiled with per-function
 * target attributes, so the file builds and loads on AVX-512 CPUs without AMX; there sg_amx_probe says 0
 * and the others refuse with ERR_NO_AMX instead of faulting.
 *
 * Packed layout: for each 16-column block nb of the output and each 32-wide step ks of K, one 16 x 64-byte
 * B tile: row r holds, for the 16 output columns c, the pair W[nb*16 + c][ks*32 + 2r .. +1] (VNNI). Tile
 * (nb, ks) starts at bf16 offset (nb * K/32 + ks) * 512, so one column block's K steps are contiguous.
 *
 * Blocking: the output is cut into work items, a chunk of column units (<= ~1 MiB of W, the L2 share)
 * by a chunk of rows (~128 KiB of x), at least ~4 per thread where the columns allow; OpenMP threads
 * (PyTorch's pool) take them dynamically, column chunk first (2026-12-02: a static split of the columns
 * between the threads waited for whichever thread the machine's other tenants had descheduled). An item
 * walks its columns in panels of up to 2 blocks (row pairs of tiles: 2 x 2 accumulators, 2 A + 2 B
 * tiles) or 4 blocks (a single row tile: 1 x 4 accumulators, 1 A + 3 B tiles); its W chunk is reused
 * from L2 by every row pair, its x chunk by every panel. x is read straight from its row-major rows
 * (tile loads with its stride); a last partial row tile is the 16 rows ending at row M (overlapping the
 * previous tile; only its new rows are written) and M < 16 configures tiles of M rows.
 *
 * Stores (tile -> float32 -> epilogue -> rows) are queued: the next microkernel's K loop stores a few
 * rows per step, so the epilogue (above all the SiLU gate's exp and divide per value) overlaps the tile
 * products (two accumulator buffers in turn; a thread's last microkernel drains its own). Until
 * 2026-12-05 every epilogue but the SiLU gate was staged instead (an item's tiles to a per-thread float32
 * buffer, stored by one pass after the item), measured ahead on 2026-12-02 in a /tmp harness. Measured
 * again on 2026-12-05 in the engine, the two libraries alternating in one process (a 4,096-token bf16
 * prefill, 6 rounds: 1.001 vs 1.001 s; 1,088 tokens, 8 rounds: 0.204 vs 0.207 s), the two are level, so
 * the simpler path stays. (A /tmp harness that showed the queue 2-4 % ahead called amx.linear with two
 * fresh outputs alive in turn, ~190 page faults a call: harness numbers for this kernel need outputs
 * that do not fault, and the engine decides.) Storing the rows of the non-SiLU projections right after
 * each microkernel instead of in the next one's K loop: 1.014x the prefill's time (same A/B).
 *
 * Prefetch (2026-12-02, round 4): at prefill sizes (M = 4,096: x 4.7 MB, y up to 12.6 MB) neither x nor
 * y stays in L2 between items, so the first panel of an item waited on x's rows and the stores on y's
 * lines. The 2 x 2 kernel's K loop therefore issues a few prefetches per step: the rows of x this
 * thread will likely take next (the row chunk ``threads`` chunks ahead) into L2, and each microkernel's
 * 32 output rows, stored by the next one. One thread, M = 4,096, paired median over 80 rounds against
 * the kernel before round 3 (queued stores, static split, no prefetch), load ~5: gate|up 1.11x, qkv
 * 1.37x, down 1.15x, o 1.09x (the other epilogues then staged; without the prefetches ~1.0x). Without
 * both prefetches (2026-12-05, the engine A/B above): 1.067x the 4,096-token prefill's time, though a
 * harness with its data warm in cache ran 3-9 % faster without them.
 *
 * Speed (one core, min over many calls; the host has phases where the tile unit runs ~3x slower, so a
 * figure means little without the register-only peak measured beside it, ~2,100-2,200 GFLOP/s when
 * fast): the 2 x 2 loop with its tile loads, all data in L1, ~72 % of that peak (each reload waits
 * for the products still reading the tile); without any store ~50-60 %; the GEMM at M = 512 ~43-47 %
 * on qkv, o and down, ~38 % on gate|up; at M = 4,096 (one prefill chunk) ~33-38 % and ~23 %.
 *
 * Tile state is per thread: each call's parallel region loads the tile configuration in every thread
 * and releases it (tilerelease) at the end, so threads that then run AVX-512 or PyTorch code carry no
 * AMX state (a configured thread saves 8 KiB more on every context switch). A load + release costs well
 * under a microsecond, against >= ~10 us for the smallest GEMM that takes this path.
 *
 * Numerics: the products of bf16 pairs are exact and summed in float32 (in the tile unit's order); the
 * bias is added in float32, then the result is rounded to bfloat16 (nearest even) or kept as float32. The
 * epilogues round where the eager model rounds: residual y = bf16(y + bf16(acc)); SiLU-mul
 * bf16(bf16(silu(bf16(gate))) * bf16(up)) with silu(g) = g / (1 + exp(-g)), exp a Cephes polynomial
 * (~1 ulp; the one segserve_cpu.c uses).
 */
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "segserve_simd.h"

enum { AMX_OK = 0, AMX_ERR_SHAPE = -1, AMX_ERR_LAYOUT = -5, AMX_ERR_NO_AMX = -6 };
enum { AMX_DT_F32 = 0, AMX_DT_BF16 = 1 };
enum { EPI_NONE = 0, EPI_RESIDUAL = 1, EPI_SILU_MUL = 2, EPI_ROPE_KV = 3 };

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))
#ifndef L2_W_BYTES
#define L2_W_BYTES (1 << 20) /* weight bytes per column chunk, kept in L2 (2 MiB per core) */
#endif
#ifndef L2_X_BYTES
#define L2_X_BYTES (1 << 17) /* bytes of x per row chunk, kept in L2 beside it */
#endif
#define TILE_ELEMS 512 /* bf16 values in one packed B tile (16 rows x 32) */

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILECFG 17
#define XFEATURE_XTILEDATA 18


/* ---- probe ------------------------------------------------------------------------------------ */

typedef struct {
    int64_t size; /* sizeof(sg_amx_probe_args) */
} sg_amx_probe_args;

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* 1 when this process may run AMX-BF16: CPUID.(7,0):EDX AMX-BF16 (bit 22) and AMX-TILE (bit 24), the OS
 * enabled XSAVE with both tile state components in XCR0, and Linux granted XTILEDATA to the process
 * (arch_prctl ARCH_REQ_XCOMP_PERM; the grant is per process, every thread inherits it). Else 0. */
int sg_amx_granted(void) {
    static int state; /* 0 not asked, 1 granted, -1 not: the answers agree, so racing threads are harmless */
    if (state == 0) {
        unsigned int eax, ebx, ecx, edx;
        uint64_t tiles = (1ull << XFEATURE_XTILECFG) | (1ull << XFEATURE_XTILEDATA);
        unsigned long perm = 0;
        int ok = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 27)) /* OSXSAVE */
                 && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx & (1u << 22)) && (edx & (1u << 24))
                 && (xgetbv0() & tiles) == tiles
                 && !syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
                 && !syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &perm) && (perm & (1ul << XFEATURE_XTILEDATA));
        state = ok ? 1 : -1;
    }
    return state > 0;
}

int sg_amx_probe(const sg_amx_probe_args *a) {
    if (a->size != (int64_t)sizeof *a) return AMX_ERR_LAYOUT;
    return sg_amx_granted();
}

/* ---- packing ---------------------------------------------------------------------------------- */

typedef struct {
    int64_t size;       /* sizeof(sg_amx_pack_args) */
    int64_t N;          /* rows of w (outputs), a multiple of 16 */
    int64_t K;          /* columns of w, a multiple of 32 */
    const uint16_t *w;  /* (N, K) bfloat16, row stride ldw */
    int64_t ldw;        /* row stride of w, elements, >= K */
    uint16_t *packed;   /* N * K bfloat16 values: the tile layout (file comment) */
} sg_amx_pack_args;

/* Transpose a 16 x 16 matrix of 32-bit lanes in place (r[i] is row i): a packed tile is the 16 x 16
 * transpose of a (16 columns x 32 K values) block read as 32-bit K pairs. */
static inline void transpose16x32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Pure data movement (no AMX instruction), so it runs on any CPU with AVX-512: each tile is 16 row
 * loads, a 32-bit transpose and 16 stores (a weight dequantized per large step, a GGUF one, is packed
 * on every call, so this is on the step's path). Returns OK, ERR_LAYOUT or ERR_SHAPE. */
int sg_amx_pack(const sg_amx_pack_args *a) {
    if (a->size != (int64_t)sizeof *a) return AMX_ERR_LAYOUT;
    const int64_t N = a->N, K = a->K, ldw = a->ldw, KS = K / 32;
    const uint16_t *w = a->w;
    uint16_t *packed = a->packed;
    if (N < 16 || K < 32 || N % 16 || K % 32 || ldw < K) return AMX_ERR_SHAPE;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t ks = 0; ks < KS; ks++) {
            __m512i r[16];
            for (int c = 0; c < 16; c++) r[c] = _mm512_loadu_si512(w + (nb * 16 + c) * ldw + ks * 32);
            transpose16x32(r); /* r[k pair] = that pair of each of the 16 columns */
            uint16_t *t = packed + (nb * KS + ks) * TILE_ELEMS;
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(t + 32 * i, r[i]);
        }
    return AMX_OK;
}

/* ---- tiles ------------------------------------------------------------------------------------ */

typedef struct tile_config { /* internal (a tag, so the interface test's parser skips it) */
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-3: float32 accumulators (rows x 16); 4-7: bf16 operands, A (rows x 32) or B (16 x 32 as pairs).
 * ``rows`` (<= 16) is the row count of the accumulator and A tiles; B tiles always have 16 (K pairs). */
AMX_TARGET static void configure_tiles(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (uint8_t)rows;
    }
    /* In the 2 x 2 kernel tiles 4 and 5 are A tiles and 6, 7 B; in 1 x 4, 4 is A and 5-7 are B. A B
     * tile of fewer rows would drop K pairs, so only row counts of 16 make B tiles; M < 16 calls use
     * the 1 x 4 kernel, whose B tiles 5-7 keep 16 rows. */
    if (rows < 16)
        for (int t = 5; t < 8; t++) cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* ---- epilogue --------------------------------------------------------------------------------- */

/* What the store of one row tile needs: where it goes and how (internal, tagged like tile_config). */
typedef struct store_plan {
    int epilogue, ydt;
    int64_t ldy;
    void *y;
    const uint16_t *bias; /* (N,) bf16 or NULL */
    /* EPI_ROPE_KV only: sg_amx_linear_args' fields of the same names */
    int64_t D, rope_heads, kv_heads, n_slots, num_slots;
    const uint16_t *cos, *ssin;
    const int64_t *slots;
    uint16_t *kv_cache;
} store_plan;

/* 16 float32 lanes rounded to bfloat16 (nearest even) and stored: the bits sg_bf16_store16 writes
 * after sg_bf16_round16, without widening the rounded values back to float32 and narrowing them again
 * (5 fewer instructions per row of the epilogue). */
static inline void store_bf16_rounded(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* EPI_ROPE_KV's store of a row pair (below store_row). */
static inline void rope_kv_row(const store_plan *p, const float *c, const float *hi_acc, int r, int64_t m,
                               int64_t col, int64_t col_hi);

/* Row r of accumulator buffer c (rows x 16 float32) to output row m0 + r, columns col .. col + 15 (bias
 * columns bcol ..); ``up`` the paired up-projection buffer for EPI_SILU_MUL, whose output column is
 * ``col`` of the (M, N/2) result and whose bias columns are ``bcol_up`` ..; for EPI_ROPE_KV ``up`` is the
 * rotation partners' buffer and ``bcol_up`` their column (rope_kv_row). */
static inline void store_row(const store_plan *p, const float *c, const float *up, int r, int64_t m0, int64_t col,
                             int64_t bcol, int64_t bcol_up) {
    if (p->epilogue == EPI_ROPE_KV) {
        rope_kv_row(p, c, up, r, m0 + r, col, bcol_up);
        return;
    }
    __m512 v = _mm512_loadu_ps(c + r * 16);
    if (p->bias) v = _mm512_add_ps(v, sg_bf16x16_to_f32(p->bias + bcol));
    int64_t at = (m0 + r) * p->ldy + col;
    if (p->epilogue == EPI_SILU_MUL) {
        __m512 u = _mm512_loadu_ps(up + r * 16);
        if (p->bias) u = _mm512_add_ps(u, sg_bf16x16_to_f32(p->bias + bcol_up));
        __m512 g = sg_bf16_round16(v);
        u = sg_bf16_round16(u);
        __m512 e = sg_exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 s = sg_bf16_round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store_bf16_rounded((uint16_t *)p->y + at, _mm512_mul_ps(s, u));
    } else if (p->ydt == AMX_DT_F32) {
        _mm512_storeu_ps((float *)p->y + at, v);
    } else if (p->epilogue == EPI_RESIDUAL) {
        v = sg_bf16_round16(v);
        store_bf16_rounded((uint16_t *)p->y + at, _mm512_add_ps(sg_bf16x16_to_f32((uint16_t *)p->y + at), v));
    } else {
        store_bf16_rounded((uint16_t *)p->y + at, v);
    }
}

/* EPI_ROPE_KV, row m: 16 dims d .. d + 15 of a head (col = head * D + d, d < D / 2) from accumulator c and
 * their rotation partners d + D / 2 (col_hi) from hi_acc. Each is rounded to bfloat16 as the plain store
 * rounds it; a Q or K head is then rotated as sg_rope rotates the stored rows (with its tables as sg_rope
 * rounds them, each product and sum rounded: segserve_cpu.c's rope_row16's operations in its order), so
 * y gets the bits of this GEMM's plain output after sg_rope. K and V heads also go to the row's cache
 * slot (rows below n_slots), the bits sg_write_kv copies there. */
static inline void rope_kv_row(const store_plan *p, const float *c, const float *hi_acc, int r, int64_t m,
                               int64_t col, int64_t col_hi) {
    __m512 lo = _mm512_loadu_ps(c + r * 16), hi = _mm512_loadu_ps(hi_acc + r * 16);
    if (p->bias) {
        lo = _mm512_add_ps(lo, sg_bf16x16_to_f32(p->bias + col));
        hi = _mm512_add_ps(hi, sg_bf16x16_to_f32(p->bias + col_hi));
    }
    lo = sg_bf16_round16(lo);
    hi = sg_bf16_round16(hi);
    const int64_t D = p->D, half = D / 2, head = col / D, d = col - head * D;
    if (head < p->rope_heads) {
        const uint16_t *cs = p->cos + m * D, *sn = p->ssin + m * D;
        const __m512 c_lo = sg_bf16x16_to_f32(cs + d), s_lo = sg_bf16x16_to_f32(sn + d);
        const __m512 c_hi = sg_bf16x16_to_f32(cs + half + d), s_hi = sg_bf16x16_to_f32(sn + half + d);
        const __m512 a_lo = sg_bf16_round16_exact(_mm512_mul_ps(lo, c_lo));
        const __m512 b_lo = sg_bf16_round16_exact(_mm512_mul_ps(hi, s_lo));
        const __m512 a_hi = sg_bf16_round16_exact(_mm512_mul_ps(hi, c_hi));
        const __m512 b_hi = sg_bf16_round16_exact(_mm512_mul_ps(lo, s_hi));
        lo = sg_bf16_round16_exact(_mm512_add_ps(a_lo, b_lo));
        hi = sg_bf16_round16_exact(_mm512_add_ps(a_hi, b_hi));
    }
    uint16_t *y = (uint16_t *)p->y + m * p->ldy;
    sg_bf16_store16(y + col, lo);
    sg_bf16_store16(y + col_hi, hi);
    const int64_t kv = head - (p->rope_heads - p->kv_heads); /* 0 .. 2 Hkv - 1: K heads, then V heads */
    if (kv >= 0 && m < p->n_slots) {
        const int64_t Hkv = p->kv_heads, v = kv >= Hkv;
        uint16_t *dst = p->kv_cache + v * p->num_slots * Hkv * D + (p->slots[m] * Hkv + kv - v * Hkv) * D;
        sg_bf16_store16(dst + d, lo);
        sg_bf16_store16(dst + half + d, hi);
    }
}

/* The stores of one microkernel's accumulators, deferred: while the next microkernel's tile products
 * run, its K loop drains a few of these rows per step, so the AVX-512 epilogue (the SiLU gate's exp and
 * divide above all) overlaps the tile unit instead of idling it between products. A job is rows
 * [skip, rows) of buffer c (and up) to output rows m0 + r (internal, tagged like tile_config). */
typedef struct store_job {
    const float *c, *up;
    int skip, rows;
    int64_t m0, col, bcol, bcol_up;
} store_job;

typedef struct store_queue {
    store_job job[4];
    int n, at, row; /* jobs queued; the job and row to store next */
} store_queue;

static inline void queue_push(store_queue *q, const float *c, const float *up, int skip, int rows, int64_t m0,
                              int64_t col, int64_t bcol, int64_t bcol_up) {
    q->job[q->n++] = (store_job){c, up, skip, rows, m0, col, bcol, bcol_up};
}

static inline int queue_rows(const store_queue *q) {
    int n = 0;
    for (int j = q->at; j < q->n; j++) n += q->job[j].rows - q->job[j].skip;
    return n;
}

/* Store up to ``budget`` queued rows, in order; an emptied queue is reset. */
static inline void queue_drain(const store_plan *p, store_queue *q, int budget) {
    while (budget > 0 && q->at < q->n) {
        const store_job *j = &q->job[q->at];
        if (q->row < j->skip) q->row = j->skip;
        if (q->row >= j->rows) {
            q->at++;
            q->row = 0;
            continue;
        }
        store_row(p, j->c, j->up, q->row++, j->m0, j->col, j->bcol, j->bcol_up);
        budget--;
    }
    if (q->at >= q->n) q->n = q->at = q->row = 0;
}

/* ---- microkernels ----------------------------------------------------------------------------- */

/* A block of rows to prefetch a few 64-byte lines at a time while tile products run: ``rows`` rows of
 * ``row_lines`` lines each, ``ld`` bytes apart, from ``row`` (the current one) at line ``col``; ``per``
 * lines per K step (internal, tagged like tile_config). */
typedef struct line_stream {
    const char *row;
    int64_t ld, row_lines, col, rows;
    int per;
} line_stream;

static inline void stream_start(line_stream *ls, const void *first, int64_t ld, int64_t row_bytes, int64_t rows,
                                int64_t steps) {
    ls->row = (const char *)first;
    ls->ld = ld;
    ls->row_lines = (row_bytes + 63) / 64;
    ls->col = 0;
    ls->rows = rows > 0 && steps > 0 ? rows : 0;
    ls->per = ls->rows ? (int)((ls->rows * ls->row_lines + steps - 1) / steps) : 0;
}

/* The next ``per`` lines into L2 (x, read by the next item). */
static inline void stream_step(line_stream *ls) {
    for (int i = 0; i < ls->per && ls->rows; i++) {
        _mm_prefetch(ls->row + 64 * ls->col, _MM_HINT_T1);
        if (++ls->col == ls->row_lines) {
            ls->col = 0;
            ls->row += ls->ld;
            ls->rows--;
        }
    }
}

/* Where a microkernel stores its float32 accumulators: accumulator (row tile i, column block j) at
 * c + i ldt + j ldb, its rows ldr floats apart (internal, tagged like tile_config). */
typedef struct tile_dst {
    float *c;
    int64_t ldt, ldb, ldr;
    const char *out0, *out1; /* where rows 0-15 of each row tile will be stored (2 x 2 kernel only) */
    int64_t ldo;             /* their row stride, bytes */
} tile_dst;

/* Two row tiles (rows m0, m1) x nr (1 or 2) column blocks b[0..nr) over KS steps of K: accumulators
 * 0 (m0 b0), 1 (m0 b1), 2 (m1 b0), 3 (m1 b1); A tiles 4, 5; B tiles 6, 7. Drains the queue (the previous
 * microkernel's rows, never buffer c) a few rows per K step, then stores to c[0..3]. */
AMX_TARGET static inline void kernel_2x(const uint16_t *x0, const uint16_t *x1, int64_t ldxb,
                                        const uint16_t *const b[4], int nr, int64_t KS, const tile_dst *d,
                                        const store_plan *p, store_queue *q, line_stream *ls) {
    const int per = (int)((queue_rows(q) + KS - 1) / KS), pfper = (int)((32 + KS - 1) / KS);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ks = 0; ks < KS; ks++) {
        for (int i = 0, r = (int)ks * pfper; i < pfper && r < 32; i++, r++)
            __builtin_prefetch(r < 16 ? d->out0 + r * d->ldo : d->out1 + (r - 16) * d->ldo, 1, 3);
        stream_step(ls);
        /* x's tiles with the no-reuse hint (TILELOADDT1): each is read once per panel, while the
         * panel's B tiles are read again by every row pair of the item, and plain loads of x pushed
         * those out of L1. 2026-12-04, engine steps of 1,088 rows (profile_prefill.py --budgets 1088,
         * alternating builds, 5 pairs): the GEMMs 1,855-1,925 -> 1,965-2,016 GFLOP/s; 256 rows
         * 1,370-1,453 -> 1,461-1,512; one 4,096-row step unchanged. Same bits. */
        _tile_stream_loadd(4, x0 + ks * 32, ldxb);
        _tile_loadd(6, b[0] + ks * TILE_ELEMS, 64);
        _tile_stream_loadd(5, x1 + ks * 32, ldxb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (nr > 1) {
            _tile_loadd(7, b[1] + ks * TILE_ELEMS, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (q->n) queue_drain(p, q, per);
    }
    queue_drain(p, q, 1 << 30);
    const int64_t sb = d->ldr * 4;
    _tile_stored(0, d->c, sb);
    _tile_stored(2, d->c + d->ldt, sb);
    if (nr > 1) {
        _tile_stored(1, d->c + d->ldb, sb);
        _tile_stored(3, d->c + d->ldt + d->ldb, sb);
    }
}

/* One row tile x nr (1..4) column blocks: accumulators 0-3, A tile 4, B tiles 5, 6, 7 (5 again for the
 * fourth block, once accumulator 0 has read it). Drains the queue as kernel_2x does; stores to c[0..nr). */
AMX_TARGET static inline void kernel_1x(const uint16_t *x0, int64_t ldxb, const uint16_t *const b[4], int nr,
                                        int64_t KS, const tile_dst *d, const store_plan *p, store_queue *q) {
    const int per = (int)((queue_rows(q) + KS - 1) / KS);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ks = 0; ks < KS; ks++) {
        int64_t off = ks * TILE_ELEMS;
        _tile_loadd(4, x0 + ks * 32, ldxb);
        _tile_loadd(5, b[0] + off, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nr > 1) {
            _tile_loadd(6, b[1] + off, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (nr > 2) {
            _tile_loadd(7, b[2] + off, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (nr > 3) {
            _tile_loadd(5, b[3] + off, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        if (q->n) queue_drain(p, q, per);
    }
    queue_drain(p, q, 1 << 30);
    const int64_t sb = d->ldr * 4;
    _tile_stored(0, d->c, sb);
    if (nr > 1) _tile_stored(1, d->c + d->ldb, sb);
    if (nr > 2) _tile_stored(2, d->c + 2 * d->ldb, sb);
    if (nr > 3) _tile_stored(3, d->c + 3 * d->ldb, sb);
}

/* ---- GEMM ------------------------------------------------------------------------------------- */

typedef struct {
    int64_t size;          /* sizeof(sg_amx_linear_args) */
    int64_t M;             /* rows of x and y, >= 1 */
    int64_t N;             /* outputs of the packed weight, a multiple of 16 (of 32 for EPI_SILU_MUL) */
    int64_t K;             /* inputs, a multiple of 32 */
    const uint16_t *x;     /* (M, K) bfloat16 rows, row stride ldx, each row contiguous */
    int64_t ldx;           /* row stride of x, elements, >= K */
    const uint16_t *packed; /* sg_amx_pack's layout of the (N, K) weight */
    const uint16_t *bias;  /* (N,) bfloat16 or NULL */
    void *y;               /* (M, N) (EPI_SILU_MUL: (M, N/2)), row stride ldy */
    int64_t ldy;           /* row stride of y, elements */
    int32_t ydt;           /* dtype of y: 0 float32, 1 bfloat16 (the epilogues need bfloat16) */
    int32_t epilogue;      /* EPI_NONE, EPI_RESIDUAL, EPI_SILU_MUL (gate | up), EPI_ROPE_KV (see below) */
    int64_t D;                   /* EPI_ROPE_KV's fields from here (else ignored): head dim, a multiple of 32 */
    int64_t rope_heads;          /* heads rotated: Q then K, [0, rope_heads) */
    int64_t kv_heads;            /* K heads [rope_heads - kv_heads, rope_heads); V heads after them */
    const uint16_t *cos;         /* (M, D) bfloat16 rows (sg_rope's float32 tables rounded, as it rounds them) */
    const uint16_t *ssin;        /* (M, D) bfloat16 rows, sin with its first half negated */
    const int64_t *slots;        /* (n_slots,) cache slot of rows 0 .. n_slots - 1 */
    int64_t n_slots;             /* rows with a slot (<= M); the rest (padding) write no cache */
    uint16_t *kv_cache;          /* [2, num_slots, kv_heads, D] bfloat16 contiguous (K then V) */
    int64_t num_slots;           /* slots of the cache (num_blocks x block_size) */
} sg_amx_linear_args;

/* A thread's state across its microkernels (internal, tagged like tile_config): two accumulator buffers
 * used in turn, so a kernel never overwrites the rows still queued, and the queue of stores. */
typedef struct gemm_state {
    float c[2][4][256] __attribute__((aligned(64)));
    int flip;
    store_queue q;
    int64_t ahead; /* row tiles between this thread's consecutive items (threads x the row chunk) */
    line_stream ls; /* prefetches of x for the next item */
} gemm_state;

/* Whether a unit is two column blocks (their accumulators stored together): the SiLU gate's gate block
 * and its up block, or RoPE's dims d .. d + 15 of a head and their partners d + D / 2 .. */
static inline int units_paired(const sg_amx_linear_args *a) {
    return a->epilogue == EPI_SILU_MUL || a->epilogue == EPI_ROPE_KV;
}

/* Column block of unit u: its only one, or of a paired unit the first (hi = 0) or the second (hi = 1).
 * EPI_SILU_MUL: gate block u, up block N/32 + u; EPI_ROPE_KV: the head's block u mod (D/32) of its first
 * half and the matching block of its second half. */
static inline int64_t unit_block(const sg_amx_linear_args *a, int64_t u, int hi) {
    if (a->epilogue == EPI_SILU_MUL) return hi ? a->N / 32 + u : u;
    if (a->epilogue == EPI_ROPE_KV) {
        const int64_t per = a->D / 32, head = u / per; /* units per head */
        return head * 2 * per + u % per + (hi ? per : 0);
    }
    return u;
}

/* The output column of unit u's (first) block: the SiLU gate writes (M, N/2), the others (M, N). */
static inline int64_t unit_col(const sg_amx_linear_args *a, int64_t u) { return 16 * unit_block(a, u, 0); }

/* Column units [u, u + units) over row tiles [t0, t1): the microkernel per row tile (pair). ``pair``: take
 * row tiles two at a time (2 x 2 kernel) where two are left. Accumulators go to the next buffer, their
 * rows queued for the next microkernel to drain. */
AMX_TARGET static void panel(const sg_amx_linear_args *a, const store_plan *p, int64_t u, int units, int64_t t0,
                             int64_t t1, int pair, gemm_state *st) {
    const int64_t M = a->M, KS = a->K / 32, ldxb = a->ldx * 2;
    const int paired = units_paired(a);
    const int rows = M < 16 ? (int)M : 16, nr = paired ? 2 * units : units;
    store_queue *q = &st->q;
    const uint16_t *b[4];
    int64_t lo[4], hi[4]; /* each unit's column block(s) (up to 4 units: 1 x 4 blocks, unpaired) */
    for (int j = 0; j < units; j++) {
        lo[j] = unit_block(a, u + j, 0);
        hi[j] = unit_block(a, u + j, 1);
        b[j] = a->packed + lo[j] * KS * TILE_ELEMS;
        if (paired) b[units + j] = a->packed + hi[j] * KS * TILE_ELEMS;
    }
    for (int64_t t = t0; t < t1;) {
        int skip0, skip1;
        int64_t m0 = sg_row_tile_start(t, M, &skip0);
        float (*cb)[256] = st->c[st->flip];
        tile_dst d = {cb[0], 512, 256, 16, NULL, NULL, 0}; /* cb[0], cb[1] row tile m0; cb[2], cb[3] m1 */
        st->flip ^= 1;
        if (pair && t + 1 < t1) {
            int64_t m1 = sg_row_tile_start(t + 1, M, &skip1);
            const int64_t esz = a->ydt == AMX_DT_F32 ? 4 : 2;
            d.out0 = (const char *)a->y + (m0 * a->ldy + 16 * u) * esz;
            d.out1 = (const char *)a->y + (m1 * a->ldy + 16 * u) * esz;
            d.ldo = a->ldy * esz;
            kernel_2x(a->x + m0 * a->ldx, a->x + m1 * a->ldx, ldxb, b, nr, KS, &d, p, q, &st->ls);
            for (int j = 0; j < units; j++) {
                const int64_t col = unit_col(a, u + j), blo = 16 * lo[j], bhi = 16 * hi[j];
                queue_push(q, cb[j], paired ? cb[1] : NULL, skip0, 16, m0, col, blo, bhi);
                queue_push(q, cb[2 + j], paired ? cb[3] : NULL, skip1, 16, m1, col, blo, bhi);
            }
            t += 2;
        } else {
            kernel_1x(a->x + m0 * a->ldx, ldxb, b, nr, KS, &d, p, q);
            for (int j = 0; j < units; j++) {
                const int64_t col = unit_col(a, u + j), blo = 16 * lo[j], bhi = 16 * hi[j];
                queue_push(q, cb[j], paired ? cb[units + j] : NULL, skip0, rows, m0, col, blo, bhi);
            }
            t += 1;
        }
    }
}

/* One work item: column units [c0, c1) (a unit is a 16-column block, or for EPI_SILU_MUL a pair gate
 * block j / up block j) over row tiles [t0, t1), in panels of 2 column blocks over row-tile pairs (4
 * blocks where the item has a single row tile). */
AMX_TARGET static void gemm_item(const sg_amx_linear_args *a, const store_plan *p, int64_t c0, int64_t c1,
                                 int64_t t0, int64_t t1, gemm_state *st) {
    const int pair = t1 - t0 >= 2;
    const int64_t per = (pair ? 2 : 4) / (units_paired(a) ? 2 : 1); /* units per panel */
    /* Prefetches spread over the item's K steps: the rows of x this thread likely takes next (items go
     * column chunk first) into L2, so that the next item's first panel does not wait on memory. */
    const int64_t steps = (c1 - c0 + per - 1) / per * ((t1 - t0) / 2) * (a->K / 32);
    const int64_t r0 = 16 * (t0 + st->ahead), r1 = 16 * (t1 + st->ahead) < a->M ? 16 * (t1 + st->ahead) : a->M;
    stream_start(&st->ls, r1 > r0 ? a->x + r0 * a->ldx : a->x, a->ldx * 2, a->K * 2, r1 - r0, steps);
    for (int64_t u = c0; u < c1; u += per) panel(a, p, u, (int)(c1 - u < per ? c1 - u : per), t0, t1, pair, st);
}

/* EPI_ROPE_KV's fields: whether they describe a fused QKV output this call can write (every slot
 * checked, so a bad one writes nothing anywhere). */
static int rope_kv_ok(const sg_amx_linear_args *a) {
    const int64_t D = a->D, H = a->rope_heads, Hkv = a->kv_heads;
    if (D < 32 || D % 32 || Hkv < 1 || H <= Hkv || a->N != (H + Hkv) * D || !a->cos || !a->ssin) return 0;
    if (a->n_slots < 0 || a->n_slots > a->M || (a->n_slots && (!a->slots || !a->kv_cache))) return 0;
    for (int64_t m = 0; m < a->n_slots; m++)
        if (a->slots[m] < 0 || a->slots[m] >= a->num_slots) return 0;
    return 1;
}

/* y = x W^T (+ bias) through the epilogue, W from sg_amx_pack. Returns OK, ERR_LAYOUT, ERR_SHAPE (nothing
 * written), or ERR_NO_AMX where sg_amx_granted() is 0. EPI_RESIDUAL: y = bf16(y + bf16(acc)).
 *
 * EPI_ROPE_KV: W is a fused QKV projection (N = (rope_heads + kv_heads) * D output columns: the Q heads,
 * the K heads, the V heads) and y (M, N) gets what the plain product would after sg_rope of its
 * first rope_heads heads (RoPE in the stores, while the tile unit runs the next products, instead of a
 * pass over y), and each row below n_slots also its K and V heads in its cache slot (sg_write_kv's
 * copy). A unit is then a pair of column blocks 16 x D/2 apart, so a rotated pair of dims is stored by
 * one call. Same bits as the plain product, sg_rope and sg_write_kv in turn. */
AMX_TARGET int sg_amx_linear(const sg_amx_linear_args *a) {
    if (a->size != (int64_t)sizeof *a) return AMX_ERR_LAYOUT;
    if (!sg_amx_granted()) return AMX_ERR_NO_AMX;
    const int64_t M = a->M, N = a->N, K = a->K;
    const int epi = a->epilogue, silu = epi == EPI_SILU_MUL, paired = units_paired(a);
    if (M < 1 || N < 16 || K < 32 || N % (paired ? 32 : 16) || K % 32 || a->ldx < K) return AMX_ERR_SHAPE;
    if (epi < EPI_NONE || epi > EPI_ROPE_KV || (epi != EPI_NONE && a->ydt != AMX_DT_BF16)) return AMX_ERR_SHAPE;
    if (a->ydt != AMX_DT_F32 && a->ydt != AMX_DT_BF16) return AMX_ERR_SHAPE;
    if (a->ldy < (silu ? N / 2 : N)) return AMX_ERR_SHAPE;
    if (epi == EPI_ROPE_KV && !rope_kv_ok(a)) return AMX_ERR_SHAPE;
    store_plan p = {epi, a->ydt, a->ldy, a->y, a->bias};
    if (epi == EPI_ROPE_KV) {
        p.D = a->D, p.rope_heads = a->rope_heads, p.kv_heads = a->kv_heads, p.n_slots = a->n_slots;
        p.num_slots = a->num_slots, p.cos = a->cos, p.ssin = a->ssin, p.slots = a->slots, p.kv_cache = a->kv_cache;
    }
    const int64_t units = paired ? N / 32 : N / 16, MT = (M + 15) / 16;
    const int rows = M < 16 ? (int)M : 16;
    /* Cache blocking: an item's chunk of the weight's column units (<= ~L2_W_BYTES) is reused from L2
     * across its chunk of rows (~L2_X_BYTES of x), and that chunk of x across the item's panels. */
    const int64_t unit_bytes = K * 32 * (paired ? 2 : 1);
    int64_t nc = L2_W_BYTES / unit_bytes / 4 * 4, mc = L2_X_BYTES / (K * 32) / 2 * 2;
    if (nc < 4) nc = 4;
    if (mc < 2) mc = 2;
    /* Few rows (a serving step's short chunk): one row chunk, so that each column chunk of the weight
     * is read from memory once. With two, the second went to the other thread, whose L2 did not hold
     * that chunk: every weight byte came from memory twice, and a step's weights stream from memory
     * (30 layers' worth, no cache holds them). 30 layers of the four projections, distinct weights
     * per layer, 2 threads (AMX Xeon, /tmp harness): M = 128 28.1 -> 22.1 ms, M = 256 40.0 -> 36.2 ms,
     * M = 384 and 512 unchanged. */
    if (MT <= 4 * mc) mc = MT;
    const int64_t row_chunks = (MT + mc - 1) / mc;
    int threads = omp_get_max_threads();
    /* At least ~4 items per thread where the columns allow (fewer column units per item then): threads
     * take items as they free up, so one descheduled by the machine's other tenants delays its item, not
     * half the call (a static split of the columns waited for it). */
    int64_t col_chunks = (units + nc - 1) / nc, want = 4 * (int64_t)threads;
    if (col_chunks * row_chunks < want) col_chunks = (want + row_chunks - 1) / row_chunks;
    if (col_chunks > units) col_chunks = units;
    const int64_t cw = (units + col_chunks - 1) / col_chunks; /* units per item */
    col_chunks = (units + cw - 1) / cw;
    const int64_t items = col_chunks * row_chunks;
    if (threads > items) threads = (int)items;
#pragma omp parallel num_threads(threads)
    {
        gemm_state st;
        st.flip = 0;
        st.q.n = st.q.at = st.q.row = 0;
        st.ahead = mc * omp_get_num_threads();
        st.ls.rows = 0;
        configure_tiles(rows);
        /* Column chunk major: threads share a chunk of the weight, each with its own chunk of rows. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t c0 = it / row_chunks * cw, t0 = it % row_chunks * mc;
            gemm_item(a, &p, c0, c0 + cw < units ? c0 + cw : units, t0, t0 + mc < MT ? t0 + mc : MT, &st);
        }
        queue_drain(&p, &st.q, 1 << 30); /* the last queued microkernel's rows */
        _tile_release();
    }
    return AMX_OK;
}

/* ---- peak ------------------------------------------------------------------------------------- */

typedef struct {
    int64_t size;    /* sizeof(sg_amx_peak_args) */
    int64_t iters;   /* rounds of 4 tile products (16 x 16 x 32 multiply-adds each) per thread */
    int32_t threads; /* OpenMP threads, >= 1 */
} sg_amx_peak_args;

/* The register-only ceiling: 2 A and 2 B tiles loaded once, then iters x 4 independent tdpbf16ps into 4
 * accumulators (2 x 2, the GEMM's blocking without its loads); the caller times it. Flops: threads x
 * iters x 4 x 16384. Returns OK, ERR_LAYOUT, ERR_SHAPE or ERR_NO_AMX. */
AMX_TARGET int sg_amx_peak(const sg_amx_peak_args *a) {
    if (a->size != (int64_t)sizeof *a) return AMX_ERR_LAYOUT;
    if (!sg_amx_granted()) return AMX_ERR_NO_AMX;
    const int64_t iters = a->iters;
    if (iters < 1 || a->threads < 1) return AMX_ERR_SHAPE;
#pragma omp parallel num_threads(a->threads)
    {
        uint16_t ops[4][512] __attribute__((aligned(64)));
        float out[256] __attribute__((aligned(64)));
        for (int i = 0; i < 4 * 512; i++) ops[i / 512][i % 512] = 0x3c00; /* bf16 2^-7: sums stay finite */
        configure_tiles(16);
        _tile_loadd(4, ops[0], 64);
        _tile_loadd(5, ops[1], 64);
        _tile_loadd(6, ops[2], 64);
        _tile_loadd(7, ops[3], 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t i = 0; i < iters; i++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, out, 64); /* keeps the loop from being dropped */
        _tile_release();
        __asm__ volatile("" ::"r"(out[0]) : "memory");
    }
    return AMX_OK;
}
