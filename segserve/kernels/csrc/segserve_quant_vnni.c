/* GGUF block weights (Q8_0, Q4_0, Q4_1) times int8-quantized activations, with AVX-512 VNNI.
 *
 *   sg_quant_matmul_i8  (called by sg_linear in segserve_cpu.c when its caller asks for int8
 *                       activations) what sg_quant_matmul computes, with each 32-value block of x
 *                       rounded to int8 under its own float32 scale first.
 *
 * Why: the float kernel (segserve_quant.c) spends ~7 instructions per block and weight row widening
 * nibbles to floats; here one vpdpbusd multiplies 64 stored nibbles or bytes by 64 int8 activations and
 * sums them in fours, so a pair of blocks costs about 8 instructions for all 64 values. The design is
 * llama.cpp's (ggml-cpu quantizes each activation row to Q8_0 / Q8_1 blocks once per matrix product and
 * takes integer dot products with the weight blocks); the code is segserve's own.
 *
 * vpdpbusd multiplies unsigned bytes by signed bytes. The weights are made the unsigned side: Q4 nibbles
 * are 0..15 as stored, Q8_0's signed bytes get 128 added (xor 0x80). The offset this leaves (8 for Q4_0,
 * whose value is nibble - 8; 128 for Q8_0) times the block's sum of int8 activations is subtracted by
 * starting each accumulator at -offset * (lane sums of the activations), computed once per row. Q4_1's
 * value is d * nibble + m: its m term is m times the sum of the block's rounded activations, added in
 * float32. The rounded sum, not the exact one: the product is then exactly dequant(w) . round(x), whose
 * error sum_k w_k (round(x_k) - x_k) is weighted by the centred weights; with the exact sum the error's
 * weights would be d * nibble, all of one sign and about twice as large (measured on the tests' tiny
 * Q4_1 model: its first-token logprobs moved 0.136 with the exact sum, under 0.05 with the rounded one).
 *
 * Layout of one pair of blocks b, b + 1 of an activation row (64 int8, matching how the weights load):
 *   Q4_0, Q4_1: [b values 0..15 | b+1 values 0..15 | b values 16..31 | b+1 values 16..31]
 *               (the 32 stored bytes of the pair, low nibbles then high nibbles)
 *   Q8_0:       [b values 0..31 | b+1 values 0..31]
 * so int32 lane l of a product holds block b's or b+1's partial sum: lanes 4..7 and 12..15 are b+1's
 * for Q4 (mask 0xF0F0), lanes 8..15 for Q8_0 (0xFF00). An odd last block pairs with zeros.
 *
 * Error: each activation is off by at most half a step of its block's scale (amax / 254), so a dot
 * product's error is at most sum_b amax_b / 254 * sum |w| over the block; the tests bound it so.
 * Tiles and threads as segserve_quant.c (NT weight rows by MT rows, orphaned OpenMP worksharing over
 * weight-row groups: the caller's team does the work; no region of its own).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "segserve_quant.h"
#include "segserve_quant_inl.h"
#include "segserve_team_sync.h"

enum { V_OK = 0, V_ERR_SHAPE = -1, V_ERR_NOMEM = -2 };
#ifndef PF_GROUPS
#define PF_GROUPS 2
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

int sg_quant_int8_built(void) { return 1; }

/* The int8 form of M activation rows: np = ceil(nb / 2) pairs of blocks per row. */
struct xrows {
    int64_t np;
    int8_t *q;    /* (M, np, 64) int8 values in the pair layout above */
    float *dx;    /* (M, np, 16) each lane's block scale (0 for a missing odd block) */
    int32_t *c0;  /* (M, np, 16) accumulator start: -offset * the lane's sum of 4 int8 values */
    float *xs;    /* (M, 2 np) each rounded block's sum, scale * sum(q) (Q4_1's m term); 0 if missing */
};

/* 32 values of x as int8 (16 + 16 in q0, q1) under the scale it returns: amax / 127, or 0 for a block
 * of zeros (its values are then 0); *sum is the rounded block's sum, scale * sum(q). Rounding: to
 * nearest even (the MXCSR default of vcvtps2dq). */
static inline float quantize_block(const float *x, __m128i *q0, __m128i *q1, float *sum) {
    __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
    *q0 = _mm512_cvtepi32_epi8(i0);
    *q1 = _mm512_cvtepi32_epi8(i1);
    *sum = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)) * (amax / 127.0f);
    return amax / 127.0f;
}

static void quantize_row(int wqt, const float *x, int64_t nb, int64_t np, int8_t *q, float *dx, int32_t *c0,
                         float *xs) {
    const int q4 = wqt != WQT_Q8_0;
    const int8_t off = wqt == WQT_Q4_0 ? 8 : wqt == WQT_Q8_0 ? (int8_t)0x80 : 0;
    const __mmask16 second = q4 ? 0xF0F0 : 0xFF00;
    for (int64_t p = 0; p < np; p++) {
        __m128i a0, a1, b0 = _mm_setzero_si128(), b1 = _mm_setzero_si128();
        float da, db = 0.0f, sa, sb = 0.0f;
        da = quantize_block(x + 64 * p, &a0, &a1, &sa);
        if (2 * p + 1 < nb) db = quantize_block(x + 64 * p + 32, &b0, &b1, &sb);
        int8_t *dst = q + 64 * p;
        if (q4) {
            _mm_storeu_si128((__m128i *)dst, a0);
            _mm_storeu_si128((__m128i *)(dst + 16), b0);
            _mm_storeu_si128((__m128i *)(dst + 32), a1);
            _mm_storeu_si128((__m128i *)(dst + 48), b1);
        } else {
            _mm_storeu_si128((__m128i *)dst, a0);
            _mm_storeu_si128((__m128i *)(dst + 16), a1);
            _mm_storeu_si128((__m128i *)(dst + 32), b0);
            _mm_storeu_si128((__m128i *)(dst + 48), b1);
        }
        _mm512_storeu_ps(dx + 16 * p, _mm512_mask_blend_ps(second, _mm512_set1_ps(da), _mm512_set1_ps(db)));
        __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(off),
                                           _mm512_loadu_si512(dst));
        _mm512_storeu_si512(c0 + 16 * p, _mm512_sub_epi32(_mm512_setzero_si512(), sums));
        xs[2 * p] = sa;
        xs[2 * p + 1] = sb;
    }
}

/* The 64 weights of blocks b and b + 1 (only b when !two) as unsigned bytes in the pair layout. */
static inline __attribute__((always_inline)) __m512i load_pair(int wqt, const uint8_t *blk, int64_t bb, int two) {
    if (wqt == WQT_Q8_0) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(blk + 2));
        __m256i c = two ? _mm256_loadu_si256((const __m256i *)(blk + bb + 2)) : _mm256_setzero_si256();
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1), _mm512_set1_epi8((char)0x80));
    }
    const int o = wqt == WQT_Q4_1 ? 4 : 2;
    __m128i a = _mm_loadu_si128((const __m128i *)(blk + o));
    __m128i c = two ? _mm_loadu_si128((const __m128i *)(blk + bb + o)) : _mm_setzero_si128();
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(a), c, 1);
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

/* out[i][j] = dot(x row m0 + i, dequant(weight row wr[j])) with x in its int8 form; inlined with constant
 * wqt, nt and mt so the accumulators live in registers. */
static inline __attribute__((always_inline)) void qtile_i8(int wqt, int nt, int mt, const uint8_t *const wr[8],
                                                           int64_t nb, int64_t bb, const struct xrows *xr, int64_t m0,
                                                           float out[8][8]) {
    const int64_t np = xr->np;
    const __mmask16 second = wqt == WQT_Q8_0 ? 0xFF00 : 0xF0F0;
    __m512 acc[8][8];
    float sd[8][SCALE_CHUNK], sm[8][SCALE_CHUNK];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += SCALE_CHUNK) { /* SCALE_CHUNK is even: pairs never straddle */
        int64_t cb = nb - b0 < SCALE_CHUNK ? nb - b0 : SCALE_CHUNK;
        for (int j = 0; j < nt; j++) load_scales(wqt, wr[j], bb, b0, cb, sd[j], sm[j]);
        for (int64_t c = 0; c < cb; c += 2) {
            const int64_t p = (b0 + c) / 2;
            const int two = c + 1 < cb;
            for (int j = 0; j < nt; j++) {
                /* The same bytes PF_GROUPS tiles on (a thread's tiles are consecutive rows): the
                 * hardware prefetcher alone left a batch-1 step waiting on memory (~1.5x slower). */
                _mm_prefetch((const char *)wr[j] + PF_GROUPS * nt * nb * bb + (b0 + c) * bb, _MM_HINT_T0);
                __m512i w = load_pair(wqt, wr[j] + (b0 + c) * bb, bb, two);
                __m512 dw = _mm512_mask_blend_ps(second, _mm512_set1_ps(sd[j][c]),
                                                 _mm512_set1_ps(two ? sd[j][c + 1] : 0.0f));
                for (int i = 0; i < mt; i++) {
                    const int64_t r = (m0 + i) * np + p;
                    __m512i start = wqt == WQT_Q4_1 ? _mm512_setzero_si512() : _mm512_loadu_si512(xr->c0 + 16 * r);
                    __m512i t = _mm512_dpbusd_epi32(start, w, _mm512_loadu_si512(xr->q + 64 * r));
                    __m512 s = _mm512_mul_ps(dw, _mm512_loadu_ps(xr->dx + 16 * r));
                    acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[i][j]);
                }
            }
        }
        if (wqt == WQT_Q4_1)
            for (int64_t c = 0; c < cb; c += 16) {
                __mmask16 k = (__mmask16)(cb - c >= 16 ? 0xFFFFu : (1u << (cb - c)) - 1u);
                for (int j = 0; j < nt; j++) {
                    __m512 mv = _mm512_maskz_loadu_ps(k, sm[j] + c);
                    for (int i = 0; i < mt; i++)
                        acc[i][j] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xr->xs + (m0 + i) * 2 * np + b0 + c),
                                                    acc[i][j]);
                }
            }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

#define VPASS(WQT, NT, MT)                                                                                 \
    do {                                                                                                   \
        _Pragma("omp for schedule(static) nowait") for (int64_t g = 0; g < groups; g++) {                  \
            const uint8_t *wr[8];                                                                          \
            float out[8][8];                                                                               \
            int64_t n0 = g * (NT);                                                                         \
            for (int j = 0; j < (NT); j++) wr[j] = wb + (n0 + j < N ? n0 + j : N - 1) * rb;                  \
            qtile_i8(WQT, NT, MT, wr, nb, bb, &xr, m0, out);                                               \
            for (int i = 0; i < (MT); i++)                                                                 \
                for (int j = 0; j < (NT) && n0 + j < N; j++)                                               \
                    epilogue(dt, ydt, accumulate, bias, out[i][j], n0 + j, y, (m0 + i) * ldy + n0 + j);    \
        }                                                                                                  \
        team_sync();                                                                                       \
    } while (0)

size_t sg_quant_i8_scratch_bytes(int64_t M, int64_t K) {
    const size_t np = (size_t)(K / 32 + 1) / 2, nq = (size_t)M * np * 64, nf = (size_t)M * np * 16;
    return nq + 3 * nf * 4 + 64;
}

int sg_quant_matmul_i8(int dt, int ydt, int wqt, int64_t M, int64_t N, int64_t K, const float *xf,
                       int64_t ldxf, const void *w, const void *bias, void *y, int64_t ldy, int accumulate,
                       void *scratch) {
    const int64_t bb = sg_quant_block_bytes(wqt), nb = K / 32, rb = nb * bb, np = (nb + 1) / 2;
    const uint8_t *wb = (const uint8_t *)w;
    if (bb == 0 || M < 1 || N < 1 || K < 32 || K % 32) return V_ERR_SHAPE;
    /* The int8 rows in the caller's (shared, 64-byte aligned) scratch: q, dx, c0, xs. */
    char *buf = (char *)scratch;
    size_t nq = (size_t)M * np * 64, nf = (size_t)M * np * 16;
    struct xrows xr = {.np = np, .q = (int8_t *)buf, .dx = (float *)(buf + nq), .c0 = (int32_t *)(buf + nq + nf * 4),
                .xs = (float *)(buf + nq + 2 * nf * 4)};
    /* Rows are independent; the loop's closing barrier publishes them before any tile reads them. */
#pragma omp for schedule(static) nowait
    for (int64_t m = 0; m < M; m++)
        quantize_row(wqt, xf + m * ldxf, nb, np, xr.q + m * np * 64, xr.dx + m * np * 16, xr.c0 + m * np * 16,
                     xr.xs + m * 2 * np);
    team_sync();
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        int mt = M - m0 < 8 ? (int)(M - m0) : 8;
        int64_t groups;
        if (wqt == WQT_Q8_0) { Q_PASS_FOR_ROWS(VPASS, WQT_Q8_0) }
        else if (wqt == WQT_Q4_0) { Q_PASS_FOR_ROWS(VPASS, WQT_Q4_0) }
        else { Q_PASS_FOR_ROWS(VPASS, WQT_Q4_1) }
    }
    return V_OK;
}

#undef VPASS

#else /* built without AVX-512 VNNI: the int8 path is refused, the float one stays */

int sg_quant_int8_built(void) { return 0; }

size_t sg_quant_i8_scratch_bytes(int64_t M, int64_t K) {
    (void)M, (void)K;
    return 64;
}

int sg_quant_matmul_i8(int dt, int ydt, int wqt, int64_t M, int64_t N, int64_t K, const float *xf,
                       int64_t ldxf, const void *w, const void *bias, void *y, int64_t ldy, int accumulate,
                       void *scratch) {
    (void)dt, (void)ydt, (void)wqt, (void)M, (void)N, (void)K, (void)xf, (void)ldxf, (void)w, (void)bias;
    (void)y, (void)ldy, (void)accumulate, (void)scratch;
    return V_ERR_SHAPE;
}

#endif
