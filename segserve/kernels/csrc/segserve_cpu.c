/* segserve CPU kernels (AVX-512F + AVX-512 BF16), built on first use by segserve/kernels/build.py.
 *
 * What the eager PyTorch path spends a small-batch (decode) step on is dispatch, not arithmetic: ~50
 * small ops per layer at ~5 us each, GEMVs that reach ~20 GB/s of ~30, and per-segment flash calls that
 * cost more than the few thousand keys they read. These kernels do a layer's work in a handful of calls:
 *
 *   sg_linear            y = W x (+ bias) for a few rows, with an optional prologue and residual add.
 *   sg_rope              rotary embedding of the Q and K heads of a fused QKV output, in place.
 *   sg_write_kv          K/V rows into their cache slots.
 *   sg_decode_attention  decode attention through the block table, split-KV with a log-sum-exp merge.
 *   sg_decode_stack      all layers of a decode-only step in one call.
 *   sg_rows              the elementwise work between a chunk's GEMMs: residual add + RMSNorm, SiLU gate.
 *
 * Calling convention: each entry point takes one pointer to its sg_*_args struct of named fields
 * (mirrored field for field by a ctypes.Structure in segserve/kernels/cpu.py), never a list of
 * positional arguments, where one swapped pair would read or write the wrong memory without a word.
 * Each struct's first field is its size in bytes as the caller built it; an entry point whose struct
 * has another size than its own returns ERR_LAYOUT before reading anything else, so a library and a
 * wrapper built from different versions of a struct refuse to run instead of corrupting memory (the
 * tests also compare the field names and types of both sides). Returns: OK or a negative ERR_* code.
 *
 * Numerics: float32 accumulation everywhere. Elementwise results are rounded to the activation dtype at
 * the points where the eager model rounds (RoPE matches it bit for bit); reductions (dot products, norms,
 * softmax sums) differ from PyTorch's in summation order, and exp (softmax, SiLU) is a Cephes-style
 * polynomial within ~1 ulp of PyTorch's.
 * Compiled with -ffp-contract=off so scalar code is not fused into FMAs behind our back.
 * Threads: OpenMP, sharing PyTorch's runtime (same soname, loaded after torch).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "segserve_simd.h"
#include "segserve_quant.h"
#include "segserve_amx_team.h"
#include "segserve_team_sync.h"

/* segserve_team_sync.h's shared spin budget and per-thread barrier pointer. */
atomic_int sg_sync_spin = 4096;
__thread team_barrier *sg_sync_cur = NULL;

#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "segserve CPU kernels need AVX-512F and AVX-512 BF16"
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_SILU_MUL = 2 };
enum { OK = 0, ERR_SHAPE = -1, ERR_NOMEM = -2, ERR_ROW = -3, ERR_BLOCK = -4, ERR_LAYOUT = -5 };

#define MT 4 /* rows of x per register tile */
#define NT 4 /* rows of W per register tile */
/* Dense tiles: the first pass over x's rows (m0 == 0) prefetches the tile D_PF_TILES tiles on (a
 * thread's tiles are consecutive rows of W) with the weight streams' hint (SG_STREAM_HINT, segserve_simd.h:
 * non-temporal on AMD, into L1 on Intel). Fresh-process A/B on Zen 4 (bf16, 256-token context): 8
 * decodes ~300 -> ~500 tok/s, batch 1 ~82 -> ~87; float32 unchanged within the noise; 8 tiles ahead and
 * T0 hints were no better there. */
#ifndef D_PF_TILES
#define D_PF_TILES 4
#endif
#ifndef D_PF_HINT
#define D_PF_HINT SG_STREAM_HINT
#endif

/* Bumped whenever an entry point or argument struct changes (build.ABI_VERSION must match). */
int sg_abi_version(void) { return 13; }

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, NaN kept quiet: what PyTorch's float -> bfloat16 conversion does. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load_dt(const void *p, int64_t i, int dt) {
    return dt == DT_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store_dt(void *p, int64_t i, float v, int dt) {
    if (dt == DT_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}

static inline float round_dt(float v, int dt) { return dt == DT_F32 ? v : bf16_to_f32(f32_to_bf16(v)); }

/* Round float32 lanes to dt (bfloat16: vcvtneps2bf16, round to nearest even). */
static inline __m512 round16(__m512 v, int dt) {
    if (dt == DT_F32) return v;
    __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

static inline __m512 load16(const void *p, int64_t i, int dt) {
    return dt == DT_F32 ? _mm512_loadu_ps((const float *)p + i) : sg_bf16x16_to_f32((const uint16_t *)p + i);
}

/* Store 16 lanes holding dt values: float32 as they are, bfloat16 by truncation (they are exact). */
static inline void store16(void *p, int64_t i, __m512 v, int dt) {
    if (dt == DT_F32) _mm512_storeu_ps((float *)p + i, v);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)p + i),
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

/* ---- linear ------------------------------------------------------------------------------------- */

/* Four lanes rounded to bfloat16 (nearest even) and widened back. */
static inline __m128 round4_bf16(__m128 v) {
    __m128i b = (__m128i)_mm_cvtneps_pbh(v); /* 4 bf16 in the low 64 bits */
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(b), 16));
}

static inline __m128 load4(const void *p, int64_t i, int dt) {
    if (dt == DT_F32) return _mm_loadu_ps((const float *)p + i);
    __m128i b = _mm_loadl_epi64((const __m128i *)((const uint16_t *)p + i));
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(b), 16));
}

/* Store four lanes holding dt values (bfloat16: exact, so truncation is the conversion). */
static inline void store4(void *p, int64_t i, __m128 v, int dt) {
    if (dt == DT_F32) _mm_storeu_ps((float *)p + i, v);
    else _mm_storel_epi64((__m128i *)((uint16_t *)p + i),
                          _mm_cvtepi32_epi16(_mm_srli_epi32(_mm_castps_si128(v), 16)));
}

/* Sums of four accumulators' lanes -> (sum a0, sum a1, sum a2, sum a3). */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
#define HALF(a) _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)))
    __m256 t0 = _mm256_hadd_ps(HALF(a0), HALF(a1)); /* a0 01 23, a1 01 23 | a0 45 67, a1 45 67 */
    __m256 t1 = _mm256_hadd_ps(HALF(a2), HALF(a3));
    __m256 t2 = _mm256_hadd_ps(t0, t1); /* a0 a1 a2 a3 (low 4 of 8) | the same over the high 4 */
#undef HALF
    return _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1));
}

/* One NT x (up to MT) tile: out[i] = (dot(x row m0+i, W rows n0..n0+3)) over K, float32 weights. */
static inline __attribute__((always_inline)) void tile_f32(const float *w, const float *x, int64_t ldx, int64_t K, int64_t n0, int64_t m0,
                            int mt, int pf, __m128 out[MT]) {
    const float *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const char *ahead = (const char *)(w0 + D_PF_TILES * NT * K);
    __m512 a[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) a[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
        __m512 v2 = _mm512_loadu_ps(w2 + k), v3 = _mm512_loadu_ps(w3 + k);
        if (pf)
            for (int j = 0; j < NT; j++) _mm_prefetch(ahead + 4 * (j * K + k), D_PF_HINT);
        for (int i = 0; i < MT; i++) {
            if (i >= mt) break;
            __m512 xv = _mm512_loadu_ps(x + (m0 + i) * ldx + k);
            a[i][0] = _mm512_fmadd_ps(v0, xv, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(v1, xv, a[i][1]);
            a[i][2] = _mm512_fmadd_ps(v2, xv, a[i][2]);
            a[i][3] = _mm512_fmadd_ps(v3, xv, a[i][3]);
        }
    }
    for (int i = 0; i < mt; i++) out[i] = reduce4(a[i][0], a[i][1], a[i][2], a[i][3]);
}

/* The same for bfloat16 weights and bfloat16 x: vdpbf16ps multiplies pairs exactly and sums in float32. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *w, const uint16_t *x, int64_t ldx, int64_t K, int64_t n0,
                             int64_t m0, int mt, int pf, __m128 out[MT]) {
    const uint16_t *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const char *ahead = (const char *)(w0 + D_PF_TILES * NT * K);
    __m512 a[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) a[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + k), v1 = (__m512bh)_mm512_loadu_si512(w1 + k);
        __m512bh v2 = (__m512bh)_mm512_loadu_si512(w2 + k), v3 = (__m512bh)_mm512_loadu_si512(w3 + k);
        if (pf)
            for (int j = 0; j < NT; j++) _mm_prefetch(ahead + 2 * (j * K + k), D_PF_HINT);
        for (int i = 0; i < MT; i++) {
            if (i >= mt) break;
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * ldx + k);
            a[i][0] = _mm512_dpbf16_ps(a[i][0], v0, xv);
            a[i][1] = _mm512_dpbf16_ps(a[i][1], v1, xv);
            a[i][2] = _mm512_dpbf16_ps(a[i][2], v2, xv);
            a[i][3] = _mm512_dpbf16_ps(a[i][3], v3, xv);
        }
    }
    for (int i = 0; i < mt; i++) out[i] = reduce4(a[i][0], a[i][1], a[i][2], a[i][3]);
}

/* The prologue's (PRO_RMSNORM or PRO_SILU_MUL) result for row m of x into row m of xin (K values of dt),
 * rounded to dt where the eager model rounds. */
static void prologue_row(int dt, int prologue, int64_t K, const void *x, int64_t ldx, int64_t m,
                         const void *norm_w, float eps, void *xin) {
    int64_t base = m * ldx, out = m * K;
    if (prologue == PRO_RMSNORM) {
        /* HF LlamaRMSNorm: x32 * rsqrt(mean(x32^2) + eps), rounded to dt, then weight * that. */
        __m512 ss = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __m512 v = load16(x, base + k, dt);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)K + eps));
        for (int64_t k = 0; k < K; k += 16) {
            __m512 v = round16(_mm512_mul_ps(load16(x, base + k, dt), inv), dt);
            store16(xin, out + k, round16(_mm512_mul_ps(load16(norm_w, k, dt), v), dt), dt);
        }
    } else if (prologue == PRO_SILU_MUL) {
        /* x row is [gate (K) | up (K)]: silu(gate) = gate / (1 + exp(-gate)) rounded, times up, rounded. */
        const __m512 one = _mm512_set1_ps(1.0f);
        for (int64_t k = 0; k < K; k += 16) {
            __m512 g = load16(x, base + k, dt);
            __m512 e = sg_exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
            __m512 sg = round16(_mm512_div_ps(g, _mm512_add_ps(one, e)), dt);
            store16(xin, out + k, round16(_mm512_mul_ps(sg, load16(x, base + K + k, dt)), dt), dt);
        }
    }
}

enum { ROWS_RMSNORM = 1, ROWS_SILU_MUL = 2 };

typedef struct {
    int64_t size;       /* sizeof(sg_rows_args) */
    int32_t dt;         /* dtype of every tensor */
    int32_t op;         /* ROWS_RMSNORM: [h += add;] out = rmsnorm(h); ROWS_SILU_MUL: out = silu(gate) * up */
    int64_t M;          /* rows, >= 1 */
    int64_t K;          /* values per output row, a multiple of 16 */
    void *h;            /* (M, K) for ROWS_RMSNORM (updated in place when add is set); (M, 2K) [gate | up] */
    int64_t ldh;        /* row stride of h, elements */
    const void *add;    /* (M, K) residual branch added into h first, or NULL; ROWS_RMSNORM only */
    int64_t ldadd;      /* row stride of add, elements */
    const void *norm_w; /* (K,) RMSNorm weight; ROWS_RMSNORM only */
    float eps;          /* RMSNorm epsilon */
    void *out;          /* (M, K) result rows */
    int64_t ldout;      /* row stride of out, elements */
} sg_rows_args;

/* The elementwise ops between a prefill chunk's GEMMs, one pass per row over OpenMP threads where the
 * eager model runs ~5 ops of its own (add_, pow, mean, rsqrt, mul, to, mul; or silu, mul_), each a full
 * pass over the (M, K) activations: ROWS_RMSNORM is ``h.add_(add)`` (rounded to dt, as eager) then the
 * model's RMSNorm of h; ROWS_SILU_MUL the MLP's SiLU gate. Both round where the eager model rounds (the
 * prologues of sg_linear), so results equal eager's within the norm's summation order.
 * Returns OK, ERR_LAYOUT or ERR_SHAPE. */
int sg_rows(const sg_rows_args *a) {
    if (a->size != (int64_t)sizeof *a) return ERR_LAYOUT;
    const int dt = a->dt, op = a->op;
    const int64_t M = a->M, K = a->K, ldh = a->ldh, ldadd = a->ldadd, ldout = a->ldout;
    char *h = a->h, *out = a->out;
    const char *add = a->add;
    const void *norm_w = a->norm_w;
    const float eps = a->eps;
    if (M < 1 || K < 16 || K % 16 || (op != ROWS_RMSNORM && op != ROWS_SILU_MUL)) return ERR_SHAPE;
    if (op == ROWS_SILU_MUL && add) return ERR_SHAPE;
    const size_t es = dt == DT_F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (M * K >= 16384)
    for (int64_t m = 0; m < M; m++) {
        char *hr = h + (size_t)m * ldh * es;
        if (add) {
            const char *ar = add + (size_t)m * ldadd * es;
            for (int64_t k = 0; k < K; k += 16)
                store16(hr, k, round16(_mm512_add_ps(load16(hr, k, dt), load16(ar, k, dt)), dt), dt);
        }
        prologue_row(dt, op == ROWS_RMSNORM ? PRO_RMSNORM : PRO_SILU_MUL, K, hr, 0, 0, norm_w, eps,
                     out + (size_t)m * ldout * es);
    }
    return OK;
}

typedef struct {
    int64_t size;       /* sizeof(sg_linear_args) */
    int32_t dt;         /* dtype of x, w, norm_w, bias and of the rounding of the product */
    int32_t ydt;        /* dtype of y */
    int64_t M;          /* rows of x and y, >= 1 */
    int64_t N;          /* rows of w (outputs per row), a multiple of 4 */
    int64_t K;          /* columns of w, a multiple of 32 */
    const void *x;      /* (M, K) rows, or (M, 2K) [gate | up] for PRO_SILU_MUL; each row contiguous */
    int64_t ldx;        /* row stride of x, elements */
    int32_t prologue;   /* PRO_NONE, PRO_RMSNORM or PRO_SILU_MUL */
    const void *norm_w; /* (K,) RMSNorm weight for PRO_RMSNORM, else unused */
    float eps;          /* RMSNorm epsilon */
    const void *w;      /* (N, K) contiguous */
    const void *bias;   /* (N,) or NULL */
    void *y;            /* (M, N) with row stride ldy */
    int64_t ldy;        /* row stride of y, elements */
    int32_t accumulate; /* nonzero: y = round(y + round(W x)), the eager ``h.add_(linear(x))`` */
    int32_t wqt;        /* format of w: WQT_DENSE ((N, K) dt values) or a GGUF block type (segserve_quant.h) */
    int32_t xq8;        /* block-format w only: nonzero rounds x to 16-bit fixed point first (sg_quant_matmul_i8) */
} sg_linear_args;

/* Bytes of the buffer linear_input may write for a (M, K) product with the weight format wqt. */
static size_t linear_buf_bytes(int dt, int wqt, int64_t M, int64_t K) {
    if (wqt == WQT_DENSE) return (dt == DT_F32 ? 4 : 2) * (size_t)M * K;
    return sizeof(float) * ((size_t)M * K + (dt == DT_F32 ? 0 : (size_t)M * K / 2 + 1));
}

/* The rows the product reads, with their row stride in *ld: x itself, or (in buf, linear_buf_bytes
 * long) the prologue's rows, and for a block-format weight those rows (or x) widened to float32. One
 * thread's work: the decode stack has every thread make its own copy (a few thousand values), which
 * costs less than the barrier a shared copy would need. */
static const void *linear_input(const sg_linear_args *a, void *buf, int64_t *ld) {
    const int dt = a->dt;
    const int64_t M = a->M, K = a->K, ldx = a->ldx;
    *ld = ldx;
    if (a->wqt == WQT_DENSE) {
        if (a->prologue == PRO_NONE) return a->x;
        for (int64_t m = 0; m < M; m++) prologue_row(dt, a->prologue, K, a->x, ldx, m, a->norm_w, a->eps, buf);
        *ld = K;
        return buf;
    }
    if (a->prologue == PRO_NONE && dt == DT_F32) return a->x;
    float *f = (float *)buf;
    /* bfloat16 prologue rows go after the float32 ones (M K bf16 values fill M K / 2 floats). */
    void *rows = dt == DT_F32 ? (void *)f : (void *)(f + M * K);
    for (int64_t m = 0; m < M; m++) {
        if (a->prologue != PRO_NONE) prologue_row(dt, a->prologue, K, a->x, ldx, m, a->norm_w, a->eps, rows);
        if (dt == DT_F32) continue; /* the prologue wrote float32 rows into buf */
        const uint16_t *src = a->prologue != PRO_NONE ? (const uint16_t *)rows + m * K
                                                      : (const uint16_t *)a->x + m * ldx;
        for (int64_t k = 0; k < K; k += 16) _mm512_storeu_ps(f + m * K + k, sg_bf16x16_to_f32(src + k));
    }
    *ld = K;
    return buf;
}

/* Whether sg_linear takes a's shapes and formats: OK or ERR_SHAPE. */
static int linear_shape(const sg_linear_args *a) {
    if (a->M < 1) return ERR_SHAPE;
    if (a->wqt == WQT_DENSE) return a->K % 32 || a->N % NT ? ERR_SHAPE : OK;
    if (a->N < 1 || a->K < 32 || a->K % 32 || sg_quant_block_bytes(a->wqt) == 0) return ERR_SHAPE;
    return a->xq8 && !sg_quant_int8_built() ? ERR_SHAPE : OK;
}

/* sg_linear_args.xq8 for a projection in format wqt, from a mask with bit wqt set for the formats that
 * take integer activations (sg_decode_stack_args.xq8). */
static int32_t xq8_for(int32_t mask, int32_t wqt) { return wqt != WQT_DENSE && ((mask >> wqt) & 1); }

/* The product of a's rows xin (row stride ld, from linear_input) with a plain dt weight: orphaned
 * worksharing over groups of NT weight rows, ending in the team's barrier (see sg_quant_matmul). */
static void dense_tiles(const sg_linear_args *a, const void *xin, int64_t ld) {
    /* Locals, not a->field, in the loops: the compiler cannot prove y does not alias *a. */
    const int dt = a->dt, ydt = a->ydt, accumulate = a->accumulate;
    const int64_t M = a->M, N = a->N, K = a->K, ldy = a->ldy;
    const void *w = a->w, *bias = a->bias;
    void *y = a->y;
#pragma omp for schedule(static) nowait
    for (int64_t n0 = 0; n0 < N; n0 += NT) {
        __m128 acc[MT];
        __m128 b = _mm_setzero_ps();
        if (bias)
            for (int j = 0; j < NT; j++) b[j] = load_dt(bias, n0 + j, dt);
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            int mt = M - m0 < MT ? (int)(M - m0) : MT;
            /* A copy per row count: with mt constant the accumulators stay in registers. */
#define TILE(MTC)                                                                                          \
    if (dt == DT_F32 && m0 == 0) tile_f32((const float *)w, (const float *)xin, ld, K, n0, m0, MTC, 1, acc); \
    else if (dt == DT_F32) tile_f32((const float *)w, (const float *)xin, ld, K, n0, m0, MTC, 0, acc);      \
    else if (m0 == 0) tile_bf16((const uint16_t *)w, (const uint16_t *)xin, ld, K, n0, m0, MTC, 1, acc);     \
    else tile_bf16((const uint16_t *)w, (const uint16_t *)xin, ld, K, n0, m0, MTC, 0, acc);
            switch (mt) {
            case 1: TILE(1) break;
            case 2: TILE(2) break;
            case 3: TILE(3) break;
            default: TILE(4) break;
            }
#undef TILE
            for (int i = 0; i < mt; i++) {
                int64_t at = (m0 + i) * ldy + n0;
                __m128 v = _mm_add_ps(acc[i], b);
                if (dt == DT_BF16) v = round4_bf16(v);
                if (accumulate) {
                    v = _mm_add_ps(load4(y, at, ydt), v);
                    if (ydt == DT_BF16) v = round4_bf16(v);
                }
                store4(y, at, v, ydt);
            }
        }
    }
    team_sync();
}

/* The product itself, shared by the calling team (or run alone outside a region): dense tiles here, or
 * segserve_quant.c's block kernels with the same epilogue; i8 is sg_quant_matmul_i8's shared scratch
 * (unused otherwise). Shapes are the caller's to check (linear_shape). */
static void linear_tiles(const sg_linear_args *a, const void *xin, int64_t ld, void *i8) {
    if (a->wqt == WQT_DENSE) {
        dense_tiles(a, xin, ld);
    } else if (a->xq8) {
        sg_quant_matmul_i8(a->dt, a->ydt, a->wqt, a->M, a->N, a->K, (const float *)xin, ld, a->w, a->bias, a->y,
                           a->ldy, a->accumulate, i8);
    } else {
        sg_quant_matmul(a->dt, a->ydt, a->wqt, a->M, a->N, a->K, (const float *)xin, ld, a->w, a->bias, a->y,
                        a->ldy, a->accumulate);
    }
}

/* y[m, n] (= or +=) W[n, :] . prologue(x[m, :]) (+ bias[n]) for m < M, n < N, for a few rows (decode
 * batches): W is streamed once for all rows, NT rows of W by up to MT rows of x per register tile, the
 * prologue (RMSNorm or SiLU gate) applied to x first and the residual add fused into the store; a weight
 * in a GGUF block format goes to segserve_quant.c's register tiles (rows widened to float32 first).
 * One parallel region per call. Returns OK, ERR_LAYOUT, ERR_SHAPE or ERR_NOMEM. */
int sg_linear(const sg_linear_args *a) {
    if (a->size != (int64_t)sizeof *a) return ERR_LAYOUT;
    int rc = linear_shape(a);
    if (rc != OK) return rc;
    void *buf = malloc(linear_buf_bytes(a->dt, a->wqt, a->M, a->K));
    void *i8 = a->xq8 && a->wqt != WQT_DENSE ? aligned_alloc(64, sg_quant_i8_scratch_bytes(a->M, a->K)) : NULL;
    if (!buf || (a->xq8 && a->wqt != WQT_DENSE && !i8)) rc = ERR_NOMEM;
    if (rc == OK) {
        int64_t ld;
        const void *xin = linear_input(a, buf, &ld);
#pragma omp parallel
        linear_tiles(a, xin, ld, i8);
    }
    free(buf);
    free(i8);
    return rc;
}

/* ---- RoPE and KV writes ------------------------------------------------------------------------- */

typedef struct {
    int64_t size;       /* sizeof(sg_rope_args) */
    int32_t dt;         /* dtype of x */
    int64_t T;          /* rows of x */
    int64_t H;          /* heads to rotate: [0, H) of each row */
    int64_t D;          /* head dim, even, <= 1024 */
    void *x;            /* (T, >= H * D) rows, each contiguous */
    int64_t row_stride; /* row stride of x, elements */
    const float *cos;   /* (T, D) float32 contiguous */
    const float *ssin;  /* (T, D) float32 contiguous, sin with its first half negated */
} sg_rope_args;

static inline __m512 round16x(__m512 v, int dt) { return dt == DT_F32 ? v : sg_bf16_round16_exact(v); }

/* One row's heads [0, H) rotated with AVX-512, for D a multiple of 32 (each half a whole number of
 * 16-lane vectors): the scalar loop's operations in the same order, so the same bits. c and s hold the
 * row's tables already rounded to dt. */
static void rope_row16(void *x, int64_t base0, int64_t H, int64_t D, const float *c, const float *s, int dt) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < H; h++) {
        const int64_t base = base0 + h * D;
        for (int64_t d = 0; d < half; d += 16) {
            __m512 lo = load16(x, base + d, dt), hi = load16(x, base + half + d, dt);
            __m512 a_lo = round16x(_mm512_mul_ps(lo, _mm512_loadu_ps(c + d)), dt);
            __m512 b_lo = round16x(_mm512_mul_ps(hi, _mm512_loadu_ps(s + d)), dt);
            __m512 a_hi = round16x(_mm512_mul_ps(hi, _mm512_loadu_ps(c + half + d)), dt);
            __m512 b_hi = round16x(_mm512_mul_ps(lo, _mm512_loadu_ps(s + half + d)), dt);
            store16(x, base + d, round16x(_mm512_add_ps(a_lo, b_lo), dt), dt);
            store16(x, base + half + d, round16x(_mm512_add_ps(a_hi, b_hi), dt), dt);
        }
    }
}

/* Row t's RoPE tables (D floats each) rounded to dt: c from cos, s from ssin. */
static void rope_tables(const float *cos, const float *ssin, int64_t t, int64_t D, int dt, float *c, float *s) {
    if (D % 32 == 0) {
        for (int64_t d = 0; d < D; d += 16) {
            _mm512_storeu_ps(c + d, round16x(_mm512_loadu_ps(cos + t * D + d), dt));
            _mm512_storeu_ps(s + d, round16x(_mm512_loadu_ps(ssin + t * D + d), dt));
        }
        return;
    }
    for (int64_t d = 0; d < D; d++) {
        c[d] = round_dt(cos[t * D + d], dt);
        s[d] = round_dt(ssin[t * D + d], dt);
    }
}

/* Heads [0, H) of x, the first at element base, rotated in place with one row's tables c, s: the
 * vector loop for head dims that are a multiple of 32, else the scalar one (the same bits). */
static void rope_heads(void *x, int64_t base0, int64_t H, int64_t D, const float *c, const float *s, int dt) {
    if (D % 32 == 0) {
        rope_row16(x, base0, H, D, c, s, dt);
        return;
    }
    float tmp[1024];
    for (int64_t h = 0; h < H; h++) {
        int64_t base = base0 + h * D;
        for (int64_t d = 0; d < D; d++) tmp[d] = load_dt(x, base + d, dt);
        for (int64_t d = 0; d < D; d++) {
            float ra = round_dt(tmp[d] * c[d], dt);
            float rb = round_dt(tmp[(d + D / 2) % D] * s[d], dt);
            store_dt(x, base + d, round_dt(ra + rb, dt), dt);
        }
    }
}

/* Row t of sg_rope (its tables rounded to dt, then every head of the row rotated). */
static void rope_one(const sg_rope_args *a, int64_t t) {
    float c[1024], s[1024];
    rope_tables(a->cos, a->ssin, t, a->D, a->dt, c, s);
    rope_heads(a->x, t * a->row_stride, a->H, a->D, c, s, a->dt);
}

/* Rotate heads [0, H) of each row of x in place: x*cos + roll(x, D/2)*ssin with the tables rounded
 * to dt first, each product and the sum rounded to dt (the eager ``apply_rope`` on dt tensors, bit
 * for bit). Head dims that are a multiple of 32 take the vector loop (a scalar loop with a modulo per
 * element cost ~50 ms per layer of a 4,096-token bfloat16 chunk, 11 % of its prefill); others the
 * scalar one. Returns OK, ERR_LAYOUT or ERR_SHAPE. */
int sg_rope(const sg_rope_args *a) {
    if (a->size != (int64_t)sizeof *a) return ERR_LAYOUT;
    const int64_t T = a->T, H = a->H, D = a->D;
    if (D % 2 || D > 1024) return ERR_SHAPE;
#pragma omp parallel for schedule(static) if (T * H >= 256)
    for (int64_t t = 0; t < T; t++) rope_one(a, t);
    return OK;
}

typedef struct {
    int64_t size;                /* sizeof(sg_write_kv_args) */
    int32_t dt;                  /* dtype of k, v and the cache */
    int64_t n;                   /* rows to write */
    int64_t width;               /* values per row, Hkv * D */
    const void *k;               /* (>= n, width) rows, each contiguous */
    int64_t ldk;                 /* row stride of k, elements */
    const void *v;               /* (>= n, width) rows, each contiguous */
    int64_t ldv;                 /* row stride of v, elements */
    void *cache;                 /* [2, num_slots, width] contiguous: K half, then V half */
    int64_t num_slots;           /* num_blocks * block_size */
    const int64_t *slot_mapping; /* (n,) the slot of each row */
} sg_write_kv_args;

/* Copy rows t < n of k and v into cache slots slot_mapping[t]. Returns OK, ERR_LAYOUT, or ERR_SHAPE,
 * writing nothing, when a slot is outside [0, num_slots). */
int sg_write_kv(const sg_write_kv_args *a) {
    if (a->size != (int64_t)sizeof *a) return ERR_LAYOUT;
    const int dt = a->dt;
    const int64_t n = a->n, width = a->width, ldk = a->ldk, ldv = a->ldv, num_slots = a->num_slots;
    const void *k = a->k, *v = a->v;
    void *cache = a->cache;
    const int64_t *slot_mapping = a->slot_mapping;
    size_t es = dt == DT_F32 ? 4 : 2;
    char *c = (char *)cache;
    for (int64_t t = 0; t < n; t++) /* all checked before any write: a bad slot leaves the cache as it was */
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return ERR_SHAPE;
    /* Both cores for a prefill step's rows (AMX Xeon, a 4,096-token step of SmolLM2-135M in bfloat16,
     * 3 MiB of K and V a layer): 0.32 -> 0.21 ms a layer alone; in the engine, where the cache lines
     * are cold, 19 -> 17 ms of a ~1.05 s prefill. */
#pragma omp parallel for schedule(static) if (n * width * es >= (1 << 18))
    for (int64_t t = 0; t < n; t++) {
        int64_t slot = slot_mapping[t];
        memcpy(c + (size_t)slot * width * es, (const char *)k + (size_t)t * ldk * es, width * es);
        memcpy(c + (size_t)(num_slots + slot) * width * es, (const char *)v + (size_t)t * ldv * es, width * es);
    }
    return OK;
}

/* ---- decode attention --------------------------------------------------------------------------- */

#define MAX_G 16  /* query heads per KV head (cpu.py MAX_QUERY_HEADS_PER_KV_HEAD): bounds stack buffers */
#define MAX_D 256 /* head dim (cpu.py MAX_HEAD_DIM) */
#define MAX_ROW_HEADS 32 /* query heads (Hkv G) of segment_rows_bf16's items: bounds its stack buffers */

/* Lane t of the result: the sum of the 16 lanes of a[t] (a 16 x 16 transpose folded into the adds:
 * 45 shuffles and adds for 16 sums, where 16 horizontal reductions take ~130). */
static inline __m512 sum16x16(const __m512 a[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0 + x2, y0 + y2, x1 + x3, y1 + y3] of x, y = a[2i], a[2i+1] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane j: the lane-j sums of a[4i .. 4i + 3] */
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xdd));
}

/* Scores of a bfloat16 cache (D a multiple of 32): scores[g][i] = scale * q_g . k_i, 16 keys at a time, each
 * product by vdpbf16ps (exact bf16 pair products summed in float32; q is bfloat16-valued, so rounding it
 * back is exact) and the 16 sums by sum16x16 instead of one horizontal reduction per key and head, which
 * with the K rows' widening to float32 was most of a bfloat16 decode's attention time. Equal to the
 * float32 loop up to float32 summation order. */
static inline __attribute__((always_inline)) void scores_bf16(
    int64_t G, int64_t D, const float *q, const char *kc, const char *vc, size_t token_bytes, size_t head_off,
    int64_t block_size, const int32_t *blocks, int64_t t0, int64_t n, float scale, float *scores) {
    const int64_t nb = D / 32;
    __m512bh qb[MAX_G * (MAX_D / 32)];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < nb; c++)
            qb[g * nb + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * D + 32 * c + 16), _mm512_loadu_ps(q + g * D + 32 * c));
    /* Key rows in walk order, block by block (no division per key); kp holds 32: the 16 scored now and
     * the next 16, prefetched while these are scored (the blocks are scattered: no stream to detect).
     * The same tokens' V rows are prefetched with them, so the P V pass that follows finds the segment's
     * values in cache (at most seg x D x 2 bytes, 64 KiB for 512 tokens of D = 64): its own prefetch, a
     * few tokens ahead, left each V row's load waiting on memory (perf on the AMX Xeon, 64 decodes at
     * ~700 tokens: ~40 % of the attention's samples on the two loads after it). */
    const char *kp[32];
    int64_t blk = t0 / block_size, off = t0 - blk * block_size, ahead = 0;
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
        for (; ahead < i0 + 32 && ahead < n; ahead++) {
            const char *p = kc + ((size_t)blocks[blk] * block_size + off) * token_bytes + head_off;
            kp[ahead % 32] = p;
            for (int64_t c = 0; c < nb; c++) { /* the row's D x 2 bytes: nb lines of 64 */
                if (ahead >= 16) _mm_prefetch(p + 64 * c, _MM_HINT_T0);
                _mm_prefetch(vc + (p - kc) + 64 * c, _MM_HINT_T0);
            }
            if (++off == block_size) blk++, off = 0;
        }
        for (int64_t g = 0; g < G; g++) {
            __m512 acc[16];
            for (int j = 0; j < 16; j++) {
                __m512 a = _mm512_setzero_ps();
                if (j < cnt)
                    for (int64_t c = 0; c < nb; c++)
                        a = _mm512_dpbf16_ps(a, qb[g * nb + c], (__m512bh)_mm512_loadu_si512(kp[(i0 + j) % 32] + 64 * c));
                acc[j] = a;
            }
            __m512 sc = _mm512_mul_ps(sum16x16(acc), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + g * n + i0, cnt == 16 ? (__mmask16)0xffff : (__mmask16)((1u << cnt) - 1u), sc);
        }
    }
}

/* Softmax numerators of R score rows of n, in place: scores[r][i] = exp(scores[r][i] - m[r]) with m[r] the
 * row's maximum, and l[r] the row's sum of them. */
static inline void softmax_numerators(int64_t R, int64_t n, float *scores, float *m, float *l) {
    for (int64_t r = 0; r < R; r++) {
        float *s = scores + r * n;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
        float mr = _mm512_reduce_max_ps(mx);
        for (; i < n; i++) mr = s[i] > mr ? s[i] : mr;
        __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(mr);
        for (i = 0; i < n; i += 16) {
            __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            __m512 e = sg_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
            e = _mm512_maskz_mov_ps(k, e);
            _mm512_mask_storeu_ps(s + i, k, e);
            sum = _mm512_add_ps(sum, e);
        }
        m[r] = mr;
        l[r] = _mm512_reduce_add_ps(sum);
    }
}

/* One (decode, KV head, segment) work item: unnormalised output o[G][D], running max m[G] and sum l[G]
 * of exp(score - m) over tokens [t0, t1) of the request's cache, read in place through its block table. */
static inline __attribute__((always_inline)) void segment_partial(
    int dt, int64_t G, int64_t D, int64_t Hkv, int64_t h, const float *q, const char *kc, const char *vc,
    int64_t block_size, const int32_t *blocks, int64_t t0, int64_t t1, float scale, float *scores, float *o,
    float *m, float *l) {
    size_t es = dt == DT_F32 ? 4 : 2;
    int64_t n = t1 - t0, nv = D / 16;
    size_t token_bytes = (size_t)Hkv * D * es;
    /* Pass 1: scores[g][i] = scale * q_g . k_i */
    if (dt == DT_BF16 && D % 32 == 0) {
        scores_bf16(G, D, q, kc, vc, token_bytes, (size_t)h * D * es, block_size, blocks, t0, n, scale, scores);
    } else {
        for (int64_t i = 0; i < n; i++) {
            int64_t t = t0 + i;
            const char *kp = kc + ((size_t)blocks[t / block_size] * block_size + t % block_size) * token_bytes +
                             (size_t)h * D * es;
            __m512 kv[MAX_D / 16];
            for (int64_t c = 0; c < nv; c++) kv[c] = load16(kp, c * 16, dt);
            for (int64_t g = 0; g < G; g++) {
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), kv[0]);
                for (int64_t c = 1; c < nv; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + c * 16), kv[c], a);
                scores[g * n + i] = _mm512_reduce_add_ps(a) * scale;
            }
        }
    }
    softmax_numerators(G, n, scores, m, l);
    /* Pass 2: o_g = sum_i p[g][i] v_i */
    __m512 acc[MAX_G * (MAX_D / 16)];
    for (int64_t j = 0; j < G * nv; j++) acc[j] = _mm512_setzero_ps();
    /* Block by block (no division per token), the row 4 tokens ahead prefetched (past a block's end that
     * is a line of no use: harmless). */
    for (int64_t i = 0, blk = t0 / block_size, off = t0 - blk * block_size; i < n; i++) {
        const char *vp = vc + ((size_t)blocks[blk] * block_size + off) * token_bytes + (size_t)h * D * es;
        if (++off == block_size) blk++, off = 0;
        _mm_prefetch(vp + 4 * token_bytes, _MM_HINT_T0);
        if (D * es > 64) _mm_prefetch(vp + 4 * token_bytes + 64, _MM_HINT_T0);
        for (int64_t c = 0; c < nv; c++) {
            __m512 vv = load16(vp, c * 16, dt);
            for (int64_t g = 0; g < G; g++)
                acc[g * nv + c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + i]), vv, acc[g * nv + c]);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(o + g * D + c * 16, acc[g * nv + c]);
}

/* One (decode, segment) work item of a bfloat16 cache for all Hkv KV heads at once (D a multiple of 32):
 * what segment_partial gives for each head h, o[h][G][D], m[h][G], l[h][G], bit for bit (the same
 * products and sums in the same order), but with the cache read a window of 16 tokens at a time, whole
 * rows (all heads' K, then all heads' V), instead of one head's 2 D bytes of every row per pass: a row
 * is Hkv x 2 D bytes side by side, and a pass per head strides over the others' lines. Reading the
 * segment's rows once, in order, is what the memory system serves best: a read-only probe of both
 * orders (64 decodes of ~330 tokens, 30 layers of distinct caches, Zen 5) took 18.6 ms head by head
 * and 12.7 ms row by row. q: (Hkv, G, D) float32; scores: Hkv G (n + 16) floats; rowp: n offsets
 * (bytes) of the tokens' rows from kc and vc. P V keeps each head's accumulators in o between windows
 * (Hkv G D / 16 registers would not fit), which changes no value (float32 stored and reloaded). */
static inline __attribute__((always_inline)) void segment_rows_bf16(
    int64_t G, int64_t D, int64_t Hkv, const float *q, const char *kc, const char *vc, int64_t block_size,
    const int32_t *blocks, int64_t t0, int64_t t1, float scale, float *scores, size_t *rowp, float *o, float *m,
    float *l) {
    const int64_t n = t1 - t0, nb = D / 32, nv = D / 16, R = Hkv * G;
    const size_t token_bytes = (size_t)Hkv * D * 2, hb = (size_t)D * 2;
    __m512bh qb[MAX_ROW_HEADS * (MAX_D / 32)];
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < nb; c++)
            qb[r * nb + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + r * D + 32 * c + 16), _mm512_loadu_ps(q + r * D + 32 * c));
    /* Pass 1: scores[r][i] = scale * q_r . k_i, row r = h G + g reading head h of key i. */
    int64_t blk = t0 / block_size, off = t0 - blk * block_size;
    for (int64_t i = 0; i < n; i++) { /* the rows' offsets in walk order, block by block */
        rowp[i] = ((size_t)blocks[blk] * block_size + off) * token_bytes;
        if (++off == block_size) blk++, off = 0;
    }
    /* The blocks are scattered, so the hardware prefetchers find no stream longer than a block: K rows
     * are prefetched 16 tokens ahead, and each window's V rows while its scores are computed (they wait
     * in L2 for pass 2, which brings the next window's into L1 as it goes). The prefetches of a window
     * are spread over its Hkv G score rows. Zen 5, the probe above with the compute: 16 / 0 / 16 tokens
     * 0.84x of segment_partial's time; without pass 2's 0.88x, without pass 1's V 1.05x; K 32 ahead,
     * V 16 or 32 ahead, or the hints T1 / NTA: within 0.02x. */
    const int64_t lines = (int64_t)(token_bytes / 64), ahead = 16;
    for (int64_t i = 0; i < ahead && i < n; i++)
        for (int64_t c = 0; c < lines; c++) _mm_prefetch(kc + rowp[i] + 64 * c, _MM_HINT_T0);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t g = 0; g < G; g++) {
                const int64_t r = h * G + g;
                for (int64_t j = i0 + r; j < i0 + cnt; j += R)
                    for (int64_t c = 0; c < lines; c++) {
                        if (j + ahead < n) _mm_prefetch(kc + rowp[j + ahead] + 64 * c, _MM_HINT_T0);
                        _mm_prefetch(vc + rowp[j] + 64 * c, _MM_HINT_T0);
                    }
                __m512 acc[16];
                for (int j = 0; j < 16; j++) {
                    __m512 a = _mm512_setzero_ps();
                    if (j < cnt)
                        for (int64_t c = 0; c < nb; c++)
                            a = _mm512_dpbf16_ps(a, qb[r * nb + c], (__m512bh)_mm512_loadu_si512(kc + rowp[i0 + j] + h * hb + 64 * c));
                    acc[j] = a;
                }
                __m512 sc = _mm512_mul_ps(sum16x16(acc), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(scores + r * n + i0, cnt == 16 ? (__mmask16)0xffff : (__mmask16)((1u << cnt) - 1u), sc);
            }
    }
    softmax_numerators(R, n, scores, m, l);
    /* Pass 2: o_r = sum_i p[r][i] v_i, a window of 16 tokens' V rows at a time. */
    for (int64_t x = 0; x < R * D; x++) o[x] = 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
        const char *vp[16];
        for (int j = 0; j < cnt; j++) vp[j] = vc + rowp[i0 + j];
        for (int64_t j = i0 + ahead; j < i0 + ahead + 16 && j < n; j++)
            for (int64_t c = 0; c < lines; c++) _mm_prefetch(vc + rowp[j] + 64 * c, _MM_HINT_T0);
        for (int64_t h = 0; h < Hkv; h++) {
            __m512 acc[MAX_G * (MAX_D / 16)];
            float *oh = o + h * G * D;
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < nv; c++) acc[g * nv + c] = _mm512_loadu_ps(oh + g * D + c * 16);
            for (int j = 0; j < cnt; j++)
                for (int64_t c = 0; c < nv; c++) {
                    __m512 vv = load16(vp[j] + h * hb, c * 16, DT_BF16);
                    for (int64_t g = 0; g < G; g++)
                        acc[g * nv + c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(h * G + g) * n + i0 + j]), vv, acc[g * nv + c]);
                }
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(oh + g * D + c * 16, acc[g * nv + c]);
        }
    }
}

typedef struct {
    int64_t size;               /* sizeof(sg_decode_attention_args) */
    int32_t dt;                 /* dtype of q, out and the cache */
    int64_t n;                  /* decodes */
    int64_t Hq;                 /* query heads; head h*G + g uses KV head h, G = Hq / Hkv <= MAX_G */
    int64_t Hkv;                /* KV heads */
    int64_t D;                  /* head dim, a multiple of 16 up to MAX_D */
    const void *q;              /* (T, >= Hq * D) rows, each contiguous */
    int64_t ldq;                /* row stride of q, elements */
    void *out;                  /* (T, Hq, D) contiguous */
    int64_t T;                  /* rows of q and out */
    const int64_t *rows;        /* (n,) the q/out row of each decode, < T */
    const void *cache;          /* [2, num_blocks, block_size, Hkv, D] contiguous */
    int64_t num_blocks;         /* blocks of the cache (block 0 is the null block) */
    int64_t block_size;         /* tokens per block */
    const int32_t *block_table; /* (B, ld_bt) contiguous block ids */
    int64_t B;                  /* rows of the block table */
    int64_t ld_bt;              /* columns of the block table */
    const int64_t *reqs;        /* (n,) the block-table row of each decode, < B */
    const int64_t *lens;        /* (n,) tokens each decode attends to, its own (already written) included */
    int64_t seg;                /* tokens per KV segment, >= 1 (the most; see attention_plan) */
    float scale;                /* softmax scale */
} sg_decode_attention_args;

/* Whether what every decode reads lies inside the tensors: its row (< T), its block-table row (< B), its
 * length (1 .. ld_bt * block_size) and every block id it walks (1 .. num_blocks - 1; 0 is the null
 * block and never holds a token). Returns OK, ERR_ROW, ERR_SHAPE or ERR_BLOCK. */
static int check_decodes(const sg_decode_attention_args *a) {
    for (int64_t j = 0; j < a->n; j++) {
        if (a->rows[j] < 0 || a->rows[j] >= a->T || a->reqs[j] < 0 || a->reqs[j] >= a->B) return ERR_ROW;
        if (a->lens[j] < 1 || a->lens[j] > a->ld_bt * a->block_size) return ERR_SHAPE;
        const int32_t *bt = a->block_table + a->reqs[j] * a->ld_bt;
        for (int64_t b = 0; b < (a->lens[j] + a->block_size - 1) / a->block_size; b++)
            if (bt[b] < 1 || bt[b] >= a->num_blocks) return ERR_BLOCK;
    }
    return OK;
}

/* What a step's decode attention shares across its layers (the lengths are the same in every layer):
 * the segment length, each decode's first work item and the partials' buffers. */
struct att_plan { /* internal: no ctypes mirror */
    int64_t seg;    /* tokens per segment, as chosen below */
    int64_t items;  /* work items: segments times KV heads */
    int64_t *first; /* (n + 1,) first segment of decode j */
    float *po;      /* (items, G, D) unnormalised partial outputs */
    float *pm;      /* (items, G) running maxima */
    float *pl;      /* (items, G) sums of exp(score - max) */
};
typedef struct att_plan att_plan;

static void attention_plan_free(att_plan *p) {
    free(p->first);
    free(p->po);
    free(p->pm);
    free(p->pl);
}

/* Decode attention's work split, made once per step and used by every layer.
 *
 * Each decode's tokens are walked in segments, one work item per (decode, KV head, segment), each
 * giving an unnormalised partial (segment_partial; or, for a bfloat16 cache and enough items,
 * segment_rows_bf16 gives a segment's partials of every KV head in one item: attention_team) that a
 * second pass merges per (decode, KV head) by
 * log-sum-exp: L = max_s m_s, o = sum_s o_s e^(m_s - L) / sum_s l_s e^(m_s - L) (FlashAttention's
 * online softmax; "Flash-Decoding" split-KV, Dao et al. 2023). The segment is a->seg tokens at most,
 * and shorter when the contexts are short: few decodes over short contexts give fewer work items than
 * threads (one decode of 300 tokens with 2 KV heads is 2 items for seg = 512), so the segment is halved,
 * down to 64 tokens, until there are two work items per thread and every core has work; a single
 * decode's context is then cut into that many equal segments. This differs
 * from the eager segmented backend, which always walks kv_segment_size-token segments; it does not
 * change the result beyond rounding: the merge is exact in real arithmetic for any split, so another
 * split only reorders float32 sums: results of two splits agree within 1e-6 in float32 (observed
 * 2.6e-7 on outputs up to 0.7) and within one bfloat16 ulp in bfloat16 (test_cpu_kernels.py
 * test_decode_attention_does_not_depend_on_the_split checks both).
 * Returns OK or ERR_NOMEM (p then holds nothing to free). */
static int attention_plan(const sg_decode_attention_args *a, att_plan *p) {
    const int64_t n = a->n, Hkv = a->Hkv, G = a->Hq / a->Hkv, D = a->D;
    const int64_t *lens = a->lens;
    int64_t seg = a->seg;
    if (seg > a->ld_bt * a->block_size) seg = a->ld_bt * a->block_size; /* no decode is longer: bounds the buffers */
    /* Short contexts would leave cores idle: halve the segment (see above). */
    int64_t total = 0, threads = omp_get_max_threads();
    for (int64_t j = 0; j < n; j++) total += (lens[j] + seg - 1) / seg;
    while (seg > 64 && total * Hkv < 2 * threads) {
        seg = (seg + 1) / 2;
        total = 0;
        for (int64_t j = 0; j < n; j++) total += (lens[j] + seg - 1) / seg;
    }
    memset(p, 0, sizeof *p);
    p->seg = seg;
    p->first = (int64_t *)malloc(sizeof(int64_t) * (n + 1));
    if (!p->first) return ERR_NOMEM;
    p->first[0] = 0;
    for (int64_t j = 0; j < n; j++) p->first[j + 1] = p->first[j] + (lens[j] + seg - 1) / seg;
    p->items = p->first[n] * Hkv;
    p->po = (float *)malloc(sizeof(float) * p->items * G * D);
    p->pm = (float *)malloc(sizeof(float) * p->items * G);
    p->pl = (float *)malloc(sizeof(float) * p->items * G);
    if (p->po && p->pm && p->pl) return OK;
    attention_plan_free(p);
    memset(p, 0, sizeof *p);
    return ERR_NOMEM;
}

/* Floats of a work item's scores, segment_rows_bf16's Hq (seg + 16) (segment_partial's G (seg + 16) is
 * less), rounded up to even so that the row offsets after them are aligned. */
static size_t scores_rows_floats(const sg_decode_attention_args *a, const att_plan *p) {
    return ((size_t)a->Hq * (p->seg + 16) + 1) / 2 * 2;
}

/* Floats of the per-thread buffer attention_team needs for plan p: the scores, then segment_rows_bf16's
 * seg row offsets (size_t, two floats each). */
static size_t attention_scores_floats(const sg_decode_attention_args *a, const att_plan *p) {
    return scores_rows_floats(a, p) + 2 * (size_t)p->seg;
}

/* What the decode stack's attention does besides attending (attention_team's fz; NULL elsewhere), so
 * that a step needs no RoPE + KV-write pass, and no barrier, of its own between QKV and attention. */
struct att_fuse { /* internal: no ctypes mirror */
    const float *cos;            /* (>= T, D) float32 RoPE rows, row rows[j] for decode j */
    const float *ssin;           /* (>= T, D) float32, sin with its first half negated */
    const int64_t *slot_mapping; /* (n,) cache slot of each decode's newest token */
    int64_t nq;                  /* where K starts in a q row: Hq D (V follows at nq + Hkv D) */
    void *cache;                 /* the layer's cache (a->cache, written here) */
};
typedef struct att_fuse att_fuse;

/* One work item's query (decode j, KV head h) for the decode stack: its G query heads, unrotated in
 * the fused QKV output, rotated (RoPE) into qf; and when the item holds the decode's newest token
 * (newest), that token's K head rotated and its K and V heads written to its cache slot, before the
 * item reads the cache. Exactly one item per (decode, KV head) holds the newest token and no other
 * item reads that slot, so no barrier is needed. The rotation is rope_heads over the same tables as
 * sg_rope's, so q and the cache get the same bits as a RoPE pass over the rows, then sg_write_kv. */
static void fused_query(const sg_decode_attention_args *a, const att_fuse *fz, int64_t j, int64_t h, int newest,
                        float *qf) {
    const int dt = a->dt;
    const int64_t G = a->Hq / a->Hkv, D = a->D, row = a->rows[j], width = a->Hkv * D;
    const size_t es = dt == DT_F32 ? 4 : 2, hb = (size_t)D * es;
    const char *qrow = (const char *)a->q + (size_t)row * a->ldq * es;
    float c[MAX_D], s[MAX_D];
    char heads[MAX_G * MAX_D * 4];
    rope_tables(fz->cos, fz->ssin, row, D, dt, c, s);
    memcpy(heads, qrow + (size_t)h * G * hb, (size_t)G * hb);
    rope_heads(heads, 0, G, D, c, s, dt);
    for (int64_t i = 0; i < G * D; i++) qf[i] = load_dt(heads, i, dt);
    if (!newest) return;
    const size_t slot = (size_t)fz->slot_mapping[j], num_slots = (size_t)a->num_blocks * a->block_size;
    char *kc = (char *)fz->cache;
    memcpy(heads, qrow + (size_t)(fz->nq + h * D) * es, hb);
    rope_heads(heads, 0, 1, D, c, s, dt);
    memcpy(kc + (slot * width + h * D) * es, heads, hb);
    memcpy(kc + ((num_slots + slot) * width + h * D) * es, qrow + (size_t)(fz->nq + width + h * D) * es, hb);
}

/* Decode j = pi / Hkv's KV head h = pi % Hkv: its segments merged, L = max m_s,
 * o = sum o_s e^(m_s - L) / sum l_s e^(m_s - L), into row rows[j] of out ((T, Hq, D) dt). */
static void merge_one(const sg_decode_attention_args *a, const att_plan *p, int64_t pi, void *out) {
    const int dt = a->dt;
    const int64_t Hq = a->Hq, Hkv = a->Hkv, D = a->D, G = Hq / Hkv, j = pi / Hkv, h = pi % Hkv;
    const int64_t *first = p->first, row = a->rows[j];
    const float *po = p->po, *pm = p->pm, *pl = p->pl;
    for (int64_t g = 0; g < G; g++) {
        float mx = -INFINITY, denom = 0.0f, o[MAX_D];
        for (int64_t s = first[j]; s < first[j + 1]; s++) {
            float ms = pm[(s * Hkv + h) * G + g];
            mx = ms > mx ? ms : mx;
        }
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t s = first[j]; s < first[j + 1]; s++) {
            int64_t it = s * Hkv + h;
            float wgt = expf(pm[it * G + g] - mx);
            denom += pl[it * G + g] * wgt;
            const float *os = po + (it * G + g) * D;
            for (int64_t d = 0; d < D; d++) o[d] += os[d] * wgt;
        }
        for (int64_t d = 0; d < D; d++) store_dt(out, (row * Hq + h * G + g) * D + d, o[d] / denom, dt);
    }
}

/* The segments (dynamic worksharing, one item at a time), then their merge, called by every thread of
 * a region (or by one thread outside any); scores is the calling thread's own buffer of
 * attention_scores_floats. The segment loop ends in the team's barrier. The merge is shared (static
 * worksharing, a->out, a second barrier), or, with own_out, done whole by every thread into its own
 * (T, Hq, D) buffer: no barrier, for steps of a few decodes where the merge is a few thousand values
 * (the prologue rows' trade, see linear_input). fz: the decode stack's RoPE and KV write (fused_query),
 * or NULL when q is rotated and the cache written already. */
static void attention_team(const sg_decode_attention_args *a, const att_plan *p, float *scores, const att_fuse *fz,
                           void *own_out) {
    const int dt = a->dt;
    const int64_t n = a->n, Hq = a->Hq, Hkv = a->Hkv, D = a->D, ldq = a->ldq, num_blocks = a->num_blocks;
    const int64_t block_size = a->block_size, ld_bt = a->ld_bt, seg = p->seg, items = p->items;
    const void *q = a->q, *cache = a->cache;
    const int64_t *rows = a->rows, *req = a->reqs, *lens = a->lens, *first = p->first;
    const int32_t *block_table = a->block_table;
    const float scale = a->scale;
    float *po = p->po, *pm = p->pm, *pl = p->pl;
    int64_t G = Hq / Hkv;
    size_t es = dt == DT_F32 ? 4 : 2;
    const char *kc = (const char *)cache;
    const char *vc = kc + (size_t)num_blocks * block_size * Hkv * D * es;
    float qf[MAX_ROW_HEADS * MAX_D];
    /* The KV heads of a segment in turn on one thread (chunks of Hkv items) once there are enough items
     * to share: a token's heads lie side by side in the cache, and a core's hardware prefetchers pull
     * its neighbours' lines too, of use only to that core; items one at a time put neighbouring heads
     * on both cores, each reading the row. Engine steps (profile_bf16_decode.py --batches 64,32,16,8
     * --prompt-len 300, AMX Xeon, 2 rounds, the source swapped between runs): attention 33.5 / 32.0 ->
     * 30.4 / 29.7 ms at 64 rows, 16.3 / 15.9 -> 14.7 / 15.0 at 32, 8.1 / 8.5 -> 7.0 / 7.1 at 16, 4.3 / 4.5
     * -> 3.6 / 3.9 at 8. A batch-1 step (6 items) keeps items one at a time, for balance. */
    const int64_t chunk = items >= 4 * Hkv * (int64_t)omp_get_num_threads() ? Hkv : 1;
    /* With a segment's heads on one thread anyway, a bfloat16 cache is read row by row for all of them
     * (segment_rows_bf16): the chunk's first item does the segment, its others nothing. */
    const int rows_path = chunk > 1 && dt == DT_BF16 && D % 32 == 0 && Hq <= MAX_ROW_HEADS;
    size_t *rowp = (size_t *)(scores + scores_rows_floats(a, p)); /* attention_scores_floats' room for seg offsets */
#pragma omp for schedule(dynamic, chunk) nowait
    for (int64_t it = 0; it < items; it++) {
        if (rows_path && it % Hkv) continue;
        int64_t sidx = it / Hkv, h = it % Hkv, j = 0;
        int64_t lo = 0, hi = n - 1; /* decode j with first[j] <= sidx < first[j + 1] */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (first[mid] <= sidx) lo = mid;
            else hi = mid - 1;
        }
        j = lo;
        int64_t s = sidx - first[j], t0 = s * seg, t1 = t0 + seg < lens[j] ? t0 + seg : lens[j];
        const int32_t *bt = block_table + req[j] * ld_bt;
        float *o = po + it * G * D, *mm = pm + it * G, *ll = pl + it * G;
        if (rows_path) {
            for (int64_t hh = 0; hh < Hkv; hh++)
                if (fz)
                    fused_query(a, fz, j, hh, sidx == first[j + 1] - 1, qf + hh * G * D);
                else
                    for (int64_t x = 0; x < G * D; x++) qf[hh * G * D + x] = load_dt(q, rows[j] * ldq + hh * G * D + x, dt);
#define ROWS(GG, DD) segment_rows_bf16(GG, DD, Hkv, qf, kc, vc, block_size, bt, t0, t1, scale, scores, rowp, o, mm, ll)
            switch (G * 1000 + D) {
            case 1064: ROWS(1, 64); break;
            case 2064: ROWS(2, 64); break;
            case 3064: ROWS(3, 64); break;
            case 4064: ROWS(4, 64); break;
            case 1128: ROWS(1, 128); break;
            case 2128: ROWS(2, 128); break;
            case 4128: ROWS(4, 128); break;
            default: ROWS(G, D);
            }
#undef ROWS
            continue;
        }
        if (fz)
            fused_query(a, fz, j, h, sidx == first[j + 1] - 1, qf);
        else
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = 0; d < D; d++) qf[g * D + d] = load_dt(q, rows[j] * ldq + (h * G + g) * D + d, dt);
        /* Common head shapes get copies with G and D constant, so their accumulators live in
         * registers; others take the general loop. */
#define SEGMENT(GG, DD, DT) segment_partial(DT, GG, DD, Hkv, h, qf, kc, vc, block_size, bt, t0, t1, scale, scores, o, mm, ll)
#define CASES(DT)                                                                                          \
    switch (G * 1000 + D) {                                                                                \
    case 1064: SEGMENT(1, 64, DT); break;                                                                  \
    case 2064: SEGMENT(2, 64, DT); break;                                                                  \
    case 3064: SEGMENT(3, 64, DT); break;                                                                  \
    case 4064: SEGMENT(4, 64, DT); break;                                                                  \
    case 1128: SEGMENT(1, 128, DT); break;                                                                 \
    case 2128: SEGMENT(2, 128, DT); break;                                                                 \
    case 4128: SEGMENT(4, 128, DT); break;                                                                 \
    default: SEGMENT(G, D, DT);                                                                            \
    }
        if (dt == DT_F32) { CASES(DT_F32) } else { CASES(DT_BF16) }
#undef CASES
#undef SEGMENT
    }
    team_sync();
    if (own_out) {
        for (int64_t pi = 0; pi < n * Hkv; pi++) merge_one(a, p, pi, own_out);
        return;
    }
#pragma omp for schedule(static) nowait
    for (int64_t pi = 0; pi < n * Hkv; pi++) merge_one(a, p, pi, a->out);
    team_sync();
}

/* sg_decode_attention without its checks: plan, then one region for the segments and the merge.
 * Returns OK or ERR_NOMEM. */
static int decode_attention(const sg_decode_attention_args *a) {
    att_plan p;
    if (attention_plan(a, &p) != OK) return ERR_NOMEM;
    int failed = 0;
    const size_t nscores = attention_scores_floats(a, &p);
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * nscores);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) attention_team(a, &p, scores, NULL, NULL);
        free(scores);
    }
    attention_plan_free(&p);
    return failed ? ERR_NOMEM : OK;
}

/* Attention of n decode queries to their cached tokens, read in place through the block table (no
 * gathered copy): decode j reads q row rows[j] and writes out row rows[j] (other rows untouched),
 * attending to the first lens[j] tokens of block-table row reqs[j]. Segments and merge: see
 * attention_plan. Everything every decode reads is checked before anything is read (check_decodes).
 * Returns OK, ERR_LAYOUT, ERR_SHAPE, ERR_ROW, ERR_BLOCK or ERR_NOMEM. */
int sg_decode_attention(const sg_decode_attention_args *a) {
    if (a->size != (int64_t)sizeof *a) return ERR_LAYOUT;
    if (a->D % 16 || a->D > MAX_D || a->Hq % a->Hkv || a->Hq / a->Hkv > MAX_G || a->seg < 1) return ERR_SHAPE;
    int rc = check_decodes(a);
    return rc != OK ? rc : decode_attention(a);
}

/* ---- a whole decode step ------------------------------------------------------------------------ */

/* One Llama decoder layer's weights (dt, contiguous) and KV cache. */
typedef struct {
    const void *ln1;      /* (H,) input RMSNorm weight */
    const void *qkv;      /* ((Hq + 2 Hkv) D, H) fused Q, K, V projection */
    const void *qkv_bias; /* ((Hq + 2 Hkv) D,) or NULL */
    const void *o;        /* (H, Hq D) output projection */
    const void *ln2;      /* (H,) post-attention RMSNorm weight */
    const void *gate_up;  /* (2 I, H) fused gate and up projection */
    const void *down;     /* (H, I) down projection */
    void *kv_cache;       /* [2, num_blocks, block_size, Hkv, D] */
    int32_t qkv_wqt;      /* format of qkv: WQT_DENSE or a GGUF block type (segserve_quant.h) */
    int32_t o_wqt;        /* format of o */
    int32_t gate_up_wqt;  /* format of gate_up */
    int32_t down_wqt;     /* format of down */
    const void *qkv_tiles;     /* qkv in sg_amx_pack's tile layout, for sg_decode_stack_args.tiles; else NULL */
    const void *o_tiles;       /* o, the same */
    const void *gate_up_tiles; /* gate_up, the same */
    const void *down_tiles;    /* down, the same */
} sg_layer;

typedef struct {
    int64_t size;                /* sizeof(sg_decode_stack_args) */
    int64_t layer_size;          /* sizeof(sg_layer): the layers array is checked against drift too */
    int32_t dt;                  /* dtype of the weights, caches and h */
    int64_t num_layers;          /* entries of layers */
    const sg_layer *layers;      /* (num_layers,) */
    int64_t M;                   /* rows of h: n decodes, then padding */
    int64_t H;                   /* hidden size, a multiple of 32 */
    int64_t I;                   /* intermediate size, a multiple of 32 */
    int64_t Hq;                  /* query heads */
    int64_t Hkv;                 /* KV heads */
    int64_t D;                   /* head dim */
    float eps;                   /* RMSNorm epsilon */
    void *h;                     /* (M, H) residual stream, contiguous, updated in place */
    const float *cos;            /* (M, D) float32 RoPE rows */
    const float *ssin;           /* (M, D) float32, sin with its first half negated */
    int64_t num_blocks;          /* blocks of each cache */
    int64_t block_size;          /* tokens per block */
    int64_t n;                   /* decodes, <= M */
    const int64_t *slot_mapping; /* (n,) cache slot of each decode's new token */
    const int64_t *rows;         /* (n,) must be 0..n-1 */
    const int32_t *block_table;  /* (>= n, ld_bt): row j is decode j's */
    int64_t ld_bt;               /* columns of the block table */
    const int64_t *reqs;         /* (n,) must be 0..n-1 */
    const int64_t *lens;         /* (n,) tokens each decode attends to, its own included */
    int64_t seg;                 /* tokens per KV segment, the most (see attention_plan) */
    float scale;                 /* softmax scale */
    int32_t xq8;                 /* bit wqt set: projections in GGUF format wqt get sg_linear_args.xq8 */
    int32_t tiles;               /* TILES_*: projections as tile products of the layers' *_tiles (bf16, 1-64 rows) */
    const void *final_norm;      /* (H,) dt: the final norm's weight, read when lm_w is set */
    const void *lm_w;            /* (vocab, H) dt values or GGUF blocks of lm_wqt, or NULL: no head */
    int32_t lm_wqt;              /* sg_linear_args.wqt of lm_w */
    int64_t vocab;               /* rows of lm_w */
    void *hidden;                /* (M, H) dt: the normed rows */
    float *logits;               /* (M, vocab) float32 */
} sg_decode_stack_args;

/* Phases of a decode-stack layer that sg_stack_timing accumulates, in order. */
enum { PH_QKV, PH_ATTENTION, PH_O, PH_GATE_UP, PH_DOWN, STACK_PHASES };

/* Decodes up to which every thread of the stack merges the attention partials itself (attention_team's
 * own_out): at most 8 x Hq x D values, fewer cycles than the barrier a shared merge ends in. */
#define OWN_MERGE_ROWS 8

/* The calling thread's timing buffer for its next decode steps (see sg_stack_timing), or NULL. */
static __thread int64_t *stack_timing;
static __thread int64_t stack_timing_layers;

/* Profiling hook: while buf is not NULL, every sg_decode_stack called from this thread adds to
 * buf[l * 5 + p] (l < layers) the nanoseconds its team's thread 0 spent in phase p of layer l (norm +
 * QKV, attention with its RoPE and KV write, O, norm + gate|up, SiLU + down; each up to the end of its
 * closing barrier, so waiting for the other threads counts in the phase). buf holds layers * 5 int64,
 * zeroed by the caller; NULL turns it off. Per calling thread, so concurrent engines do not mix them. */
void sg_stack_timing(int64_t *buf, int64_t layers) {
    stack_timing = layers > 0 ? buf : NULL;
    stack_timing_layers = layers;
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* sg_decode_stack_args.tiles: the per-row register tiles, or each layer as layer_tiles with its products
 * on AMX (sg_team_gemm_run) or on vdpbf16ps register tiles over the packed weights (sg_team_gemm_run_bf16). */
enum { TILES_NONE = 0, TILES_AMX = 1, TILES_BF16 = 2 };

/* What layer_tiles shares across a step (internal, tagged: no ctypes mirror). */
typedef struct tile_step {
    const sg_decode_stack_args *a;
    const sg_rope_args *rope;
    const att_plan *plan;
    uint16_t *qkv;  /* (M, (Hq + 2 Hkv) D) */
    uint16_t *attn; /* (M, Hq D), padding rows zero */
    uint16_t *xn;   /* (M, H) RMSNorm rows */
    uint16_t *act;  /* (M, I) SiLU-gated rows */
} tile_step;

/* Adds the time since *t_last to tl[phase] and restarts the clock (sg_stack_timing; tl NULL: off). */
static inline void stamp_phase(int64_t *tl, int phase, int64_t *t_last) {
    if (!tl) return;
    const int64_t t_now = now_ns();
    tl[phase] += t_now - *t_last;
    *t_last = t_now;
}

/* Whether a's step can run layer_tiles: bfloat16, AMX granted for TILES_AMX, every layer's projections
 * dense with their tile copies given, and every product a shape sg_team_gemm_run takes (M <= 64 among
 * them; sg_team_gemm_run_bf16 takes the same). */
static int tiles_fit(const sg_decode_stack_args *a) {
    const int64_t M = a->M, H = a->H, I = a->I, nq = a->Hq * a->D, nqkv = nq + 2 * a->Hkv * a->D;
    if (a->tiles != TILES_AMX && a->tiles != TILES_BF16) return 0;
    if (a->dt != DT_BF16 || (a->tiles == TILES_AMX && !sg_amx_granted()) ||
        !sg_team_gemm_fits(M, nqkv, H, TEAM_EPI_NONE) ||
        !sg_team_gemm_fits(M, H, nq, TEAM_EPI_RESIDUAL) || !sg_team_gemm_fits(M, 2 * I, H, TEAM_EPI_SILU_MUL) ||
        !sg_team_gemm_fits(M, H, I, TEAM_EPI_RESIDUAL))
        return 0;
    for (int64_t l = 0; l < a->num_layers; l++) {
        const sg_layer *ly = &a->layers[l];
        if (ly->qkv_wqt != WQT_DENSE || ly->o_wqt != WQT_DENSE || ly->gate_up_wqt != WQT_DENSE ||
            ly->down_wqt != WQT_DENSE || !ly->qkv_tiles || !ly->o_tiles || !ly->gate_up_tiles || !ly->down_tiles)
            return 0;
    }
    return 1;
}

/* One tile product of layer_tiles, shared by the team and ending in its barrier: on AMX tiles, or on
 * vdpbf16ps register tiles (whose share ends without one). */
static void tile_product(const sg_decode_stack_args *a, const sg_team_gemm *g) {
    if (a->tiles == TILES_AMX) {
        sg_team_gemm_run(g);
    } else {
        sg_team_gemm_run_bf16(g);
        team_sync();
    }
}

/* One layer of a bfloat16 decode step of up to 64 rows (CpuStep sends 2-64 with AMX, from
 * TILE_STACK_MIN_ROWS without) with its projections as tile products of the packed weights (tile_product),
 * run by every thread of the stack's region. The operations and rounding points of forward_chunk over
 * amx.linear / bf16gemm.linear, in its order, so the same bits: RMSNorm rows (sg_rows' code) into a shared
 * buffer, qkv, RoPE and the KV write, attention, h += o, RMSNorm, gate/up with the SiLU gate in its
 * epilogue, h += down. The norms are shared rows (one barrier each) rather than every thread's own copy as
 * in the per-row path: at 64 rows a copy per thread would cost more than the barrier. 9 barriers a layer,
 * the stack's own (team_sync) but for those inside the AMX product. */
static void layer_tiles(const tile_step *s, const sg_layer *ly, const sg_decode_attention_args *la, float *scores,
                        int64_t *tl, int64_t *t_last) {
    const sg_decode_stack_args *a = s->a;
    const int64_t M = a->M, H = a->H, I = a->I, n = a->n, nq = a->Hq * a->D, width = a->Hkv * a->D;
    const int64_t nqkv = nq + 2 * width, num_slots = a->num_blocks * a->block_size;
    const size_t kv_bytes = 2 * (size_t)width;
    const int64_t *slot_mapping = a->slot_mapping;
    uint16_t *h = a->h, *qkv = s->qkv;
    char *kc = (char *)ly->kv_cache;
#pragma omp for schedule(static) nowait
    for (int64_t m = 0; m < M; m++) prologue_row(DT_BF16, PRO_RMSNORM, H, h, H, m, ly->ln1, a->eps, s->xn);
    team_sync();
    sg_team_gemm g = {.M = M, .N = nqkv, .K = H, .x = s->xn, .ldx = H, .packed = ly->qkv_tiles,
                      .bias = ly->qkv_bias, .y = qkv, .ldy = nqkv, .epilogue = TEAM_EPI_NONE};
    tile_product(a, &g);
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < M; t++) { /* as the per-row path: sg_rope, then sg_write_kv */
        rope_one(s->rope, t);
        if (t < n) {
            memcpy(kc + (size_t)slot_mapping[t] * kv_bytes, qkv + t * nqkv + nq, kv_bytes);
            memcpy(kc + ((size_t)num_slots + slot_mapping[t]) * kv_bytes, qkv + t * nqkv + nq + width, kv_bytes);
        }
    }
    team_sync();
    stamp_phase(tl, PH_QKV, t_last);
    attention_team(la, s->plan, scores, NULL, NULL);
    stamp_phase(tl, PH_ATTENTION, t_last);
    g = (sg_team_gemm){.M = M, .N = H, .K = nq, .x = s->attn, .ldx = nq, .packed = ly->o_tiles, .y = h, .ldy = H,
                       .epilogue = TEAM_EPI_RESIDUAL};
    tile_product(a, &g);
    stamp_phase(tl, PH_O, t_last);
#pragma omp for schedule(static) nowait
    for (int64_t m = 0; m < M; m++) prologue_row(DT_BF16, PRO_RMSNORM, H, h, H, m, ly->ln2, a->eps, s->xn);
    team_sync();
    g = (sg_team_gemm){.M = M, .N = 2 * I, .K = H, .x = s->xn, .ldx = H, .packed = ly->gate_up_tiles,
                       .y = s->act, .ldy = I, .epilogue = TEAM_EPI_SILU_MUL};
    tile_product(a, &g);
    stamp_phase(tl, PH_GATE_UP, t_last);
    g = (sg_team_gemm){.M = M, .N = H, .K = I, .x = s->act, .ldx = I, .packed = ly->down_tiles, .y = h, .ldy = H,
                       .epilogue = TEAM_EPI_RESIDUAL};
    tile_product(a, &g);
    stamp_phase(tl, PH_DOWN, t_last);
}

/* Every layer of a decode-only step in one call, so a batch-1 step pays Python's per-op cost once
 * instead of ~200 times: per layer, h += o(attn(rope(qkv(norm1(h))))) and
 * h += down(silu_mul(gate_up(norm2(h)))), the same kernels as the per-op path in the same order.
 *
 * One OpenMP parallel region for the whole step, the kernels sharing its threads through orphaned
 * worksharing loops, and every buffer allocated once per step. Five barriers a layer for up to
 * OWN_MERGE_ROWS decodes (QKV, attention segments, O, gate|up, down), six above: RoPE and the KV
 * write are done by the attention items themselves (fused_query) and a few decodes' attention merge
 * by every thread for itself, because on a shared 2-core machine a barrier costs whenever the other
 * thread is descheduled (the phase of the old RoPE pass, ~1 us of work, took 2-330 us a layer under
 * load 3-5 in profile_quant_decode.py). With a parallel
 * region per kernel (7 a layer, ~210 a step of 30 layers) and GOMP_SPINCOUNT low (segserve/openmp.py),
 * every region paid its sleeping threads' futex wake-up on top of the join. Each output element is
 * computed by the same code in the same order as by the per-kernel entry points (sg_linear, sg_rope,
 * sg_write_kv, sg_decode_attention), so the step equals their composition bit for bit; the prologue
 * rows (RMSNorm, SiLU gate) are made by every thread into its own buffer rather than once behind a
 * barrier (a few thousand values).
 *
 * With a->tiles (bfloat16 steps of up to 64 rows) each layer is layer_tiles instead: the projections as
 * tile products of prepacked weights (AMX, or vdpbf16ps register tiles) inside the same region.
 *
 * With a->lm_w (not with tiles) the step's head follows in the same region: hidden = RMSNorm(h) *
 * final_norm (sg_rows' code), then logits = hidden . lm_w^T as sg_linear computes it with a float32
 * output (the LM head's own call, bit for bit). That spares the ~0.5 ms of Python a batch-1 step paid
 * between three calls, run with its caches cold from the step's weight stream.
 *
 * Rows 0..n-1 of h are the decodes (row j is request j of the block table); rows n..M-1 are padding:
 * computed, never written to the cache, given zero attention output. Returns OK, ERR_LAYOUT,
 * ERR_SHAPE / ERR_ROW / ERR_BLOCK (checked up front: nothing written) or ERR_NOMEM. */
int sg_decode_stack(const sg_decode_stack_args *a) {
    if (a->size != (int64_t)sizeof *a || a->layer_size != (int64_t)sizeof(sg_layer)) return ERR_LAYOUT;
    const int dt = a->dt;
    const int64_t M = a->M, H = a->H, I = a->I, Hq = a->Hq, Hkv = a->Hkv, D = a->D, n = a->n;
    const int64_t num_blocks = a->num_blocks, block_size = a->block_size;
    const int64_t *slot_mapping = a->slot_mapping;
    void *h = a->h;
    /* Checked before anything is written, so bad input leaves h and the caches as they were. */
    if (n > M || H % 32 || I % 32 || D % 16 || D > MAX_D || Hq % Hkv || Hq / Hkv > MAX_G || a->seg < 1)
        return ERR_SHAPE;
    for (int64_t j = 0; j < n; j++)
        if (slot_mapping[j] < 0 || slot_mapping[j] >= num_blocks * block_size || a->reqs[j] != j ||
            a->rows[j] != j)
            return ERR_SHAPE;
    if (a->tiles != TILES_NONE && !tiles_fit(a)) return ERR_SHAPE;
    size_t es = dt == DT_F32 ? 4 : 2;
    const int64_t nqkv = (Hq + 2 * Hkv) * D, nq = Hq * D;
    /* Every layer's four products, their shapes checked here (not one layer into the step). */
    sg_linear_args lin[4] = {
        {.size = sizeof(sg_linear_args), .dt = dt, .ydt = dt, .M = M, .N = nqkv, .K = H, .ldx = H,
         .prologue = PRO_RMSNORM, .eps = a->eps, .ldy = nqkv},
        {.size = sizeof(sg_linear_args), .dt = dt, .ydt = dt, .M = M, .N = H, .K = nq, .ldx = nq,
         .prologue = PRO_NONE, .ldy = H, .accumulate = 1},
        {.size = sizeof(sg_linear_args), .dt = dt, .ydt = dt, .M = M, .N = 2 * I, .K = H, .ldx = H,
         .prologue = PRO_RMSNORM, .eps = a->eps, .ldy = 2 * I},
        {.size = sizeof(sg_linear_args), .dt = dt, .ydt = dt, .M = M, .N = H, .K = I, .ldx = 2 * I,
         .prologue = PRO_SILU_MUL, .ldy = H, .accumulate = 1}};
    int any_block = 0, any_xq8 = 0;
    sg_linear_args head = {.size = sizeof(sg_linear_args), .dt = dt, .ydt = DT_F32, .M = M, .N = a->vocab, .K = H,
                           .x = a->hidden, .ldx = H, .prologue = PRO_NONE, .w = a->lm_w, .wqt = a->lm_wqt,
                           .y = a->logits, .ldy = a->vocab, .xq8 = xq8_for(a->xq8, a->lm_wqt)};
    if (a->lm_w) {
        if (a->tiles || !a->final_norm || !a->hidden || !a->logits || linear_shape(&head) != OK) return ERR_SHAPE;
        any_block |= a->lm_wqt != WQT_DENSE;
        any_xq8 |= head.xq8;
    }
    for (int64_t l = 0; l < a->num_layers; l++) {
        const sg_layer *ly = &a->layers[l];
        const int32_t wqt[4] = {ly->qkv_wqt, ly->o_wqt, ly->gate_up_wqt, ly->down_wqt};
        for (int k = 0; k < 4; k++) {
            lin[k].wqt = wqt[k], lin[k].xq8 = xq8_for(a->xq8, wqt[k]);
            if (linear_shape(&lin[k]) != OK) return ERR_SHAPE;
            any_block |= wqt[k] != WQT_DENSE;
            any_xq8 |= lin[k].xq8;
        }
    }
    const int64_t kmax = H > I ? (H > nq ? H : nq) : (I > nq ? I : nq);
    const size_t bufbytes = linear_buf_bytes(dt, any_block ? WQT_Q8_0 : WQT_DENSE, M, kmax);
    char *qkv = (char *)malloc(es * M * nqkv);
    void *attn = calloc((size_t)M * nq, es); /* padding rows stay zero: attention never writes them */
    void *gate_up = malloc(es * M * 2 * I);
    void *i8 = any_xq8 ? aligned_alloc(64, sg_quant_i8_scratch_bytes(M, kmax)) : NULL;
    uint16_t *xn = a->tiles ? (uint16_t *)malloc(es * M * H) : NULL; /* layer_tiles' norm rows */
    /* Every layer's attention but for its cache: its q rows are the fused QKV output's Q heads. */
    sg_decode_attention_args att = {
        .size = sizeof att, .dt = dt, .n = n, .Hq = Hq, .Hkv = Hkv, .D = D, .q = qkv, .ldq = nqkv,
        .out = attn, .T = M, .rows = a->rows, .num_blocks = num_blocks, .block_size = block_size,
        .block_table = a->block_table, .B = n, .ld_bt = a->ld_bt, .reqs = a->reqs, .lens = a->lens,
        .seg = a->seg, .scale = a->scale};
    /* layer_tiles' RoPE pass (the per-row path rotates inside the attention items instead). */
    const sg_rope_args rope = {.size = sizeof rope, .dt = dt, .T = M, .H = Hq + Hkv, .D = D, .x = qkv,
                               .row_stride = nqkv, .cos = a->cos, .ssin = a->ssin};
    att_plan plan = {0};
    int rc = check_decodes(&att);
    if (rc == OK && (!qkv || !attn || !gate_up || (any_xq8 && !i8) || (a->tiles && !xn))) rc = ERR_NOMEM;
    if (rc == OK) rc = attention_plan(&att, &plan);
    if (rc == OK) {
        int failed = 0;
        const size_t nscores = attention_scores_floats(&att, &plan);
        /* A few decodes: every thread merges the attention partials itself, into its own rows (no
         * barrier; see attention_team). */
        const int own_merge = n <= OWN_MERGE_ROWS && !a->tiles;
        /* The caller's thread-locals: read before the region. */
        int64_t *const timing = stack_timing, timing_layers = stack_timing_layers;
        /* layer_tiles' SiLU-gated rows (M, I) go in the (M, 2 I) gate_up buffer. */
        const tile_step st = {.a = a, .rope = &rope, .plan = &plan, .qkv = (uint16_t *)qkv, .attn = attn, .xn = xn,
                             .act = gate_up};
        /* The step's ~150 barriers spin adaptively (segserve_team_sync.h), but for those inside the AMX product. */
        team_barrier bar = {0};
#pragma omp parallel
        {
            team_sync_enter(&bar);
            int64_t *tl = NULL, t_last = 0;
            void *buf = malloc(bufbytes);
            float *scores = (float *)malloc(sizeof(float) * nscores);
            void *own = own_merge ? calloc((size_t)M * nq, es) : NULL; /* padding rows stay zero */
            if (!buf || !scores || (own_merge && !own)) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp barrier
            if (a->tiles == TILES_AMX) sg_team_tiles_begin(M);
            for (int64_t l = 0; l < a->num_layers && !failed; l++) {
                const sg_layer *ly = &a->layers[l];
                /* Private copies: lin and att are shared, and each thread points them at this layer. */
                sg_linear_args qa = lin[0], oa = lin[1], ga = lin[2], da = lin[3];
                qa.x = h, qa.norm_w = ly->ln1, qa.w = ly->qkv, qa.wqt = ly->qkv_wqt, qa.bias = ly->qkv_bias;
                qa.y = qkv;
                oa.x = own_merge ? own : attn, oa.w = ly->o, oa.wqt = ly->o_wqt, oa.y = h;
                ga.x = h, ga.norm_w = ly->ln2, ga.w = ly->gate_up, ga.wqt = ly->gate_up_wqt, ga.y = gate_up;
                da.x = gate_up, da.w = ly->down, da.wqt = ly->down_wqt, da.y = h;
                qa.xq8 = xq8_for(a->xq8, qa.wqt), oa.xq8 = xq8_for(a->xq8, oa.wqt);
                ga.xq8 = xq8_for(a->xq8, ga.wqt), da.xq8 = xq8_for(a->xq8, da.wqt);
                sg_decode_attention_args la = att;
                la.cache = ly->kv_cache;
                const att_fuse fz = {.cos = a->cos, .ssin = a->ssin, .slot_mapping = slot_mapping, .nq = nq,
                                     .cache = ly->kv_cache};
                if (timing && l < timing_layers && omp_get_thread_num() == 0) {
                    tl = timing + l * STACK_PHASES;
                    t_last = now_ns();
                } else {
                    tl = NULL;
                }
                if (a->tiles) {
                    layer_tiles(&st, ly, &la, scores, tl, &t_last);
                    continue;
                }
                int64_t ld;
                const void *xin = linear_input(&qa, buf, &ld);
                linear_tiles(&qa, xin, ld, i8);
                stamp_phase(tl, PH_QKV, &t_last);
                /* RoPE and the KV write happen inside the attention items (fused_query). */
                attention_team(&la, &plan, scores, &fz, own);
                stamp_phase(tl, PH_ATTENTION, &t_last);
                xin = linear_input(&oa, buf, &ld);
                linear_tiles(&oa, xin, ld, i8);
                stamp_phase(tl, PH_O, &t_last);
                xin = linear_input(&ga, buf, &ld);
                linear_tiles(&ga, xin, ld, i8);
                stamp_phase(tl, PH_GATE_UP, &t_last);
                xin = linear_input(&da, buf, &ld);
                linear_tiles(&da, xin, ld, i8);
                stamp_phase(tl, PH_DOWN, &t_last);
            }
            if (a->lm_w && !failed) {
#pragma omp for schedule(static) nowait
                for (int64_t m = 0; m < M; m++)
                    prologue_row(dt, PRO_RMSNORM, H, h, H, m, a->final_norm, a->eps, a->hidden);
                team_sync();
                int64_t ld;
                const void *xin = linear_input(&head, buf, &ld);
                linear_tiles(&head, xin, ld, i8);
            }
            if (a->tiles == TILES_AMX) sg_team_tiles_end();
            team_sync_leave();
            free(buf);
            free(scores);
            free(own);
        }
        if (failed) rc = ERR_NOMEM;
    }
    attention_plan_free(&plan);
    free(qkv);
    free(attn);
    free(gate_up);
    free(i8);
    free(xn);
    return rc;
}
