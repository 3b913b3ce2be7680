/* What the two GGUF-block kernel files (segserve_quant.c: float activations; segserve_quant_vnni.c:
 * int8 activations) share: scalar dtype helpers, the scale gather and the output epilogue. Static inline,
 * so each file keeps its own copy and nothing is exported. */
#ifndef SEGSERVE_QUANT_INL_H
#define SEGSERVE_QUANT_INL_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "segserve_quant.h"
#include "segserve_simd.h"

enum { Q_DT_F32 = 0, Q_DT_BF16 = 1 };

/* How many tiles ahead the one-row kernels (qtile_row, qtile_i8_row) prefetch their weights. */
#ifndef Q_PF_ROW_GROUPS
#define Q_PF_ROW_GROUPS 4
#endif
/* Their hint: the weight streams' (segserve_simd.h). */
#ifndef Q_PF_HINT
#define Q_PF_HINT SG_STREAM_HINT
#endif

static inline float half_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

static inline float q_bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even (NaN kept quiet), as PyTorch's float -> bfloat16. */
static inline uint16_t q_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float q_load(const void *p, int64_t i, int dt) {
    return dt == Q_DT_F32 ? ((const float *)p)[i] : q_bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void q_store(void *p, int64_t i, float v, int dt) {
    if (dt == Q_DT_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = q_f32_to_bf16(v);
}

static inline float q_round(float v, int dt) { return dt == Q_DT_F32 ? v : q_bf16_to_f32(q_f32_to_bf16(v)); }

/* Scales of blocks b0 .. b0 + cb - 1 (cb <= SCALE_CHUNK) of one row as float32 (exact), d into sd and,
 * for Q4_1, m into sm: 16 blocks per gather (their first 4 bytes: d, then m or the first values), so
 * the tile loop broadcasts each from memory (a load, no shuffle) instead of converting it there. */
#define SCALE_CHUNK 32
static inline __attribute__((always_inline)) void load_scales(int wqt, const uint8_t *row, int64_t bb, int64_t b0,
                                                              int64_t cb, float *sd, float *sm) {
    const __m512i offs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)bb));
    for (int64_t b = 0; b < cb; b += 16) {
        int64_t n = cb - b < 16 ? cb - b : 16;
        __mmask16 k = (__mmask16)((1u << n) - 1u);
        __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, offs, row + (b0 + b) * bb, 1);
        _mm512_mask_storeu_ps(sd + b, k, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
        if (wqt == WQT_Q4_1)
            _mm512_mask_storeu_ps(sm + b, k, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))));
    }
}

/* bias, rounding to dt, then the residual add, as sg_linear's epilogue. */
static inline void epilogue(int dt, int ydt, int accumulate, const void *bias, float v, int64_t n, void *y,
                            int64_t at) {
    if (bias) v += q_load(bias, n, dt);
    v = q_round(v, dt);
    if (accumulate) v = q_round(q_load(y, at, ydt) + v, ydt);
    q_store(y, at, v, ydt);
}

/* The row-tile dispatch both block kernels share: rows per tile mt (1..8, as the caller split M) picks
 * how many weight rows a tile takes (4 for 1-4 rows, 2 for 5-8: the accumulators a tile keeps
 * in registers), sets `groups` (tiles over N) and runs PASS(WQT, NT, MT) over them. */
#define Q_PASS_FOR_ROWS(PASS, WQT)                                                                         \
    switch (mt) {                                                                                          \
    case 1: groups = (N + 3) / 4; PASS(WQT, 4, 1); break;                                                  \
    case 2: groups = (N + 3) / 4; PASS(WQT, 4, 2); break;                                                  \
    case 3: groups = (N + 3) / 4; PASS(WQT, 4, 3); break;                                                  \
    case 4: groups = (N + 3) / 4; PASS(WQT, 4, 4); break;                                                  \
    case 5: groups = (N + 1) / 2; PASS(WQT, 2, 5); break;                                                  \
    case 6: groups = (N + 1) / 2; PASS(WQT, 2, 6); break;                                                  \
    case 7: groups = (N + 1) / 2; PASS(WQT, 2, 7); break;                                                  \
    default: groups = (N + 1) / 2; PASS(WQT, 2, 8); break;                                                 \
    }

#endif
