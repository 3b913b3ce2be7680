/* Float32 GEMM with GGUF block weights for large steps (prefill chunks, big batches):
 *
 *   sg_f32gemm   y[m, n] = sum_k x[m, k] * dequant(w)[n, k] (+ bias[n]), x float32 (M, K), w (N, K / 32)
 *                Q4_0 / Q4_1 / Q8_0 blocks (formats in segserve_quant.c), y float32 (M, N).
 *
 * Structure: the Goto/BLIS blocking (Goto & van de Geijn, "Anatomy of High-Performance Matrix
 * Multiplication", ACM TOMS 34(3), 2008; Van Zee & van de Geijn, "BLIS", TOMS 2015) with the roles set
 * by what is cheap here:
 *   - B (the weight) is dequantized straight from its blocks into packed panels of NR = 64 columns,
 *     laid out k-major ([k][64]), one block of KC x NC per thread sized to stay in that core's L2. The
 *     dequantize and the pack are one pass; the float32 weight never exists in full.
 *   - A (the activations) is not packed: an MR = 6 row micro-panel (6 x KC floats, <= 18 KB) is read in
 *     place and stays in L1 while the micro-kernel sweeps every B panel of the block, so A's broadcasts
 *     come from L1 and B's vector loads stream from L2 (4 zmm per 24 FMAs).
 *   - micro-kernel: 6 x 64 outputs in 24 zmm accumulators, per k one 64-float row of the B panel (4
 *     loads) and 6 broadcasts of A embedded in vfmadd231ps: 24 independent FMA chains, more than the
 *     2 ports x 4 cycles of latency need.
 * Threads: one OpenMP region per call over work items (a column block of packed B x a block of rows),
 * each thread owning a contiguous share of column blocks and stealing from the others' ends when done
 * (see gemm_items); no barrier inside. Edge tiles use the same kernel with fewer rows (mr < 6) or zmm
 * columns (nv < 4) and a lane mask on the last column.
 * Summation order: for each output, k ascending within a KC block, blocks added in order (the first
 * block's sum plus bias is stored, later blocks are added to y): the float32 product of the exact
 * dequantized weights, differing from x @ dequant(w).T only in that order.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "segserve_quant.h"
#include "segserve_quant_inl.h"

#if !defined(__AVX512F__) || !defined(__F16C__)
#error "segserve_f32gemm.c needs AVX-512F and F16C"
#endif

enum { G_OK = 0, G_ERR_SHAPE = -1, G_ERR_NOMEM = -2, G_ERR_LAYOUT = -5 };
enum { MR = 6, NR = 64, NV = NR / 16 };
/* Bytes of packed B a thread keeps per block: under half of a 2 MB (Xeon) or 1 MB (Zen 4) L2, so the
 * A rows and y tiles that pass through do not evict it. */
#define B_BLOCK_BYTES (448 * 1024)
/* Most k per block: 768 keeps the A micro-panel (6 x 768 floats, 18 KB) in a 32-48 KB L1 beside the
 * lines of B in flight; K = 1536 then runs as two blocks of 768. */
#define KC_MAX 768

typedef struct {
    int64_t size;      /* sizeof(sg_f32gemm_args) */
    int32_t wqt;       /* WQT_Q4_0, WQT_Q4_1 or WQT_Q8_0 */
    int32_t pad;       /* unused: keeps the 64-bit fields aligned as ctypes lays them out */
    int64_t M;         /* rows of x and y, >= 1 */
    int64_t N;         /* rows of w, columns of y, >= 1 */
    int64_t K;         /* a positive multiple of 32 */
    const float *x;    /* (M, K) with row stride ldx (elements), ldx >= K */
    int64_t ldx;
    const void *w;     /* (N, K / 32) blocks, rows contiguous */
    const float *bias; /* (N,) or NULL */
    float *y;          /* (M, N) with row stride ldy >= N; must not overlap x */
    int64_t ldy;
} sg_f32gemm_args;

/* One block's 32 exact values (lo: values 0..15, hi: 16..31), as segserve_quant.c's dequant_block
 * (kept a private copy: that file belongs to the decode kernels and exports nothing inline). */
static inline __attribute__((always_inline)) void g_dequant_block(int wqt, const uint8_t *b, __m512 *lo,
                                                                  __m512 *hi) {
    __m512 vd = _mm512_set1_ps(half_at(b));
    if (wqt == WQT_Q8_0) {
        __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        *lo = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = wqt == WQT_Q4_1 ? _mm512_fmadd_ps(vd, iota, _mm512_set1_ps(half_at(b + 2)))
                                   : _mm512_mul_ps(vd, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (wqt == WQT_Q4_1 ? 4 : 2))));
    *lo = _mm512_permutexvar_ps(q, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

/* r[i] (row i, 16 columns) -> r[c] = column c: unpack pairs, then pairs of pairs, then 128-bit lanes
 * twice. Column c = 4 * lane + j ends up from register j of its group of four. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int h = 0; h < 16; h += 8)
        for (int j = 0; j < 4; j++) {
            t[h + j] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0x88);
            t[h + j + 4] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}

/* Packs weight rows n0 .. n0 + nc - 1 (nc a multiple of 16; rows >= N give zeros), blocks kb0 .. kb0 +
 * nkb - 1 into bp: panel p holds columns n0 + 64p .. + 63 as [k][64]. Per 16 rows and block: 16
 * dequantized rows of 32 values, two 16 x 16 transposes, 32 aligned stores. */
static inline __attribute__((always_inline)) void pack_b(int wqt, const uint8_t *w, int64_t N, int64_t rb,
                                                         int64_t bb, int64_t n0, int64_t nc, int64_t kb0,
                                                         int64_t nkb, float *bp) {
    const int64_t kc = nkb * 32;
    for (int64_t g = 0; g < nc; g += 16) {
        float *panel = bp + (g / NR) * kc * NR + g % NR;
        for (int64_t b = 0; b < nkb; b++) {
            __m512 lo[16], hi[16];
            for (int j = 0; j < 16; j++) {
                int64_t n = n0 + g + j;
                if (n < N) g_dequant_block(wqt, w + n * rb + (kb0 + b) * bb, &lo[j], &hi[j]);
                else lo[j] = hi[j] = _mm512_setzero_ps();
            }
            transpose16(lo);
            transpose16(hi);
            float *dst = panel + b * 32 * NR;
            for (int c = 0; c < 16; c++) {
                _mm512_store_ps(dst + c * NR, lo[c]);
                _mm512_store_ps(dst + (16 + c) * NR, hi[c]);
            }
        }
    }
}

/* y[0..mr, 0..16 nv] (=, or += when acc) sum over k < kc of a[i, k] * bp[k, :] (+ bias when given);
 * lanes of the last zmm column outside `last` are not stored; apf (or NULL): 6 rows (stride lda) to
 * prefetch into L2 on the way. mr and nv are constants after inlining,
 * so the accumulators live in registers. */
static inline __attribute__((always_inline)) void micro(int mr, int nv, const float *a, int64_t lda,
                                                        const float *bp, int64_t kc, float *y, int64_t ldy,
                                                        const float *bias, int acc, __mmask16 last,
                                                        const float *apf) {
    __m512 c[MR][NV];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) c[i][v] = _mm512_setzero_ps();
    const float *ar[MR];
    for (int i = 0; i < mr; i++) ar[i] = a + i * lda;
    for (int64_t k = 0; k < kc; k++) {
        __m512 b[NV];
        for (int v = 0; v < nv; v++) b[v] = _mm512_load_ps(bp + k * NR + 16 * v);
        /* x rows past L2 (M >= ~1k) otherwise reach the first panel from L3, serially in k: pulling
         * the next micro-panel into L2 here measured 1.1-1.2x at M = 1024 (single thread, A/B). */
        if (apf && (k & 15) == 0)
            for (int i = 0; i < MR; i++) _mm_prefetch((const char *)(apf + i * lda + k), _MM_HINT_T1);
        for (int i = 0; i < mr; i++) {
            __m512 av = _mm512_set1_ps(ar[i][k]);
            for (int v = 0; v < nv; v++) c[i][v] = _mm512_fmadd_ps(av, b[v], c[i][v]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) {
            __mmask16 mk = v == nv - 1 ? last : (__mmask16)0xffff;
            float *p = y + i * ldy + 16 * v;
            __m512 r = c[i][v];
            if (acc) r = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, p), r);
            else if (bias) r = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, bias + 16 * v), r);
            _mm512_mask_storeu_ps(p, mk, r);
        }
}

#define G_MICRO_NV(MR_, NV_) micro(MR_, NV_, a, lda, bp, kc, y, ldy, bias, acc, last, apf)
#define G_MICRO_MR(MR_)                                                                                    \
    switch (nv) {                                                                                          \
    case 1: G_MICRO_NV(MR_, 1); break;                                                                     \
    case 2: G_MICRO_NV(MR_, 2); break;                                                                     \
    case 3: G_MICRO_NV(MR_, 3); break;                                                                     \
    default: G_MICRO_NV(MR_, 4); break;                                                                    \
    }

/* The micro-kernel for a tile of mr (1..6) rows and nv (1..4) zmm columns. */
static void micro_any(int mr, int nv, const float *a, int64_t lda, const float *bp, int64_t kc, float *y,
                      int64_t ldy, const float *bias, int acc, __mmask16 last, const float *apf) {
    switch (mr) {
    case 1: G_MICRO_MR(1); break;
    case 2: G_MICRO_MR(2); break;
    case 3: G_MICRO_MR(3); break;
    case 4: G_MICRO_MR(4); break;
    case 5: G_MICRO_MR(5); break;
    default: G_MICRO_MR(6); break;
    }
}

/* Each pool thread keeps its packing buffer between calls (PyTorch's OpenMP threads live as long as
 * the process): one allocation per thread, not one per call. */
static __thread float *tls_buf;
static __thread size_t tls_cap;

static float *thread_buffer(size_t bytes) {
    if (bytes > tls_cap) {
        free(tls_buf);
        tls_buf = aligned_alloc(64, bytes);
        tls_cap = tls_buf ? bytes : 0;
    }
    return tls_buf;
}

/* The micro-tile at rows i0.., columns j0 + p0.. of the packed block (nc columns, kc values from k0). */
static inline void tile(const sg_f32gemm_args *a, int64_t i0, int64_t j0, int64_t p0, int64_t k0, int64_t nc,
                        int64_t kc, const float *buf) {
    const int64_t M = a->M, N = a->N;
    const int mr = M - i0 < MR ? (int)(M - i0) : MR;
    const int64_t n = j0 + p0, room = N - n < nc - p0 ? N - n : nc - p0;
    const int64_t cols = room < NR ? room : NR;
    const int nv = (int)((cols + 15) / 16);
    const int tail = (int)(cols - 16 * (nv - 1));
    const __mmask16 last = (__mmask16)(tail == 16 ? 0xffffu : (1u << tail) - 1u);
    /* The first panel of a micro-panel prefetches the next one's 6 rows of x. */
    const float *apf = p0 == 0 && i0 + 2 * MR <= M ? a->x + (i0 + MR) * a->ldx + k0 : NULL;
    micro_any(mr, nv, a->x + i0 * a->ldx + k0, a->ldx, buf + p0 * kc, kc, a->y + i0 * a->ldy + n, a->ldy,
              a->bias ? a->bias + n : NULL, k0 > 0, last, apf);
}

/* Takes one item of the range packed in *r (first item << 32 | end): the front for its owner, the back
 * for a thief. Returns 0 when the range is empty. */
static int take_item(uint64_t *r, int back, int64_t *item) {
    uint64_t v = __atomic_load_n(r, __ATOMIC_ACQUIRE);
    for (;;) {
        uint64_t f = v >> 32, e = v & 0xffffffffu;
        if (f >= e) return 0;
        uint64_t nv = back ? (f << 32) | (e - 1) : ((f + 1) << 32) | e;
        if (__atomic_compare_exchange_n(r, &v, nv, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *item = back ? (int64_t)e - 1 : (int64_t)f;
            return 1;
        }
    }
}

/* Work items: column block jc (cw columns, all of K packed at once) x row block (rh rows), numbered
 * jc-major. Thread t owns a contiguous share of column blocks and walks its items front to back,
 * packing each column block once; a thread that runs out takes items from the back of the others'
 * (packing that block itself: a few percent of the item), so a thread the OS preempts on a shared
 * host delays the step by its last item, not by half the step. */
static void gemm_items(const sg_f32gemm_args *a, uint64_t *ranges, int t, int nt, int64_t cw, int64_t rh,
                       int64_t nrow, int64_t kcb, int *rc) {
    const int wqt = a->wqt;
    const int64_t M = a->M, N = a->N, K = a->K, bb = sg_quant_block_bytes(wqt), rb = K / 32 * bb;
    float *buf = thread_buffer((size_t)K * cw * sizeof(float));
    if (!buf) {
        __atomic_store_n(rc, G_ERR_NOMEM, __ATOMIC_RELAXED);
        return;
    }
    int64_t packed = -1, it;
    for (;;) {
        int got = take_item(&ranges[t], 0, &it);
        for (int v = 1; v < nt && !got; v++) got = take_item(&ranges[(t + v) % nt], 1, &it);
        if (!got) return;
        const int64_t jc = it / nrow, j0 = jc * cw, nc = N - j0 < cw ? N - j0 : cw, nc16 = (nc + 15) / 16 * 16;
        if (jc != packed) {
            for (int64_t k0 = 0; k0 < K; k0 += kcb) {
                const int64_t kc = K - k0 < kcb ? K - k0 : kcb;
                float *bp = buf + k0 * cw;
                switch (wqt) {
                case WQT_Q8_0: pack_b(WQT_Q8_0, a->w, N, rb, bb, j0, nc16, k0 / 32, kc / 32, bp); break;
                case WQT_Q4_0: pack_b(WQT_Q4_0, a->w, N, rb, bb, j0, nc16, k0 / 32, kc / 32, bp); break;
                default: pack_b(WQT_Q4_1, a->w, N, rb, bb, j0, nc16, k0 / 32, kc / 32, bp); break;
                }
            }
            packed = jc;
        }
        /* A's 6 rows stay in L1 while B's panels stream from L2. The textbook order (KC = 96-128 so a
         * B micro-panel sits in L1, x streamed from L2 in 192-row blocks) measured 0.75-0.95x of this
         * one (single thread, interleaved builds, 2026-12-01). */
        const int64_t r0 = (it % nrow) * rh, r1 = M - r0 < rh ? M : r0 + rh;
        for (int64_t k0 = 0; k0 < K; k0 += kcb) {
            const int64_t kc = K - k0 < kcb ? K - k0 : kcb;
            for (int64_t i0 = r0; i0 < r1; i0 += MR)
                for (int64_t p0 = 0; p0 < nc; p0 += NR) tile(a, i0, j0, p0, k0, nc, kc, buf + k0 * cw);
        }
    }
}

/* The product described at the top of the file. Returns G_OK, G_ERR_LAYOUT (struct of another size),
 * G_ERR_SHAPE (a bad shape, stride or format) or G_ERR_NOMEM (a packing buffer could not be had;
 * y is then partly written). */
int sg_f32gemm(const sg_f32gemm_args *a) {
    if (a->size != (int64_t)sizeof *a) return G_ERR_LAYOUT;
    const int64_t M = a->M, N = a->N, K = a->K;
    if (sg_quant_block_bytes(a->wqt) == 0 || M < 1 || N < 1 || K < 32 || K % 32 || a->ldx < K || a->ldy < N)
        return G_ERR_SHAPE;
    /* Even k blocks (a multiple of 32 each) and the widest column block whose packed B fits the budget. */
    const int64_t kblocks = (K + KC_MAX - 1) / KC_MAX;
    const int64_t kcb = ((K / 32 + kblocks - 1) / kblocks) * 32;
    int64_t ncb = B_BLOCK_BYTES / ((int64_t)sizeof(float) * kcb) / NR * NR;
    if (ncb < NR) ncb = NR;
    /* About 8 row blocks per column block (fine enough to even out two threads), at least 48 rows (a
     * stolen item then pays for packing its column block several times over). */
    int rc = G_OK;
    const int nt = omp_get_max_threads();
    const int64_t ncol = (N + ncb - 1) / ncb, want = (M + 7) / 8 < 48 ? 48 : (M + 7) / 8;
    const int64_t rh = (want + MR - 1) / MR * MR, nrow = (M + rh - 1) / rh;
    uint64_t *ranges = malloc(sizeof(uint64_t) * (size_t)nt);
    if (!ranges) return G_ERR_NOMEM;
    for (int t = 0; t < nt; t++)
        ranges[t] = ((uint64_t)(ncol * t / nt * nrow) << 32) | (uint64_t)(ncol * (t + 1) / nt * nrow);
#pragma omp parallel num_threads(nt)
    gemm_items(a, ranges, omp_get_thread_num(), nt, ncb, rh, nrow, kcb, &rc);
    free(ranges);
    return rc;
}
