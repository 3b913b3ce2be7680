/* segserve chunk (prefill) attention through the paged KV cache: bfloat16 caches, the two products on
 * AMX tiles or, on CPUs without AMX, in AVX-512 BF16 registers (VDPBF16PS); float32 caches, the two
 * products in AVX-512F FMA registers (see "float32" below).
 *
 *   sg_chunk_attention      the attention of every chunk (query length >= 1) of a step, in one call.
 *
 * A chunk of Tq tokens at positions prior .. prior + Tq - 1 attends to all prior cached tokens and
 * causally to its own, whose K/V the caller has already written to the cache (write_kv): so the kernel
 * sees one key range 0 .. prior + Tq - 1 read through the block table, the causal mask being
 * "key position <= query position". It walks that range in segments of `seg` tokens (the design's
 * kv_segment_size) with a flash-style online softmax (float32 running max and sum per query row;
 * Dao et al., FlashAttention, 2022), never gathering a copy of the cache.
 *
 * Work items: (chunk, KV head, query tile of up to CA_TQ tokens), OpenMP dynamic schedule, the costliest
 * (last query tiles) first. An item's rows are its G = Hq / Hkv query heads times its tokens, cut into
 * 16-row M tiles (one head, 16 consecutive tokens). Per key block (CA_KB keys of a segment), the item
 * repacks the K and V of its KV head into per-thread buffers in the layouts AMX's B operand reads (VNNI
 * pairs), once, then every M tile of the item uses them (G * CA_TQ / 16 tiles share one repack):
 *
 *   S = Q K^T   Q tile [16 rows x 32 dims] (A) times K packed [16 dim pairs x 16 keys x 2] (B), 64
 *               keys (4 C tiles) at a time; scores to a float32 buffer [16 x keys].
 *   softmax     per row, in AVX-512: the segment's max m', P = 2^(S * scale * log2 e - m) with
 *               m = m_old unless m' > m_old + 8, else m' (masked keys: P = 0), rounded to bfloat16,
 *               the sum of P in float32, the running output and sum rescaled by 2^(m_old - m). After
 *               a tile's first block, P is computed with m as it is in one pass and only rows with
 *               a partial sum above 240 take m' (rows whose m moves, rare, are done again), with the
 *               same bits as the two passes.
 *   O += P V    P tile [16 rows x 32 keys] (A) times V packed [16 key pairs x 16 dims x 2] (B), the
 *               running output [16 x D] float32 loaded into C tiles and stored back.
 *
 * Numerics: Q K^T exact products summed in float32; P rounded to bfloat16 for the P V product (as
 * PyTorch's CPU flash attention does for bfloat16), sums in float32; exp2 by a degree-4 polynomial
 * on [0, 1) (relative error ~3e-6, far below bfloat16's 4e-3). Output rounded to bfloat16 (nearest even).
 *
 * Without AMX (args.isa = CA_ISA_AVX512_BF16) the same walk, packing and softmax run and the two
 * products are VDPBF16PS register blocks reading the same packed K and V (see ca_dp_scores below).
 *
 * The AMX code is compiled for its target only (function attributes), so this file builds and loads
 * on CPUs without AMX; there sg_amx_granted() (segserve_simd.h) is 0 and sg_chunk_attention refuses
 * isa CA_ISA_AMX with ERR_NO_AMX. Tile configuration is per thread: every OpenMP thread loads it before its items and
 * releases the tiles after, so other code sharing the threads (another AMX kernel) is unaffected.
 *
 * float32 (args.dt = CA_DT_F32, isa CA_ISA_AVX512F): q, out and the cache float32, nothing rounded to
 * bfloat16. The same walk, work items, causal mask and online softmax (P written as float32); what
 * differs is the layout of the packed blocks and the products (see ca_f32_scores below):
 *
 *   S = Q K^T   K packed transposed, per group of 16 keys [D dims][16 keys], so a vector is one dim of
 *               16 keys: S[r, 16 keys] += Q[r, d] (broadcast) * K[d, 16 keys], over d in order, in
 *               register blocks of 8 rows x 48 keys (24 accumulators).
 *   O += P V    V packed as its rows [keys][D]: O[r, 16 dims] += P[r, k] (broadcast) * V[k, 16 dims],
 *               over the keys in order, in register blocks of 8 rows x 32 dims (16 accumulators).
 *
 * Numerics: every product an FMA (exact product, float32 sum); exp2 by a degree-6 polynomial on [0, 1)
 * (~1 ulp, ca_exp2_f32) instead of the bfloat16 path's degree-4 one (3e-6 relative is 25-50 ulp
 * here); the output o / l by one division. Key blocks of CA_KB keys as for bfloat16 (packed K and V of
 * 32 KiB each for D = 64: past L1 with the S and P buffers, yet 64-key blocks, which fit, measured 1-3 %
 * slower at 1 and 2 threads, 32-key ones ~5 %: the products stream K and V from L2 well enough and a
 * block's fixed costs halve). A row's sums run in the same order whatever its register block or work
 * item, so the bitwise properties of the bfloat16 path hold here too.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "segserve_simd.h"

enum { CA_DT_BF16 = 1, CA_DT_F32 = 2 };
/* What computes Q K^T and P V (sg_chunk_attention_args.isa): AMX or VDPBF16PS for bfloat16, AVX-512F
 * FMAs for float32. */
enum { CA_ISA_AMX = 1, CA_ISA_AVX512_BF16 = 2, CA_ISA_AVX512F = 3 };
enum { CA_OK = 0, CA_ERR_SHAPE = -1, CA_ERR_NOMEM = -2, CA_ERR_ROW = -3, CA_ERR_BLOCK = -4,
       CA_ERR_LAYOUT = -5, CA_ERR_NO_AMX = -6, CA_ERR_NO_ISA = -7 };

#define CA_MAX_D 128 /* head dim, a multiple of 32 (of 16 for float32) (chunk_attention.MAX_HEAD_DIM) */
#define CA_MAX_G 16  /* query heads per KV head (chunk_attention.MAX_QUERY_HEADS_PER_KV_HEAD) */
/* Query tokens per work item, the most (halved for small steps): every item packs each K/V block it
 * walks, for its G * CA_TQ / 16 M tiles; 256 rather than 128 halves that per score (one 4,096-token
 * chunk, 1 and 2 threads: ~8-13 % less time, load 5-6) and leaves 48 items per layer to balance. */
#define CA_TQ 256

/* CA_VEC: the AVX-512 code both paths share (packing, softmax, the walk) and the vdpbf16ps products;
 * CA_TARGET: the AMX tile code, a superset (so it may inline CA_VEC helpers). */
#define CA_VEC __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define CA_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

typedef struct {
    int64_t size;               /* sizeof(sg_chunk_attention_args) */
    int32_t dt;                 /* dtype of q, out and the cache: CA_DT_BF16 (1) or CA_DT_F32 (2) */
    int32_t isa;                /* bfloat16: CA_ISA_AMX or CA_ISA_AVX512_BF16; float32: CA_ISA_AVX512F */
    int64_t n;                  /* chunks */
    int64_t Hq;                 /* query heads; head h*G + g uses KV head h, G = Hq / Hkv <= CA_MAX_G */
    int64_t Hkv;                /* KV heads */
    int64_t D;                  /* head dim up to CA_MAX_D, a multiple of 32 (float32: of 16) */
    const void *q;              /* (T, >= Hq * D) rows, each contiguous (RoPE applied) */
    int64_t ldq;                /* row stride of q, elements */
    void *out;                  /* (T, Hq, D) contiguous */
    int64_t T;                  /* rows of q and out */
    const int64_t *starts;      /* (n,) first q/out row of each chunk */
    const int64_t *qlens;       /* (n,) its query tokens, >= 1; rows starts[i] .. starts[i] + qlens[i] - 1 */
    const int64_t *priors;      /* (n,) tokens cached before it (its own K/V follow them in the cache) */
    const int64_t *reqs;        /* (n,) its block-table row */
    const void *cache;          /* [2, num_blocks, block_size, Hkv, D] contiguous */
    int64_t num_blocks;         /* blocks of the cache (block 0 is the null block) */
    int64_t block_size;         /* tokens per block */
    const int32_t *block_table; /* (B, ld_bt) contiguous block ids */
    int64_t B;                  /* rows of the block table */
    int64_t ld_bt;              /* columns of the block table */
    int64_t seg;                /* tokens per KV segment, >= 1 */
    float scale;                /* softmax scale */
} sg_chunk_attention_args;

/* ---- AMX availability ------------------------------------------------------------------------- */

typedef struct ca_tilecfg {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ca_tilecfg;

/* Tiles 0-3: C (float32 16 x 16); 4: A (16 rows x 32 bfloat16); 5-7: B (16 rows x 32 bfloat16). All
 * 16 rows of 64 bytes. */
CA_TARGET static void ca_tile_config(void) {
    ca_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* ---- packing ------------------------------------------------------------------------------------ */

/* Transpose a 16 x 16 matrix of 32-bit lanes in place (r[i] is row i). */
CA_VEC static inline void ca_transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

static const float ca_zero_row[CA_MAX_D]; /* a zero row of either dtype */

/* Cache rows (K or V of KV head h; es bytes an element) of positions p0 .. p0 + count - 1 of a request;
 * positions >= end point at a zero row (the padding keys of a segment: their scores are masked, their
 * values 0). The block and offset advance with the position: one 64-bit division per call, not one per
 * row. */
static inline void ca_rows(const void **rows, int count, int64_t p0, int64_t end, const void *base,
                           int64_t es, const int32_t *bt, int64_t block_size, int64_t Hkv, int64_t h,
                           int64_t D) {
    int64_t b = p0 / block_size, off = p0 - b * block_size;
    for (int i = 0; i < count; i++) {
        rows[i] = p0 + i < end ? (const char *)base + (((int64_t)bt[b] * block_size + off) * Hkv + h) * D * es
                               : (const void *)ca_zero_row;
        if (++off == block_size) off = 0, b++;
    }
}

/* K of positions s0 .. s0 + nk - 1 (nk a multiple of 32; those >= end are zero) as B tiles of S = Q K^T:
 * tile (key group j of 16, dim step ks of 32) at kp + (j * D/32 + ks) * 512, row r = dims 2r, 2r+1 of
 * ks's 32, each of the 16 keys' pair in turn: a 16 x 16 transpose of 32-bit pairs. */
CA_VEC static void ca_pack_k(uint16_t *kp, int64_t s0, int64_t nk, int64_t end, const uint16_t *kc,
                                const int32_t *bt, int64_t block_size, int64_t Hkv, int64_t h, int64_t D) {
    const int64_t KS = D / 32;
    const void *rows[16];
    for (int64_t j = 0; j < nk / 16; j++) {
        ca_rows(rows, 16, s0 + 16 * j, end, kc, 2, bt, block_size, Hkv, h, D);
        for (int64_t ks = 0; ks < KS; ks++) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_castsi512_ps(_mm512_loadu_si512((const uint16_t *)rows[i] + 32 * ks));
            ca_transpose16(r);
            uint16_t *dst = kp + (j * KS + ks) * 512;
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + 32 * i, _mm512_castps_si512(r[i]));
        }
    }
}

/* V of positions s0 .. s0 + nk - 1 as B tiles of O = P V: tile (key group kk of 32, dim tile dt of 16)
 * at vp + (kk * D/16 + dt) * 512, row r = keys 2r, 2r+1 interleaved over the tile's 16 dims. */
CA_VEC static void ca_pack_v(uint16_t *vp, int64_t s0, int64_t nk, int64_t end, const uint16_t *vc,
                                const int32_t *bt, int64_t block_size, int64_t Hkv, int64_t h, int64_t D) {
    const int64_t DT = D / 16;
    uint16_t lo_idx[32], hi_idx[32];
    for (int i = 0; i < 16; i++) {
        lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i;
        hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
    }
    const __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_loadu_si512(hi_idx);
    const void *rows[32];
    for (int64_t kk = 0; kk < nk / 32; kk++) {
        ca_rows(rows, 32, s0 + 32 * kk, end, vc, 2, bt, block_size, Hkv, h, D);
        uint16_t *dst = vp + kk * DT * 512;
        for (int r = 0; r < 16; r++) {
            const uint16_t *r0 = (const uint16_t *)rows[2 * r], *r1 = (const uint16_t *)rows[2 * r + 1];
            for (int64_t c = 0; c < D / 32; c++) {
                __m512i a = _mm512_loadu_si512(r0 + 32 * c), b = _mm512_loadu_si512(r1 + 32 * c);
                _mm512_storeu_si512(dst + (2 * c) * 512 + 32 * r, _mm512_permutex2var_epi16(a, lo, b));
                _mm512_storeu_si512(dst + (2 * c + 1) * 512 + 32 * r, _mm512_permutex2var_epi16(a, hi, b));
            }
        }
    }
}

/* float32: K of positions s0 .. s0 + nk - 1 (nk a multiple of 16; those >= end are zero) transposed per
 * group of 16 keys: group j at kp + j * 16 * D, row d = dim d of the group's 16 keys (16 x 16 transposes
 * of the cache rows' 16-dim pieces). */
CA_VEC static void ca_pack_k_f32(float *kp, int64_t s0, int64_t nk, int64_t end, const float *kc,
                                 const int32_t *bt, int64_t block_size, int64_t Hkv, int64_t h, int64_t D) {
    const void *rows[16];
    for (int64_t j = 0; j < nk / 16; j++) {
        ca_rows(rows, 16, s0 + 16 * j, end, kc, 4, bt, block_size, Hkv, h, D);
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps((const float *)rows[i] + d0);
            ca_transpose16(r);
            float *dst = kp + (j * D + d0) * 16;
            for (int i = 0; i < 16; i++) _mm512_store_ps(dst + 16 * i, r[i]);
        }
    }
}

/* float32: V of positions s0 .. s0 + nk - 1 as its rows, contiguous: key k at vp + k * D (the rows of
 * the cache are Hkv * D apart and their blocks scattered; packed, a key block's rows lie in one run). */
CA_VEC static void ca_pack_v_f32(float *vp, int64_t s0, int64_t nk, int64_t end, const float *vc,
                                 const int32_t *bt, int64_t block_size, int64_t Hkv, int64_t h, int64_t D) {
    const void *rows[16];
    for (int64_t j = 0; j < nk / 16; j++) {
        ca_rows(rows, 16, s0 + 16 * j, end, vc, 4, bt, block_size, Hkv, h, D);
        for (int i = 0; i < 16; i++)
            for (int64_t d = 0; d < D; d += 16)
                _mm512_store_ps(vp + (16 * j + i) * D + d, _mm512_loadu_ps((const float *)rows[i] + d));
    }
}

/* ---- one M tile over one segment ---------------------------------------------------------------- */

/* 2^x for float32 lanes (x <= CA_SLACK here): 2^floor(x) * p(x - floor(x)), p a degree-4 polynomial
 * fitted to 2^f on [0, 1) for the least relative error with p(0) = 1 (2.96e-6 evaluated in float32, far
 * below bfloat16's 2^-9; integral x are exact); very negative x underflow to 0 in the scaling.
 * VREDUCEPS gives x - floor(x) in one instruction and VSCALEFPS scales by 2^floor(x) itself, so the
 * rounding (VRNDSCALEPS, two micro-ops) and the subtraction of the centred form [-1/2, 1/2] (relative
 * error 3.12e-6, this kernel's exp before 2026-12-02) go: the exp pass of a 16 x 128 block takes ~25 %
 * less time. A cheaper degree-3 form (8.6e-5) was tried before: its mean error against float32 was the
 * same, but it moved enough bfloat16 roundings of P to take, through 30 layers, one greedy logprob of
 * the bfloat16 parity test past its 0.25 (0.254); so any exp here must be at least as accurate as this. */
CA_VEC static inline __m512 ca_exp2(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); /* in [0, 1) */
    __m512 p = _mm512_set1_ps(1.342651900e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.224274099e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.412800789e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930448413e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, x);
}

/* 2^x for float32 lanes to ~1 ulp (x <= CA_SLACK here; the float32 path's exp): 2^floor(x) * p(f),
 * f = x - floor(x) in [0, 1), p a degree-6 polynomial with p(0) = 1 fitted to 2^f for the least relative
 * error (2.0e-9 in exact arithmetic; evaluated in float32 by Horner's FMAs, at most ~1.06 ulp of
 * 2^f over [0, 1), mean 0.27: tests/kernels/test_chunk_attention_f32.py bounds it). Degree 5 fits to
 * 8e-8, ~2.4 ulp evaluated: past the 1-2 ulp of a float32 library exp, which float32 SDPA uses; one more
 * FMA per 16 probabilities is ~1 % of a tile's FMAs at D = 64. Very negative x underflow to 0 in
 * VSCALEFPS, as ca_exp2's. */
CA_VEC static inline __m512 ca_exp2_f32(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(2.1612927957903594e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.2467842316254973e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675451554358006e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5485282093286514e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402293086051941e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470632553101e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, x);
}

/* The kernel's exp2 on n floats, the bfloat16 path's (f32 = 0) or the float32 path's (f32 = 1), for tests
 * that bound its error (n a multiple of 16 is not needed). */
CA_VEC void sg_chunk_attention_exp2(const float *x, float *y, int64_t n, int32_t f32) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        _mm512_mask_storeu_ps(y + i, k, f32 ? ca_exp2_f32(v) : ca_exp2(v));
    }
}

/* Keys per block: the walk goes segment by segment, each in blocks of CA_KB keys that one M tile
 * takes through scores, softmax and P V while they are in L1 (a block's packed K and V are 16 KiB
 * each for D = 64). The block only orders the float32 sums (the online softmax is exact for any split). */
#define CA_KB 128
/* Row strides of the score and probability buffers, padded past a power of two so the 16 rows of a
 * tile do not share a handful of L1 sets. */
#define CA_LDS (CA_KB + 16)
#define CA_LDP (CA_KB + 32)
/* The running max before any key: finite, so the first rescale 2^(CA_M0 - m) is 0, not NaN. */
#define CA_M0 (-1e30f)
#define CA_SLACK 8.0f /* log2 units (see ca_softmax) */

typedef struct ca_seg {
    uint16_t *kp, *vp; /* packed K, V of the key block */
    float *s;          /* [16 x CA_LDS] scores of the M tile at hand */
    uint16_t *p;       /* [16 x CA_LDP] its probabilities */
    float *kf, *vf, *pf; /* the same three buffers as float32 (the float32 path's) */
} ca_seg;

/* S = Q K^T for keys 0 .. nk - 1 of the block (nk a multiple of 32) into sg->s. Q is the M tile
 * [16 x D] (row stride D). For D <= 64 its (one or two) A tiles stay loaded across the keys. */
CA_TARGET static void ca_scores(const uint16_t *qt, int64_t D, int64_t nk, const ca_seg *sg) {
    const int64_t KS = D / 32, kstep = KS * 512; /* from one key group's tiles to the next */
    const int64_t lds = CA_LDS * 4;
    if (KS <= 2) {
        _tile_loadd(4, qt, D * 2);
        if (KS == 2) _tile_loadd(5, qt + 32, D * 2);
    }
    for (int64_t j0 = 0; j0 < nk / 16; j0 += 4) {
        const uint16_t *k0 = sg->kp + j0 * kstep;
        float *s = sg->s + j0 * 16;
        const int four = nk / 16 - j0 >= 4; /* else the last 32 keys */
        _tile_zero(0); _tile_zero(1);
        if (four) { _tile_zero(2); _tile_zero(3); }
        if (KS <= 2) {
            _tile_loadd(6, k0, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, k0 + kstep, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (four) {
                _tile_loadd(6, k0 + 2 * kstep, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_loadd(7, k0 + 3 * kstep, 64);
                _tile_dpbf16ps(3, 4, 7);
            }
            if (KS == 2) {
                _tile_loadd(6, k0 + 512, 64);
                _tile_dpbf16ps(0, 5, 6);
                _tile_loadd(7, k0 + kstep + 512, 64);
                _tile_dpbf16ps(1, 5, 7);
                if (four) {
                    _tile_loadd(6, k0 + 2 * kstep + 512, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_loadd(7, k0 + 3 * kstep + 512, 64);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
        } else {
            for (int64_t ks = 0; ks < KS; ks++) {
                _tile_loadd(4, qt + 32 * ks, D * 2);
                _tile_loadd(6, k0 + ks * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, k0 + kstep + ks * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                if (four) {
                    _tile_loadd(5, k0 + 2 * kstep + ks * 512, 64);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(6, k0 + 3 * kstep + ks * 512, 64);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
        }
        _tile_stored(0, s, lds); _tile_stored(1, s + 16, lds);
        if (four) { _tile_stored(2, s + 32, lds); _tile_stored(3, s + 48, lds); }
    }
}

static inline __mmask16 ca_lanes(int64_t n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* The softmax below serves both dtypes: `f32` (a constant at every instantiation, the functions inlined
 * into ca_softmax_bf16 and ca_softmax_f32) picks the exp and the type of P. */
#define CA_INLINE static inline __attribute__((always_inline))

/* 2^x by the exp of the path: ca_exp2_f32 for float32, ca_exp2 for bfloat16. */
CA_VEC CA_INLINE __m512 ca_exp2_of(__m512 x, const int f32) { return f32 ? ca_exp2_f32(x) : ca_exp2(x); }

/* Element i of a P row (bfloat16 or float32) at row start p. */
CA_INLINE void *ca_p_at(void *p, int64_t i, const int f32) {
    return f32 ? (void *)((float *)p + i) : (void *)((uint16_t *)p + i);
}

/* 32 probabilities 2^(s * c - m) (lanes at or past n: 0) to p, bfloat16 or (f32) float32; returns their
 * float32 sum. */
CA_VEC CA_INLINE __m512 ca_exp32(const float *s, void *p, __m512 cv, __m512 mv, int64_t n, __m512 sum,
                                 const int f32) {
    __m512 e0 = ca_exp2_of(_mm512_fmsub_ps(_mm512_loadu_ps(s), cv, mv), f32);
    __m512 e1 = ca_exp2_of(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16), cv, mv), f32);
    if (n < 32) {
        e0 = _mm512_maskz_mov_ps(ca_lanes(n), e0);
        e1 = _mm512_maskz_mov_ps(ca_lanes(n - 16), e1);
    }
    if (f32) {
        _mm512_storeu_ps((float *)p, e0);
        _mm512_storeu_ps((float *)p + 16, e1);
    } else {
        _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)); /* e0 in the low half */
    }
    return _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
}

/* l = l * a + the sums of P of the 16 rows, acc[r] holding row r's 16 partial sums (reduced together
 * by a transpose, then lane-wise). */
CA_VEC static inline void ca_add_sums(__m512 acc[16], float *l, __m512 a) {
    ca_transpose16(acc);
    __m512 sum = acc[0];
    for (int r = 1; r < 16; r++) sum = _mm512_add_ps(sum, acc[r]);
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), a, sum));
}

/* Online softmax of the 16 rows: row r sees keys 0 .. vis[r] - 1 (>= 0) of nk. Writes P (bfloat16 to
 * sg->p, or float32 to sg->pf; 0 past vis), updates m (running max of S * c, c = scale * log2 e; CA_M0
 * before any key), l
 * (running sum, of the float32 P) and returns each row's rescale factor of the running output in alpha.
 * The rows' maxima and sums are reduced together (a 16 x 16 transpose, then lane-wise), not row by row:
 * sixteen horizontal reductions and scalar exps per block would be a chain of latencies. */
CA_VEC CA_INLINE __mmask16 ca_softmax_2pass(const int64_t vis[16], int64_t nk, float c, const ca_seg *sg,
                                            float *m, float *l, float alpha[16], int all, const int f32) {
    const __m512 cv = _mm512_set1_ps(c);
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_set1_ps(-INFINITY);
    if (all) { /* no masks, and the 16 rows' maxima as 16 chains at once */
        for (int64_t k = 0; k < nk; k += 16)
            for (int r = 0; r < 16; r++) acc[r] = _mm512_max_ps(acc[r], _mm512_loadu_ps(sg->s + r * CA_LDS + k));
    } else {
        for (int r = 0; r < 16; r++) {
            const float *s = sg->s + r * CA_LDS;
            for (int64_t k = 0; k < vis[r]; k += 16)
                acc[r] = _mm512_mask_max_ps(acc[r], ca_lanes(vis[r] - k), acc[r], _mm512_loadu_ps(s + k));
        }
    }
    ca_transpose16(acc);
    __m512 mx = acc[0];
    for (int r = 1; r < 16; r++) mx = _mm512_max_ps(mx, acc[r]);
    /* The reference max moves only when a score exceeds it by more than CA_SLACK (FlashAttention-3's
     * conditional rescaling): P <= 2^CA_SLACK then, harmless in float32 and bfloat16, and most blocks
     * leave the running output as it is (alpha = 1 exactly) instead of rescaling it in memory. */
    const __m512 m_old = _mm512_loadu_ps(m), seen = _mm512_mul_ps(mx, cv);
    const __mmask16 moves = _mm512_cmp_ps_mask(seen, _mm512_add_ps(m_old, _mm512_set1_ps(CA_SLACK)), _CMP_GT_OQ);
    const __m512 m_new = _mm512_mask_mov_ps(m_old, moves, seen);
    const __m512 a = ca_exp2_of(_mm512_sub_ps(m_old, m_new), f32); /* 1 where it stays, 0 from CA_M0 */
    _mm512_storeu_ps(m, m_new);
    _mm512_storeu_ps(alpha, a);
    for (int r = 0; r < 16; r++) {
        const float *s = sg->s + r * CA_LDS;
        void *p = f32 ? (void *)(sg->pf + r * CA_LDP) : (void *)(sg->p + r * CA_LDP);
        const __m512 mv = _mm512_set1_ps(m[r]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = 0; k < nk; k += 32)
            sum = ca_exp32(s + k, ca_p_at(p, k, f32), cv, mv, vis[r] - k, sum, f32);
        acc[r] = sum;
    }
    ca_add_sums(acc, l, a);
    return moves;
}

/* ca_softmax_2pass's result, bit for bit, in one pass over the scores when every row sees all nk keys
 * and the running max is set (not the tile's first block): P is computed with the running max as it
 * is; a row whose maximum moves the running max (rare after the first block: it takes a score CA_SLACK
 * above it) is done again with the new one. Saves the max pass (a load and a max per 16 scores) and its
 * transpose. The row's maximum is not taken along either (two of the loop's ~20 vector micro-ops per 32
 * scores, on the two ports that bound it): a score that moves the max has P = 2^x with x = s * c - m
 * above CA_SLACK less a rounding, so P > CA_MOVE_P, and every lane of the row's partial sums is at least
 * each P added into it; only a row with a lane sum above CA_MOVE_P takes its maximum and the exact test
 * (mostly to find it does not move). Needs c > 0: then the largest fl(s * c) is fl(max(s) * c), so the
 * test on the row's maximum is ca_softmax_2pass's. */
#define CA_MOVE_P 240.0f /* 2^(CA_SLACK - 0.09): below any P of a score that moves the max */
CA_VEC CA_INLINE __mmask16 ca_softmax_1pass(int64_t nk, float c, const ca_seg *sg, float *m, float *l,
                                            float alpha[16], const int f32) {
    const __m512 cv = _mm512_set1_ps(c), move_p = _mm512_set1_ps(CA_MOVE_P);
    const __m512 m_old = _mm512_loadu_ps(m);
    float limit[16];
    _mm512_storeu_ps(limit, _mm512_add_ps(m_old, _mm512_set1_ps(CA_SLACK)));
    __m512 acc[16];
    __mmask16 moves = 0;
    for (int r = 0; r < 16; r++) {
        const float *s = sg->s + r * CA_LDS;
        void *p = f32 ? (void *)(sg->pf + r * CA_LDP) : (void *)(sg->p + r * CA_LDP);
        const __m512 mv = _mm512_set1_ps(m[r]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = 0; k < nk; k += 32) sum = ca_exp32(s + k, ca_p_at(p, k, f32), cv, mv, 32, sum, f32);
        acc[r] = sum;
        if (!_mm512_cmp_ps_mask(sum, move_p, _CMP_GT_OQ)) continue;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t k = 0; k < nk; k += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + k));
        if (_mm512_cmp_ps_mask(_mm512_mul_ps(mx, cv), _mm512_set1_ps(limit[r]), _CMP_GT_OQ)) {
            moves |= (__mmask16)(1u << r);
            m[r] = _mm512_reduce_max_ps(mx) * c;
            const __m512 mn = _mm512_set1_ps(m[r]);
            sum = _mm512_setzero_ps();
            for (int64_t k = 0; k < nk; k += 32)
                sum = ca_exp32(s + k, ca_p_at(p, k, f32), cv, mn, 32, sum, f32);
            acc[r] = sum;
        }
    }
    const __m512 a = ca_exp2_of(_mm512_sub_ps(m_old, _mm512_loadu_ps(m)), f32);
    _mm512_storeu_ps(alpha, a);
    ca_add_sums(acc, l, a);
    return moves;
}

/* The online softmax of one M tile over one key block (ca_softmax_2pass's contract); `first`: the
 * tile's first block (its running max not set yet). */
CA_VEC CA_INLINE __mmask16 ca_softmax(const int64_t vis[16], int64_t nk, float c, const ca_seg *sg, float *m,
                                      float *l, float alpha[16], int first, const int f32) {
    int all = 1; /* every row sees all nk keys */
    for (int r = 0; r < 16; r++) all &= vis[r] == nk;
    if (all && !first && c > 0.0f) return ca_softmax_1pass(nk, c, sg, m, l, alpha, f32);
    return ca_softmax_2pass(vis, nk, c, sg, m, l, alpha, all, f32);
}

/* ca_softmax for bfloat16 P (sg->p, ca_exp2) and for float32 P (sg->pf, ca_exp2_f32). */
CA_VEC static __mmask16 ca_softmax_bf16(const int64_t vis[16], int64_t nk, float c, const ca_seg *sg,
                                        float *m, float *l, float alpha[16], int first) {
    return ca_softmax(vis, nk, c, sg, m, l, alpha, first, 0);
}
CA_VEC static __mmask16 ca_softmax_f32(const int64_t vis[16], int64_t nk, float c, const ca_seg *sg,
                                       float *m, float *l, float alpha[16], int first) {
    return ca_softmax(vis, nk, c, sg, m, l, alpha, first, 1);
}

/* One key group's P V: P (32 keys of the 16 rows) into tile A, then the 2 or 4 dim tiles' products
 * into C tiles 0-3, V through tiles 6 and 7 (tile numbers must be constants, hence a macro). */
#define CA_PV_GROUP(A)                                                                               \
    do {                                                                                             \
        _tile_loadd(A, sg->p + 32 * kk, ldp);                                                        \
        _tile_loadd(6, v, 64);                                                                       \
        _tile_dpbf16ps(0, A, 6);                                                                     \
        _tile_loadd(7, v + 512, 64);                                                                 \
        _tile_dpbf16ps(1, A, 7);                                                                     \
        if (four) {                                                                                  \
            _tile_loadd(6, v + 1024, 64);                                                            \
            _tile_dpbf16ps(2, A, 6);                                                                 \
            _tile_loadd(7, v + 1536, 64);                                                            \
            _tile_dpbf16ps(3, A, 7);                                                                 \
        }                                                                                            \
    } while (0)

/* o [16 x D] (float32, row stride D) *= alpha, row by row; only the rows in `moves` have alpha != 1. */
CA_VEC static void ca_rescale(float *o, const float alpha[16], __mmask16 moves, int64_t D) {
    for (int r = 0; moves && r < 16; r++) {
        if (!(moves >> r & 1)) continue;
        const __m512 av = _mm512_set1_ps(alpha[r]);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), av));
    }
}

/* o [16 x D] (float32, row stride D) = o * alpha + P V over keys 0 .. nk - 1; only the rows in
 * `moves` have alpha != 1. */
CA_TARGET static void ca_pv(float *o, const float alpha[16], __mmask16 moves, int64_t D, int64_t nk,
                            const ca_seg *sg) {
    const int64_t DT = D / 16;
    ca_rescale(o, alpha, moves, D);
    const int64_t ldo = D * 4, ldp = CA_LDP * 2;
    for (int64_t dt0 = 0; dt0 < DT; dt0 += 4) {
        const int four = DT - dt0 >= 4; /* else 2 dim tiles: D is a multiple of 32 */
        float *od = o + dt0 * 16;
        _tile_loadd(0, od, ldo);
        _tile_loadd(1, od + 16, ldo);
        if (four) {
            _tile_loadd(2, od + 32, ldo);
            _tile_loadd(3, od + 48, ldo);
        }
        for (int64_t kk = 0; kk < nk / 32; kk++) {
            const uint16_t *v = sg->vp + (kk * DT + dt0) * 512;
            /* P alternates between tiles 4 and 5, so the next key group's P load does not write the
             * tile this group's last product still reads (one P tile for every group, V in tiles 6,
             * 7, 5, 6: measured ~5 % slower, the same sums). */
            if (kk & 1) CA_PV_GROUP(5);
            else CA_PV_GROUP(4);
        }
        _tile_stored(0, od, ldo);
        _tile_stored(1, od + 16, ldo);
        if (four) {
            _tile_stored(2, od + 32, ldo);
            _tile_stored(3, od + 48, ldo);
        }
    }
}

/* ---- the same two products in AVX-512 BF16 registers (CPUs without AMX) ------------------------
 *
 * VDPBF16PS adds to each float32 lane the two products of a bfloat16 pair. With one operand a pair
 * broadcast to all 16 lanes (m32bcst) and the other 16 lanes of pairs, it is one row of the AMX tile
 * product, and the packed K (ca_pack_k) and V (ca_pack_v) blocks are already 16 lanes of pairs per
 * tile row. So this path keeps the AMX path's walk, packing and softmax; only the products differ:
 *
 *   S = Q K^T   S[r, 16 keys] += Q[r, dims 2p, 2p+1] (broadcast) . K pairs of the 16 keys, over the
 *               D/2 dim pairs p, in register blocks of up to 6 rows x 64 keys;
 *   O += P V    O[r, 16 dims] += P[r, keys 2k, 2k+1] (broadcast) . V pairs of the 16 dims, over the
 *               key pairs k, in register blocks of up to 6 rows x 64 dims (the running output is
 *               loaded into the accumulators once per key block and stored back).
 *
 * A block of 6 x 4 accumulators takes 4 vector loads and 6 broadcasts per 24 VDPBF16PS: 24 + 4 + 1 of
 * the 32 zmm registers. Each lane sums its pairs in pair order, so a row's bits depend neither on its
 * block of rows nor on its work item (the bitwise properties the tests check hold here too); they are
 * not the AMX path's bits (a tile sums its 16 pairs in its own order). */

#define CA_DP_ROWS 6 /* rows per register block */

/* The bfloat16 pair at p (one 32-bit word) in all 16 lanes: VDPBF16PS's broadcast operand. */
CA_VEC static inline __m512bh ca_pair(const uint16_t *p) {
    int32_t w;
    memcpy(&w, p, 4);
    return (__m512bh)_mm512_set1_epi32(w);
}

/* S rows 0 .. R - 1 (row stride CA_LDS) of key groups 0 .. NG - 1 (16 keys each): Q rows at q (row
 * stride D) times the packed K at kp (a key group's D/2 pair rows of 16 keys, 16 * D elements, then
 * the next group's). R <= CA_DP_ROWS, NG <= 4: constants at every call, so the loops unroll into
 * registers. */
CA_VEC static inline __attribute__((always_inline)) void ca_dp_scores_block(const uint16_t *q, int64_t D,
                                                                           const uint16_t *kp, float *s,
                                                                           const int R, const int NG) {
    __m512 acc[CA_DP_ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        __m512bh k[4];
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) k[g] = (__m512bh)_mm512_loadu_si512(kp + g * 16 * D + 32 * p);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512bh qr = ca_pair(q + r * D + 2 * p);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qr, k[g]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) _mm512_storeu_ps(s + r * CA_LDS + 16 * g, acc[r][g]);
}

/* ca_scores's contract (S = Q K^T for keys 0 .. nk - 1, nk a multiple of 32, into sg->s) in registers:
 * rows in blocks of 6, 6, 4; keys in blocks of 64 (the last one 32 when nk is an odd multiple of 32). */
CA_VEC static void ca_dp_scores(const uint16_t *qt, int64_t D, int64_t nk, const ca_seg *sg) {
    for (int r0 = 0; r0 < 16; r0 += CA_DP_ROWS) {
        const int six = 16 - r0 >= CA_DP_ROWS; /* else the last 4 rows */
        const uint16_t *q = qt + r0 * D;
        float *s = sg->s + r0 * CA_LDS;
        for (int64_t j0 = 0; j0 < nk / 16; j0 += 4) {
            const uint16_t *k = sg->kp + j0 * 16 * D;
            if (nk / 16 - j0 >= 4) {
                if (six) ca_dp_scores_block(q, D, k, s + 16 * j0, CA_DP_ROWS, 4);
                else ca_dp_scores_block(q, D, k, s + 16 * j0, 4, 4);
            } else {
                if (six) ca_dp_scores_block(q, D, k, s + 16 * j0, CA_DP_ROWS, 2);
                else ca_dp_scores_block(q, D, k, s + 16 * j0, 4, 2);
            }
        }
    }
}

/* o rows 0 .. R - 1 (row stride D), dim tiles 0 .. NT - 1 (16 dims each) += P V over keys 0 .. nk - 1:
 * P rows at p (row stride CA_LDP), V packed at vp (dim tile t of key group kk at (kk * D/16 + t) * 512,
 * row i = key pair i of the group). R <= CA_DP_ROWS, NT <= 4: constants at every call. */
CA_VEC static inline __attribute__((always_inline)) void ca_dp_pv_block(float *o, int64_t D, const uint16_t *p,
                                                                       const uint16_t *vp, int64_t nk,
                                                                       const int R, const int NT) {
    const int64_t DT = D / 16;
    __m512 acc[CA_DP_ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_loadu_ps(o + r * D + 16 * t);
    for (int64_t kk = 0; kk < nk / 32; kk++) {
        const uint16_t *v = vp + kk * DT * 512;
        for (int i = 0; i < 16; i++) {
            __m512bh vt[4];
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) vt[t] = (__m512bh)_mm512_loadu_si512(v + t * 512 + 32 * i);
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                const __m512bh pr = ca_pair(p + r * CA_LDP + 32 * kk + 2 * i);
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], pr, vt[t]);
            }
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) _mm512_storeu_ps(o + r * D + 16 * t, acc[r][t]);
}

/* ca_pv's contract (o = o * alpha + P V over keys 0 .. nk - 1) in registers: rows in blocks of 6, 6,
 * 4; dims in blocks of 64 (the last one 32 when D is an odd multiple of 32). */
CA_VEC static void ca_dp_pv(float *o, const float alpha[16], __mmask16 moves, int64_t D, int64_t nk,
                            const ca_seg *sg) {
    const int64_t DT = D / 16;
    ca_rescale(o, alpha, moves, D);
    for (int r0 = 0; r0 < 16; r0 += CA_DP_ROWS) {
        const int six = 16 - r0 >= CA_DP_ROWS;
        const uint16_t *p = sg->p + r0 * CA_LDP;
        for (int64_t dt0 = 0; dt0 < DT; dt0 += 4) {
            float *od = o + r0 * D + 16 * dt0;
            const uint16_t *v = sg->vp + dt0 * 512;
            if (DT - dt0 >= 4) {
                if (six) ca_dp_pv_block(od, D, p, v, nk, CA_DP_ROWS, 4);
                else ca_dp_pv_block(od, D, p, v, nk, 4, 4);
            } else {
                if (six) ca_dp_pv_block(od, D, p, v, nk, CA_DP_ROWS, 2);
                else ca_dp_pv_block(od, D, p, v, nk, 4, 2);
            }
        }
    }
}

/* ---- the float32 products (AVX-512F FMAs) --------------------------------------------------------
 *
 * Register blocks of broadcast x vector FMAs, 8 rows at a time (16 = 8 + 8): scores 8 rows x 48 keys
 * (24 accumulators, 3 vector loads and 8 broadcast operands per 24 FMAs), P V 8 rows x 32 dims (16
 * accumulators, 2 loads and 8 broadcasts per 16 FMAs). Each lane sums its products in dim (key) order.
 * In L1 (a harness of the bare blocks, D = 64, one thread of this 2-vCPU Zen 5, whose FMA peak
 * measured ~270-280 GFLOP/s with register operands only): scores 8 x 48 255-265 GFLOP/s (6 x 64 and
 * 12 x 32 the same, 4 x 64 ~215); P V 8 x 32 262-267, 6 x 64 (6 + 6 + 4 rows, the VDPBF16PS form's
 * shape) 235-240, its 4-row block ~210. */

#define CA_F32_ROWS 8 /* rows per register block of either product */

/* S rows 0 .. 7 (row stride CA_LDS) of key groups 0 .. NG - 1 (16 keys each) = Q rows at q (row stride
 * D) times the transposed K at kp (group g's D dim rows of 16 keys at kp + g * 16 * D). NG <= 3, a
 * constant at every call. */
CA_VEC CA_INLINE void ca_f32_scores_block(const float *q, int64_t D, const float *kp, float *s,
                                          const int NG) {
    __m512 acc[CA_F32_ROWS][3];
#pragma GCC unroll 8
    for (int r = 0; r < CA_F32_ROWS; r++)
#pragma GCC unroll 3
        for (int g = 0; g < NG; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 k[3];
#pragma GCC unroll 3
        for (int g = 0; g < NG; g++) k[g] = _mm512_load_ps(kp + g * 16 * D + 16 * d);
#pragma GCC unroll 8
        for (int r = 0; r < CA_F32_ROWS; r++) {
            const __m512 qr = _mm512_set1_ps(q[r * D + d]);
#pragma GCC unroll 3
            for (int g = 0; g < NG; g++) acc[r][g] = _mm512_fmadd_ps(qr, k[g], acc[r][g]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < CA_F32_ROWS; r++)
#pragma GCC unroll 3
        for (int g = 0; g < NG; g++) _mm512_storeu_ps(s + r * CA_LDS + 16 * g, acc[r][g]);
}

/* S = Q K^T for keys 0 .. nk - 1 of the block (nk a multiple of 32) into sg->s, float32: Q is the M tile
 * [16 x D] (row stride D); keys in blocks of 48 (the last 32 or 16). */
CA_VEC static void ca_f32_scores(const float *qt, int64_t D, int64_t nk, const ca_seg *sg) {
    for (int r0 = 0; r0 < 16; r0 += CA_F32_ROWS) {
        const float *q = qt + r0 * D;
        float *s = sg->s + r0 * CA_LDS;
        for (int64_t j0 = 0; j0 < nk / 16; j0 += 3) {
            const float *k = sg->kf + j0 * 16 * D;
            const int64_t left = nk / 16 - j0;
            if (left >= 3) ca_f32_scores_block(q, D, k, s + 16 * j0, 3);
            else if (left == 2) ca_f32_scores_block(q, D, k, s + 16 * j0, 2);
            else ca_f32_scores_block(q, D, k, s + 16 * j0, 1);
        }
    }
}

/* o rows 0 .. 7 (row stride D), dim vectors 0 .. NT - 1 (16 dims each) += P V over keys 0 .. nk - 1:
 * P rows at p (float32, row stride CA_LDP), V rows at vp (row stride D). NT <= 2, a constant at every
 * call. */
CA_VEC CA_INLINE void ca_f32_pv_block(float *o, int64_t D, const float *p, const float *vp, int64_t nk,
                                      const int NT) {
    __m512 acc[CA_F32_ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < CA_F32_ROWS; r++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_loadu_ps(o + r * D + 16 * t);
    for (int64_t k = 0; k < nk; k++) {
        __m512 v[2];
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) v[t] = _mm512_load_ps(vp + k * D + 16 * t);
#pragma GCC unroll 8
        for (int r = 0; r < CA_F32_ROWS; r++) {
            const __m512 pr = _mm512_set1_ps(p[r * CA_LDP + k]);
#pragma GCC unroll 2
            for (int t = 0; t < NT; t++) acc[r][t] = _mm512_fmadd_ps(pr, v[t], acc[r][t]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < CA_F32_ROWS; r++)
#pragma GCC unroll 2
        for (int t = 0; t < NT; t++) _mm512_storeu_ps(o + r * D + 16 * t, acc[r][t]);
}

/* ca_pv's contract (o = o * alpha + P V over keys 0 .. nk - 1), float32 P (sg->pf) and V (sg->vf): dims
 * in blocks of 32 (the last 16 when D is an odd multiple of 16). */
CA_VEC static void ca_f32_pv(float *o, const float alpha[16], __mmask16 moves, int64_t D, int64_t nk,
                             const ca_seg *sg) {
    ca_rescale(o, alpha, moves, D);
    for (int r0 = 0; r0 < 16; r0 += CA_F32_ROWS) {
        const float *p = sg->pf + r0 * CA_LDP;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            if (D - d0 >= 32) ca_f32_pv_block(o + r0 * D + d0, D, p, sg->vf + d0, nk, 2);
            else ca_f32_pv_block(o + r0 * D + d0, D, p, sg->vf + d0, nk, 1);
        }
    }
}

/* Prefetch into L2 the K and V rows (D elements of es bytes) of positions p0 .. p1 - 1 (the next key
 * block, read while this one is computed: the cache is strided by heads and its blocks scattered, beyond
 * the prefetchers). */
static inline void ca_prefetch(int64_t p0, int64_t p1, const char *kc, const char *vc, const int32_t *bt,
                               int64_t block_size, int64_t Hkv, int64_t h, int64_t D, int64_t es) {
    int64_t b = p0 / block_size, off = p0 - b * block_size;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t at = (((int64_t)bt[b] * block_size + off) * Hkv + h) * D * es;
        for (int64_t d = 0; d < D * es; d += 64) {
            _mm_prefetch(kc + at + d, _MM_HINT_T1);
            _mm_prefetch(vc + at + d, _MM_HINT_T1);
        }
        if (++off == block_size) off = 0, b++;
    }
}

/* ---- one work item ------------------------------------------------------------------------------ */

/* Keys of block b0 .. b1 - 1 that query tile qt (rows 16 qt .. of the item's nq, row 0 of the item at
 * position pos0) computes: nk, the visible ones rounded up to 32; with vis, each row's visible count
 * (causal: key position <= the row's position; 0 .. nvalid). The tile must see the block. */
static inline int64_t ca_block_keys(int64_t pos0, int64_t nq, int64_t qt, int64_t b0, int64_t b1, int64_t vis[16]) {
    const int64_t first = pos0 + qt * 16, last = pos0 + (qt * 16 + 15 < nq ? qt * 16 + 15 : nq - 1);
    const int64_t nvalid = (b1 < last + 1 ? b1 : last + 1) - b0;
    if (vis)
        for (int r = 0; r < 16; r++) {
            const int64_t v = first + r - b0 + 1;
            vis[r] = v < 0 ? 0 : v > nvalid ? nvalid : v;
        }
    return (nvalid + 31) / 32 * 32;
}

typedef struct ca_ws {
    ca_seg sg;
    void *q;        /* [G * TQ/16 M tiles][16][D] the item's queries (q's dtype), zero rows past the chunk */
    float *o;       /* [M tiles][16][D] running outputs */
    float *m, *l;   /* [M tiles][16] running max (of S * c) and sum */
} ca_ws;

/* Chunk i, KV head h, query tokens t0 .. t1 - 1 of the chunk: segment by segment, block by block of
 * CA_KB keys (packed once for all the item's M tiles), each M tile's scores,
 * softmax and P V, the products as a->isa says: on AMX tiles (tiles configured), in AVX-512 BF16
 * registers, or (float32) in AVX-512F FMAs. */
CA_VEC static void ca_item(const sg_chunk_attention_args *a, int64_t i, int64_t h, int64_t t0, int64_t t1,
                           int64_t seg, ca_ws *w) {
    const int isa = a->isa, f32 = isa == CA_ISA_AVX512F;
    const int64_t D = a->D, G = a->Hq / a->Hkv, Hkv = a->Hkv, bs = a->block_size, es = f32 ? 4 : 2;
    const int64_t prior = a->priors[i], row0 = a->starts[i];
    const int32_t *bt = a->block_table + a->reqs[i] * a->ld_bt;
    const char *kc = (const char *)a->cache;
    const char *vc = kc + a->num_blocks * bs * Hkv * D * es;
    const int64_t nq = t1 - t0, nqt = (nq + 15) / 16, nm = G * nqt;
    const float c = a->scale * 1.44269504088896341f;
    for (int64_t g = 0; g < G; g++)
        for (int64_t qt = 0; qt < nqt; qt++)
            for (int64_t r = 0; r < 16; r++) {
                int64_t t = t0 + qt * 16 + r;
                char *dst = (char *)w->q + ((g * nqt + qt) * 16 + r) * D * es;
                if (t < t1)
                    memcpy(dst, (const char *)a->q + ((row0 + t) * a->ldq + (h * G + g) * D) * es, D * es);
                else memset(dst, 0, D * es);
            }
    memset(w->o, 0, sizeof(float) * nm * 16 * D);
    for (int64_t j = 0; j < nm * 16; j++) w->m[j] = CA_M0, w->l[j] = 0.0f;
    const int64_t end = prior + t1; /* keys the item's last query sees */
    for (int64_t s0 = 0; s0 < end; s0 += seg) {
        const int64_t s1 = s0 + seg < end ? s0 + seg : end;
        for (int64_t b0 = s0; b0 < s1; b0 += CA_KB) {
            const int64_t b1 = b0 + CA_KB < s1 ? b0 + CA_KB : s1, np = (b1 - b0 + 31) / 32 * 32;
            if (f32) {
                ca_pack_k_f32(w->sg.kf, b0, np, b1, (const float *)kc, bt, bs, Hkv, h, D);
                ca_pack_v_f32(w->sg.vf, b0, np, b1, (const float *)vc, bt, bs, Hkv, h, D);
            } else {
                ca_pack_k(w->sg.kp, b0, np, b1, (const uint16_t *)kc, bt, bs, Hkv, h, D);
                ca_pack_v(w->sg.vp, b0, np, b1, (const uint16_t *)vc, bt, bs, Hkv, h, D);
            }
            ca_prefetch(b1, b1 + CA_KB < end ? b1 + CA_KB : end, kc, vc, bt, bs, Hkv, h, D, es);
            /* The M tiles that see this block: query tiles qlo .. nqt - 1 (a tile sees nothing of it when
             * its last row's position is before b0, causal), each for the G heads: tile ti is query tile
             * qlo + ti / G of head ti % G, its scores, softmax and P V in turn through one pair of S and
             * P buffers. Until 2026-12-04 every head's scores came first, then every softmax, then every
             * P V (G buffers each, so a buffer was read long after it was written): with G = 3 those
             * buffers (42 KiB) and the packed K and V (32 KiB) overflowed the 48 KiB L1.
             * benchmarks/bench_chunk_attention.py --prior 0 --chunk 4096 (30 layers, 2 threads, AMX
             * Xeon): 570 ms so, 452-464 ms now. Overlapping the tile products with another tile's
             * softmax (a two-stage pipeline over the tiles, two buffers) measured 463-498 ms: a
             * harness of the bare functions shows no overlap (a tile store seems to hold the younger
             * vector loads until its products are done), only the smaller footprint. */
            int64_t qlo = 0;
            while (qlo < nqt && prior + t0 + (qlo * 16 + 15 < nq ? qlo * 16 + 15 : nq - 1) < b0) qlo++;
            const int64_t ntl = (nqt - qlo) * G;
            for (int64_t ti = 0; ti < ntl; ti++) {
                const int64_t qt = qlo + ti / G, g = ti % G, mt = g * nqt + qt;
                const char *qm = (const char *)w->q + mt * 16 * D * es;
                float *om = w->o + mt * 16 * D;
                int64_t vis[16];
                const int64_t nk = ca_block_keys(prior + t0, nq, qt, b0, b1, vis);
                float alpha[16];
                float *m = w->m + mt * 16, *l = w->l + mt * 16;
                if (f32) {
                    ca_f32_scores((const float *)qm, D, nk, &w->sg);
                    const __mmask16 moves = ca_softmax_f32(vis, nk, c, &w->sg, m, l, alpha, b0 == 0);
                    ca_f32_pv(om, alpha, moves, D, nk, &w->sg);
                } else {
                    const uint16_t *qb = (const uint16_t *)qm;
                    if (isa == CA_ISA_AMX) ca_scores(qb, D, nk, &w->sg);
                    else ca_dp_scores(qb, D, nk, &w->sg);
                    const __mmask16 moves = ca_softmax_bf16(vis, nk, c, &w->sg, m, l, alpha, b0 == 0);
                    if (isa == CA_ISA_AMX) ca_pv(om, alpha, moves, D, nk, &w->sg);
                    else ca_dp_pv(om, alpha, moves, D, nk, &w->sg);
                }
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t qt = 0; qt < nqt; qt++)
            for (int64_t r = 0; r < 16 && t0 + qt * 16 + r < t1; r++) {
                const int64_t mt = g * nqt + qt, t = t0 + qt * 16 + r;
                const float *o = w->o + (mt * 16 + r) * D;
                const int64_t at = ((row0 + t) * a->Hq + h * G + g) * D;
                if (f32) { /* one rounding: o / l, not o * (1 / l) */
                    const __m512 lv = _mm512_set1_ps(w->l[mt * 16 + r]);
                    for (int64_t d = 0; d < D; d += 16)
                        _mm512_storeu_ps((float *)a->out + at + d, _mm512_div_ps(_mm512_loadu_ps(o + d), lv));
                    continue;
                }
                const float inv = 1.0f / w->l[mt * 16 + r];
                uint16_t *dst = (uint16_t *)a->out + at;
                for (int64_t d = 0; d < D; d += 32) {
                    __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(inv));
                    __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(o + d + 16), _mm512_set1_ps(inv));
                    _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
            }
}

/* ---- entry point -------------------------------------------------------------------------------- */

/* Whether everything a chunk reads lies inside the tensors: its rows (< T), its block-table row (< B),
 * prior + qlen (<= ld_bt * block_size) and every block id it walks (1 .. num_blocks - 1). */
static int ca_check(const sg_chunk_attention_args *a) {
    for (int64_t i = 0; i < a->n; i++) {
        int64_t end = a->priors[i] + a->qlens[i];
        if (a->qlens[i] < 1 || a->priors[i] < 0 || end > a->ld_bt * a->block_size) return CA_ERR_SHAPE;
        if (a->starts[i] < 0 || a->starts[i] + a->qlens[i] > a->T || a->reqs[i] < 0 || a->reqs[i] >= a->B)
            return CA_ERR_ROW;
        const int32_t *bt = a->block_table + a->reqs[i] * a->ld_bt;
        for (int64_t b = 0; b < (end + a->block_size - 1) / a->block_size; b++)
            if (bt[b] < 1 || bt[b] >= a->num_blocks) return CA_ERR_BLOCK;
    }
    return CA_OK;
}

CA_TARGET static void ca_tile_release(void) { _tile_release(); }

CA_VEC static int ca_run(const sg_chunk_attention_args *a) {
    const int amx = a->isa == CA_ISA_AMX;
    const int64_t n = a->n, Hkv = a->Hkv, D = a->D, G = a->Hq / a->Hkv, es = a->dt == CA_DT_F32 ? 4 : 2;
    int64_t seg = a->seg, longest = 0, threads = omp_get_max_threads(), tq = CA_TQ;
    for (int64_t i = 0; i < n; i++)
        if (a->priors[i] + a->qlens[i] > longest) longest = a->priors[i] + a->qlens[i];
    if (seg > longest) seg = longest; /* bounds the buffers */
    /* Items per chunk and KV head: cdiv(qlen, tq); smaller query tiles until there are 2 per thread.
     * Each item reads its KV head's whole prior, so every halving reads it once more: a 128-token
     * chunk after 2,048 cached tokens (30 layers, 2 threads; bench_chunk_attention.py --prior 2048
     * --chunk 128, alternating builds) took 20-21 ms cut for 4 items per thread (12 items of 32
     * queries) and 18 ms for 2 (6 of 64); 512 after 2,048: 64-66 -> 62-63 ms; 256 or 512 after 0: equal. */
    int64_t items = 0;
    for (;;) {
        items = 0;
        for (int64_t i = 0; i < n; i++) items += (a->qlens[i] + tq - 1) / tq * Hkv;
        if (tq <= 16 || items >= 2 * threads) break;
        tq /= 2;
    }
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (n + 1)); /* first item of chunk i */
    if (!first) return CA_ERR_NOMEM;
    first[0] = 0;
    for (int64_t i = 0; i < n; i++) first[i + 1] = first[i] + (a->qlens[i] + tq - 1) / tq * Hkv;
    const int64_t nm = G * (tq / 16);
    int failed = 0;
#pragma omp parallel
    {
        ca_ws w;
        w.sg.kp = (uint16_t *)aligned_alloc(64, CA_KB * D * es); /* room for either path's block */
        w.sg.vp = (uint16_t *)aligned_alloc(64, CA_KB * D * es);
        w.sg.s = (float *)aligned_alloc(64, 16 * CA_LDS * 4); /* one M tile's (see ca_item) */
        w.sg.p = (uint16_t *)aligned_alloc(64, 16 * CA_LDP * es);
        w.sg.kf = (float *)w.sg.kp, w.sg.vf = (float *)w.sg.vp, w.sg.pf = (float *)w.sg.p;
        w.q = aligned_alloc(64, nm * 16 * D * es);
        w.o = (float *)aligned_alloc(64, nm * 16 * D * 4);
        w.m = (float *)malloc(nm * 16 * 4);
        w.l = (float *)malloc(nm * 16 * 4);
        int ok = w.sg.kp && w.sg.vp && w.sg.s && w.sg.p && w.q && w.o && w.m && w.l;
        if (!ok) failed = 1;
        else if (amx) ca_tile_config();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!ok) continue;
            int64_t lo = 0, hi = n - 1; /* chunk i with first[i] <= it < first[i + 1] */
            while (lo < hi) {
                int64_t mid = (lo + hi + 1) / 2;
                if (first[mid] <= it) lo = mid;
                else hi = mid - 1;
            }
            const int64_t i = lo, local = it - first[i], tiles = (first[i + 1] - first[i]) / Hkv;
            const int64_t qt = tiles - 1 - local / Hkv, h = local % Hkv; /* last query tiles first */
            const int64_t t0 = qt * tq, t1 = t0 + tq < a->qlens[i] ? t0 + tq : a->qlens[i];
            ca_item(a, i, h, t0, t1, seg, &w);
        }
        if (ok && amx) ca_tile_release();
        free(w.sg.kp); free(w.sg.vp); free(w.sg.s); free(w.sg.p);
        free(w.q); free(w.o); free(w.m); free(w.l);
    }
    free(first);
    return failed ? CA_ERR_NOMEM : CA_OK;
}

/* Attention of n chunks to their cached tokens, read in place through the block table: chunk i's
 * queries are q rows starts[i] .. starts[i] + qlens[i] - 1 at positions priors[i] .. priors[i] + qlens[i]
 * - 1; each sees the keys at positions up to its own (its chunk's K/V already written to the cache).
 * Writes those rows of out (other rows untouched). Everything read is checked first (ca_check).
 * bfloat16 (dt CA_DT_BF16): Q K^T and P V run on AMX tiles (isa CA_ISA_AMX) or in AVX-512 BF16 registers
 * (CA_ISA_AVX512_BF16); float32 (CA_DT_F32): in AVX-512F registers (isa CA_ISA_AVX512F, D a multiple of
 * 16). Returns CA_OK, CA_ERR_LAYOUT, CA_ERR_SHAPE (also for another dt, or an isa the dt has not),
 * CA_ERR_ROW, CA_ERR_BLOCK, CA_ERR_NO_AMX (isa AMX without granted tiles), CA_ERR_NO_ISA (isa
 * AVX512_BF16 or AVX512F on a CPU without it) or CA_ERR_NOMEM. */
int sg_chunk_attention(const sg_chunk_attention_args *a) {
    if (a->size != (int64_t)sizeof *a) return CA_ERR_LAYOUT;
    const int f32 = a->dt == CA_DT_F32, dmul = f32 ? 16 : 32;
    if ((a->dt != CA_DT_BF16 && !f32) || a->Hkv < 1 || a->D % dmul || a->D < dmul || a->D > CA_MAX_D ||
        a->Hq % a->Hkv || a->Hq / a->Hkv > CA_MAX_G || a->seg < 1 || a->n < 0)
        return CA_ERR_SHAPE;
    if (f32 ? a->isa != CA_ISA_AVX512F : a->isa != CA_ISA_AMX && a->isa != CA_ISA_AVX512_BF16)
        return CA_ERR_SHAPE;
    if (a->isa == CA_ISA_AMX && !sg_amx_granted()) return CA_ERR_NO_AMX;
    if (a->isa == CA_ISA_AVX512_BF16 && !__builtin_cpu_supports("avx512bf16")) return CA_ERR_NO_ISA;
    if (a->isa == CA_ISA_AVX512F && !__builtin_cpu_supports("avx512f")) return CA_ERR_NO_ISA;
    int rc = ca_check(a);
    return rc != CA_OK || a->n == 0 ? rc : ca_run(a);
}
