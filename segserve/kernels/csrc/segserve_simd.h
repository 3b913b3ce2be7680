/* What the segserve C files share: AVX-512 helpers and the one AMX probe.
 *
 * Included by every csrc/*.c; build.py hashes it with them, so an edit here rebuilds the library.
 * Everything is static inline except sg_amx_granted, defined once in segserve_amx.c.
 */
#ifndef SEGSERVE_SIMD_H
#define SEGSERVE_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* The software prefetch hint of the weight streams (the dense register tiles' and the GGUF block kernels'
 * one-row tiles, which prefetch a few tiles ahead): non-temporal where build.py says the CPU is AMD's
 * (SG_STREAM_NTA=1), else into L1. Zen 4: a decode step streams ~95-270 MB of weights once through the
 * 32 MB L3, and NTA kept them from evicting what the Python between steps runs on (batch-1 decode end to
 * end +8-10 %). The AMX Xeon (2026-12-04, 2 threads, fresh processes alternating twice): with NTA the
 * streams waited on each fill (perf: half the block kernel's samples on the instruction after its
 * prefetchnta), T0 took Q4_1 batch-1 decode from 75-81 to 121-128 tok/s and a float32 dense one from
 * 58-60 to 23.5-24 ms a token (8 decodes 73-76 -> 36 ms). */
#if defined(SG_STREAM_NTA) && SG_STREAM_NTA
#define SG_STREAM_HINT _MM_HINT_NTA
#else
#define SG_STREAM_HINT _MM_HINT_T0
#endif

/* 16 bfloat16 values widened to float32 (exact: a bfloat16 is the top half of a float32). */
static inline __m512 sg_bf16x16_to_f32(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* exp(x) for float32 lanes (Cephes expf's range reduction and polynomial; ~1 ulp), inputs clamped below
 * at -87.3 so the result underflows to ~0 rather than misbehaving. */
static inline __m512 sg_exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* 16 float32 lanes rounded to bfloat16 (round to nearest even) and widened back to float32. */
static inline __m512 sg_bf16_round16(__m512 v) {
    __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* Sixteen float32 lanes rounded to bfloat16 exactly as f32_to_bf16 rounds (nearest even, NaN kept
 * quiet, subnormals kept), and widened back. Not vcvtneps2bf16: that flushes subnormals, and RoPE must
 * equal the eager rotation bit for bit (segserve_cpu.c's sg_rope, segserve_amx.c's RoPE epilogue). */
static inline __m512 sg_bf16_round16_exact(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* 16 float32 lanes that hold bfloat16 values stored as bfloat16 (truncation is exact for them). */
static inline void sg_bf16_store16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

/* Starting row of 16-row tile i of M rows (the last one ends at row M, overlapping the one before when
 * M is not a multiple of 16) and, in *skip, how many of its rows an earlier tile already wrote. */
static inline int64_t sg_row_tile_start(int64_t i, int64_t M, int *skip) {
    int64_t m0 = 16 * i;
    *skip = 0;
    if (m0 + 16 > M && M >= 16) {
        *skip = (int)(m0 - (M - 16));
        m0 = M - 16;
    }
    return m0;
}

/* 1 when this process may run AMX-BF16 tiles (CPUID, XCR0 and Linux's tile permission, requested on the
 * first call; the grant is per process), else 0. Probes once; later calls return the answer. */
__attribute__((visibility("hidden"))) int sg_amx_granted(void);

#endif
