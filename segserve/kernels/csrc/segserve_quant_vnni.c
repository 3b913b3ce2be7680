/* GGUF block weights (Q8_0, Q4_0, Q4_1) times activations in 16-bit block fixed point, with AVX-512 VNNI.
 *
 *   sg_quant_matmul_i8  (called by sg_linear in segserve_cpu.c when its caller asks for integer
 *                       activations) what sg_quant_matmul computes, with each 32-value block of x
 *                       rounded to a 16-bit fixed-point value under its own float32 scale first.
 *
 * Why: the float kernel (segserve_quant.c) spends ~7 instructions per block and weight row widening
 * nibbles to floats, and the batch-1 decode step of a 4-bit file is bound by that, not by memory. Here
 * vpdpbusd multiplies 64 stored nibbles or bytes by 64 signed bytes and sums them in fours. The integer
 * dot product with the weight blocks is llama.cpp's design (ggml-cpu rounds each activation block to
 * 8 bits, Q8_0 / Q8_1); 8 bits move a small model's answers (on the default SmolLM2, greedy tokens
 * parted from the float path's on 4 of 7 real prompts, logits by up to 1.8), so each activation is kept
 * to 16 bits instead, as two signed bytes:
 *
 *   s = amax / 127, q1 = round(x / s), q2 = round((x - s q1) * 256 / s) (saturated to +-127), and
 *   x ~ (s / 256) (256 q1 + q2), off by at most s / 256 = amax / 32512 (half that but where a
 *   remainder at a tie saturates)
 *
 * (128 to 256 times closer than 8 bits, and finer than bfloat16's 2^-9 relative step for every value
 * above amax / 64). The dot product is then 256 vpdpbusd(w, q1) + vpdpbusd(w, q2): two
 * integer products, one shift and one add per pair of blocks and weight row, exact in int32 (|lane| <=
 * 4 * 255 * 127 * 257 < 2^31), one float32 conversion and FMA. The code is segserve's own.
 *
 * vpdpbusd multiplies unsigned bytes by signed bytes. The weights are made the unsigned side: Q4 nibbles
 * are 0..15 as stored, Q8_0's signed bytes get 128 added (xor 0x80). The offset this leaves (8 for Q4_0,
 * whose value is nibble - 8; 128 for Q8_0) times the block's sum of activations (256 q1 + q2) is
 * subtracted by starting the q2 product's accumulator at -offset * (lane sums of 256 q1 + q2), computed
 * once per row. Q4_1's value is d * nibble + m: its m term is m times the sum of the block's rounded
 * activations, added in float32. The rounded sum, not the exact one: the product is then exactly
 * dequant(w) . round(x), whose error sum_k w_k (round(x_k) - x_k) is weighted by the centred weights.
 *
 * Layout of one pair of blocks b, b + 1 of an activation row: 64 bytes of q1, then 64 of q2, each
 * matching how the weights load:
 *   Q4_0, Q4_1: [b values 0..15 | b+1 values 0..15 | b values 16..31 | b+1 values 16..31]
 *               (the 32 stored bytes of the pair, low nibbles then high nibbles)
 *   Q8_0:       [b values 0..31 | b+1 values 0..31]
 * so int32 lane l of a product holds block b's or b+1's partial sum: lanes 4..7 and 12..15 are b+1's
 * for Q4 (mask 0xF0F0), lanes 8..15 for Q8_0 (0xFF00). An odd last block pairs with zeros.
 *
 * Tiles: one activation row by 4 weight rows (the float kernel's qtile_row, same prefetch), each row of
 * x in turn; several rows re-read the weights, so callers use it for one-row products (the batch-1
 * decode step: quant.int8_formats). Threads: orphaned OpenMP worksharing over weight-row groups as in
 * segserve_quant.c (the caller's team does the work; no region of its own).
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

int sg_quant_int8_built(void) { return 1; }

/* The fixed-point form of M activation rows: np = ceil(nb / 2) pairs of blocks per row. */
struct xrows {
    int64_t np;
    int8_t *q;    /* (M, np, 2, 64) q1 then q2 of each pair, in the pair layout above */
    float *dx;    /* (M, np, 16) each lane's block step s / 256 (0 for a missing odd block) */
    int32_t *c0;  /* (M, np, 16) q2 accumulator start: -offset * the lane's sum of 4 (256 q1 + q2) */
    float *xs;    /* (M, 2 np) each rounded block's sum (Q4_1's m term); 0 if missing */
};

/* 32 values of x in fixed point, q1 (16 + 16 in q0, q1) and q2 (r0, r1), under the step it returns:
 * amax / 127 / 256, or 0 for a block of zeros (its values are then 0); *sum is the rounded block's
 * sum. Rounding: to nearest even (the MXCSR default of vcvtps2dq). */
static inline float quantize_block(const float *x, __m128i *q0, __m128i *q1, __m128i *r0, __m128i *r1,
                                   float *sum) {
    __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float s = amax / 127.0f, step = s / 256.0f;
    __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m512 id2 = _mm512_set1_ps(amax > 0.0f ? 256.0f * 127.0f / amax : 0.0f), vs = _mm512_set1_ps(s);
    __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
    /* The remainders x - s q1 (one rounding, in the FMA), in steps of s / 256. */
    __m512 e0 = _mm512_fnmadd_ps(vs, _mm512_cvtepi32_ps(i0), v0), e1 = _mm512_fnmadd_ps(vs, _mm512_cvtepi32_ps(i1), v1);
    __m512i j0 = _mm512_cvtps_epi32(_mm512_mul_ps(e0, id2)), j1 = _mm512_cvtps_epi32(_mm512_mul_ps(e1, id2));
    *q0 = _mm512_cvtepi32_epi8(i0);
    *q1 = _mm512_cvtepi32_epi8(i1);
    *r0 = _mm512_cvtsepi32_epi8(j0); /* saturating: a remainder at a tie can round to 128 */
    *r1 = _mm512_cvtsepi32_epi8(j1);
    __m512i tot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(i0, i1), 8),
                                   _mm512_add_epi32(_mm512_cvtepi8_epi32(*r0), _mm512_cvtepi8_epi32(*r1)));
    *sum = (float)_mm512_reduce_add_epi32(tot) * step;
    return step;
}

static void quantize_row(int wqt, const float *x, int64_t nb, int64_t np, int8_t *q, float *dx, int32_t *c0,
                         float *xs) {
    const int q4 = wqt != WQT_Q8_0;
    const int8_t off = wqt == WQT_Q4_0 ? 8 : wqt == WQT_Q8_0 ? (int8_t)0x80 : 0;
    const __mmask16 second = q4 ? 0xF0F0 : 0xFF00;
    /* Where each 16 values go in the pair: Q4 interleaves the two blocks' halves (see the layout). */
    const int order[4] = {0, q4 ? 2 : 1, q4 ? 1 : 2, 3};
    for (int64_t p = 0; p < np; p++) {
        __m128i v[8] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(),
                        _mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
        float da, db = 0.0f, sa, sb = 0.0f; /* v: q1 of b, b + 1 (0..3), then their q2 (4..7) */
        da = quantize_block(x + 64 * p, &v[0], &v[1], &v[4], &v[5], &sa);
        if (2 * p + 1 < nb) db = quantize_block(x + 64 * p + 32, &v[2], &v[3], &v[6], &v[7], &sb);
        int8_t *dst = q + 128 * p;
        for (int k = 0; k < 4; k++) {
            _mm_storeu_si128((__m128i *)(dst + 16 * k), v[order[k]]);
            _mm_storeu_si128((__m128i *)(dst + 64 + 16 * k), v[4 + order[k]]);
        }
        _mm512_storeu_ps(dx + 16 * p, _mm512_mask_blend_ps(second, _mm512_set1_ps(da), _mm512_set1_ps(db)));
        const __m512i o = _mm512_set1_epi8(off);
        __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), o, _mm512_loadu_si512(dst));
        __m512i s2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), o, _mm512_loadu_si512(dst + 64));
        _mm512_storeu_si512(c0 + 16 * p, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                           _mm512_add_epi32(_mm512_slli_epi32(s1, 8), s2)));
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

/* out[0][j] = dot(x row m, dequant(weight row wr[j])) for j < nt, x in its fixed-point form; inlined
 * with constant wqt and nt so the accumulators live in registers. As segserve_quant.c's qtile_row: each
 * pair's scales converted where they are read (no gathers, slow on Zen 4) and the tile's bytes
 * Q_PF_ROW_GROUPS tiles ahead prefetched line by line in the order they lie, with its hint (that
 * function says why); the activations of a pair loaded once for the tile's rows. */
static inline __attribute__((always_inline)) void qtile_i8_row(int wqt, int nt, const uint8_t *const wr[8],
                                                               int64_t nb, int64_t bb, const struct xrows *xr,
                                                               int64_t m, float out[8][8]) {
    const int64_t np = xr->np;
    const __mmask16 second = wqt == WQT_Q8_0 ? 0xFF00 : 0xF0F0;
    /* The pair's scales convert to [d_b, m_b, d_b+1, m_b+1]: block b's lanes take element 0 (d) or
     * 1 (m), block b + 1's elements 2 or 3. */
    const __m512i pick_d = wqt == WQT_Q8_0 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)
                                           : _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);
    const __m512i pick_m = _mm512_add_epi32(pick_d, _mm512_set1_epi32(1));
    const int8_t *q = xr->q + m * np * 128;
    const float *dx = xr->dx + m * np * 16, *xs = xr->xs + m * 2 * np;
    const int32_t *c0 = xr->c0 + m * np * 16;
    __m512 acc[8];
    for (int j = 0; j < nt; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        const int64_t b = 2 * p;
        const int two = b + 1 < nb;
        const char *ahead = (const char *)wr[0] + Q_PF_ROW_GROUPS * nt * nb * bb + b * nt * bb;
        for (int64_t o = 0; o < 2 * nt * bb; o += 64) _mm_prefetch(ahead + o, Q_PF_HINT);
        const __m512i x1 = _mm512_loadu_si512(q + 128 * p), x2 = _mm512_loadu_si512(q + 128 * p + 64);
        const __m512 xd = _mm512_loadu_ps(dx + 16 * p);
        const __m512i start = wqt == WQT_Q4_1 ? _mm512_setzero_si512() : _mm512_loadu_si512(c0 + 16 * p);
        /* Q4_1's m term: each block's rounded sum spread over its 8 lanes (an exact eighth each). */
        const __m512 xsum = wqt == WQT_Q4_1 ? _mm512_mask_blend_ps(second, _mm512_set1_ps(xs[b] * 0.125f),
                                                                   _mm512_set1_ps(xs[b + 1] * 0.125f))
                                            : _mm512_setzero_ps();
        for (int j = 0; j < nt; j++) {
            const uint8_t *blk = wr[j] + b * bb;
            uint32_t s0, s1 = 0; /* a missing odd block's scales are 0 */
            memcpy(&s0, blk, 4);
            if (two) memcpy(&s1, blk + bb, 4);
            const __m512 sc = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi32(0, 0, (int)s1, (int)s0)));
            const __m512i w = load_pair(wqt, blk, bb, two);
            const __m512i t = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x1), 8),
                _mm512_dpbusd_epi32(start, w, x2));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(_mm512_permutexvar_ps(pick_d, sc), xd),
                                     acc[j]);
            if (wqt == WQT_Q4_1) acc[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick_m, sc), xsum, acc[j]);
        }
    }
    for (int j = 0; j < nt; j++) out[0][j] = _mm512_reduce_add_ps(acc[j]);
}

/* Row m of the product, all N outputs, in tiles of 4 weight rows. */
#define VPASS(WQT)                                                                                         \
    do {                                                                                                   \
        _Pragma("omp for schedule(static) nowait") for (int64_t g = 0; g < groups; g++) {                  \
            const uint8_t *wr[8];                                                                          \
            float out[8][8];                                                                               \
            int64_t n0 = g * 4;                                                                            \
            for (int j = 0; j < 4; j++) wr[j] = wb + (n0 + j < N ? n0 + j : N - 1) * rb;                   \
            qtile_i8_row(WQT, 4, wr, nb, bb, &xr, m, out);                                                 \
            for (int j = 0; j < 4 && n0 + j < N; j++)                                                      \
                epilogue(dt, ydt, accumulate, bias, out[0][j], n0 + j, y, m * ldy + n0 + j);               \
        }                                                                                                  \
        team_sync();                                                                                       \
    } while (0)

size_t sg_quant_i8_scratch_bytes(int64_t M, int64_t K) {
    const size_t np = (size_t)(K / 32 + 1) / 2, nq = (size_t)M * np * 128, nf = (size_t)M * np * 16;
    return nq + 3 * nf * 4 + 64;
}

int sg_quant_matmul_i8(int dt, int ydt, int wqt, int64_t M, int64_t N, int64_t K, const float *xf,
                       int64_t ldxf, const void *w, const void *bias, void *y, int64_t ldy, int accumulate,
                       void *scratch) {
    const int64_t bb = sg_quant_block_bytes(wqt), nb = K / 32, rb = nb * bb, np = (nb + 1) / 2;
    const uint8_t *wb = (const uint8_t *)w;
    if (bb == 0 || M < 1 || N < 1 || K < 32 || K % 32) return V_ERR_SHAPE;
    /* The fixed-point rows in the caller's (shared, 64-byte aligned) scratch: q, dx, c0, xs. */
    char *buf = (char *)scratch;
    size_t nq = (size_t)M * np * 128, nf = (size_t)M * np * 16;
    struct xrows xr = {.np = np, .q = (int8_t *)buf, .dx = (float *)(buf + nq), .c0 = (int32_t *)(buf + nq + nf * 4),
                .xs = (float *)(buf + nq + 2 * nf * 4)};
    /* Rows are independent; the loop's closing barrier publishes them before any tile reads them. */
#pragma omp for schedule(static) nowait
    for (int64_t m = 0; m < M; m++)
        quantize_row(wqt, xf + m * ldxf, nb, np, xr.q + m * np * 128, xr.dx + m * np * 16, xr.c0 + m * np * 16,
                     xr.xs + m * 2 * np);
    team_sync();
    const int64_t groups = (N + 3) / 4;
    for (int64_t m = 0; m < M; m++) {
        if (wqt == WQT_Q8_0) VPASS(WQT_Q8_0);
        else if (wqt == WQT_Q4_0) VPASS(WQT_Q4_0);
        else VPASS(WQT_Q4_1);
    }
    return V_OK;
}

#undef VPASS

#else /* built without AVX-512 VNNI: the integer path is refused, the float one stays */

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
