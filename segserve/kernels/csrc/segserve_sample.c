/* Token sampling over float32 logits in a few passes of each row, without sorting the vocabulary:
 *
 *   sg_sample     per row: temperature, top-k, top-p, min-p, then one draw by an exponential race.
 *   sg_logprobs   per row: a token's logprob and rank, and the top-k logprobs (log_softmax), no sort of
 *                 the vocabulary (end of the file).
 *
 * Why: the PyTorch sampler it replaced (softmax, a torch uniform_ per token, a top-k and often a sort for
 * top-p) spent ~250 us a row at temperature 1 and ~3.7 ms a row with top-p 0.9 on a 49,152-token
 * vocabulary: 13 and 130 ms for a 64-row decode step whose model work is ~40 ms (Zen 5, 2 threads;
 * docs/perf.md, twenty-fifth session).
 *
 * Per row (V logits l, temperature T, k, p, min_p, a 64-bit noise key):
 *   1. m = max l (a row with a NaN logit returns argmax's answer, that NaN). Top-k (0 < k < V): the
 *      k-th largest logit by a three-level radix select (11, 11, 10 bits of an order-preserving key);
 *      logits >= it stay (ties at it stay, as the PyTorch path keeps them).
 *   2. w_i = exp((l_i - m) / T) for the kept logits, else 0 (-inf logits give 0 exactly: a masked
 *      token is never drawn). w is the softmax unnormalized: its largest entry is exactly 1.
 *   3. Top-p (p < 1): with Z = sum w, a token stays when the mass of the tokens before it in descending
 *      order is below p Z (vLLM's rule); found by the same radix select with the w as weights (double
 *      sums), which gives the crossing value w*; tokens above it stay, tokens equal to it stay in index
 *      order while the mass before them is below p Z (a stable sort's order).
 *   4. Min-p: a token stays when w_i >= min_p (min_p times the top probability, which is w = 1).
 *   5. The draw: argmax_i w_i / E_i over the kept tokens, E_i = -log U_i ~ Exp(1) (the exponential race,
 *      a form of the Gumbel-max trick: the least of independent exponentials of rates w_i falls on i
 *      with probability w_i / sum w). U_i is a hash of (key, i): two rounds of a 32-bit integer mixer
 *      (Wellons' "lowbias32") keyed by the key's halves, its top 23 bits as ((x >> 9) + 0.5) / 2^23
 *      (exact in float32: never 0 or 1).
 *      Each token's noise depends on the key and its id alone, so logits that move by a rounding error
 *      (another batch shape) change the winner only where two tokens nearly tie; an inverse-CDF draw in
 *      index order, tried first, moved with the running sum's error and flipped 23 of 200 seeded draws
 *      under noise of 1e-3 (tests/unit/test_sampler.py). Ties go to the lowest id; a row with nothing
 *      kept (every logit -inf) returns argmax's answer, its first token.
 * segserve/worker/sampler.py's PyTorch path (CPUs without the kernels) filters and hashes the same way.
 *
 * Rows go to OpenMP threads (PyTorch's pool) when there are several; a row uses a scratch buffer of its
 * thread (kept between calls). Returns SM_OK, SM_ERR_LAYOUT, SM_ERR_SHAPE or SM_ERR_NOMEM.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "segserve_simd.h"

#if !defined(__AVX512F__)
#error "segserve_sample.c needs AVX-512F"
#endif

enum { SM_OK = 0, SM_ERR_SHAPE = -1, SM_ERR_NOMEM = -2, SM_ERR_VALUE = -3, SM_ERR_LAYOUT = -5 };
#define SM_EXP_MIN -87.3f /* below this sg_exp512 clamps; such weights are taken as 0 */

typedef struct {
    int64_t size;              /* sizeof(sg_sample_args) */
    int64_t n;                 /* rows, >= 1 */
    int64_t V;                 /* vocabulary (columns), >= 1 */
    const float *logits;       /* (n, V) float32, row stride ld */
    int64_t ld;                /* row stride of logits, elements, >= V */
    const float *temperature;  /* (n,) each > 0 */
    const int32_t *top_k;      /* (n,) 0 or >= V: off */
    const float *top_p;        /* (n,) in (0, 1]; 1: off */
    const float *min_p;        /* (n,) in [0, 1]; 0: off */
    const int64_t *key;        /* (n,) each row's noise key */
    int64_t *out;              /* (n,) the drawn token ids */
    float *kept;               /* (n, V) contiguous or NULL: each row's kept weights w (0 where filtered) */
} sg_sample_args;

/* A thread's scratch: V weights and V candidate indices (kept between calls). */
static __thread float *tl_buf = NULL;
static __thread size_t tl_cap = 0;

static float *scratch(int64_t V) {
    size_t need = (size_t)V * 8;
    if (need > tl_cap) {
        free(tl_buf);
        tl_buf = aligned_alloc(64, (need + 63) / 64 * 64);
        tl_cap = tl_buf ? need : 0;
    }
    return tl_buf;
}

/* An order-preserving key of a float: a < b <=> key(a) < key(b); NaN sorts below -inf (key 0). */
static inline uint32_t order_key(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    if (x != x) return 0;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

static inline float key_value(uint32_t k) {
    uint32_t b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    float x;
    memcpy(&x, &b, 4);
    return x;
}

/* The key v where the weights of the candidates' keys above v sum below target and those of keys >= v
 * reach it; *before gets the weight above v. Candidates: vals[idx[0..m)], each of weight 1 with the key
 * order_key(value) (weighted 0), or of weight value with its float bits as the key (weighted 1: values
 * >= 0). Three levels of 11, 11 and 10 bits, each keeping in idx only the candidates of the bucket
 * where the target is crossed. Needs 0 < target <= the candidates' total weight. */
static uint32_t select_key(const float *vals, int weighted, int32_t *idx, int64_t m, double target,
                           double *before) {
    static const int shift[3] = {21, 10, 0}, bits[3] = {11, 11, 10};
    double mass[2048];
    double acc = 0.0;
    uint32_t prefix = 0;
    for (int lv = 0; lv < 3; lv++) {
        const int nb = 1 << bits[lv];
        const uint32_t mask = (uint32_t)nb - 1;
        memset(mass, 0, (size_t)nb * sizeof mass[0]);
#define KEY(i) (weighted ? ((const uint32_t *)vals)[i] : order_key(vals[i]))
        for (int64_t j = 0; j < m; j++) {
            int32_t i = idx[j];
            mass[(KEY(i) >> shift[lv]) & mask] += weighted ? (double)vals[i] : 1.0;
        }
        int b = nb - 1;
        for (; b > 0; b--) {
            if (acc + mass[b] >= target) break;
            acc += mass[b];
        }
        int64_t m2 = 0;
        for (int64_t j = 0; j < m; j++)
            if (((KEY(idx[j]) >> shift[lv]) & mask) == (uint32_t)b) idx[m2++] = idx[j];
#undef KEY
        m = m2;
        prefix |= (uint32_t)b << shift[lv];
    }
    *before = acc;
    return prefix;
}

/* idx[0 .. count) = the indices i < V, in order, where cond(x[i]) holds (cond maps 16 lanes to a mask). */
#define COLLECT(V, idx, x, cond, count)                                                        \
    do {                                                                                       \
        __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); \
        int64_t i_ = 0;                                                                        \
        count = 0;                                                                             \
        for (; i_ + 16 <= (V); i_ += 16) {                                                     \
            __m512 v_ = _mm512_loadu_ps((x) + i_);                                             \
            __mmask16 k_ = cond(v_);                                                           \
            _mm512_mask_compressstoreu_epi32((idx) + count, k_,                                \
                                             _mm512_add_epi32(iota, _mm512_set1_epi32((int)i_))); \
            count += __builtin_popcount(k_);                                                   \
        }                                                                                      \
        for (; i_ < (V); i_++)                                                                 \
            if (cond(_mm512_set1_ps((x)[i_])) & 1) (idx)[count++] = (int32_t)i_;               \
    } while (0)

/* The k-th largest logit (1 <= k < V; NaN below -inf). For small k the row is read once, keeping in a
 * buffer only the values >= a floor that rises to the buffer's k-th largest whenever it fills (the
 * floor is never above the answer), then the buffer is selected from; otherwise all V are. */
static float kth_largest(const float *l, int64_t V, int64_t k, float *buf, int32_t *idx) {
    double above;
    int64_t m = 0;
    if (k > 1024) {
#define ALL(v) ((__mmask16)0xffff)
        COLLECT(V, idx, l, ALL, m);
#undef ALL
        return key_value(select_key(l, 0, idx, m, (double)k, &above));
    }
    const int64_t cap = 8 * k > 2048 ? 8 * k : 2048;
    float floor_v = -INFINITY;
    int have_floor = 0;
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
        __m512 x = _mm512_loadu_ps(l + i);
        __mmask16 keep = have_floor ? _mm512_cmp_ps_mask(x, _mm512_set1_ps(floor_v), _CMP_GE_OQ) : 0xffff;
        _mm512_mask_compressstoreu_ps(buf + m, keep, x);
        m += __builtin_popcount(keep);
        if (m + 16 > cap) {
            for (int64_t j = 0; j < m; j++) idx[j] = (int32_t)j;
            floor_v = key_value(select_key(buf, 0, idx, m, (double)k, &above));
            have_floor = 1;
            int64_t m2 = 0;
            for (int64_t j = 0; j < m; j++)
                if (order_key(buf[j]) >= order_key(floor_v)) buf[m2++] = buf[j];
            m = m2;
        }
    }
    for (; i < V; i++)
        if (!have_floor || order_key(l[i]) >= order_key(floor_v)) buf[m++] = l[i];
    for (int64_t j = 0; j < m; j++) idx[j] = (int32_t)j;
    return key_value(select_key(buf, 0, idx, m, (double)k, &above));
}

/* Wellons' "lowbias32" integer mixer (public domain; bias ~0.17 of a full avalanche's), 16 lanes. */
static inline __m512i mix32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* log(x) for positive normal float32 lanes: Cephes logf's reduction to [sqrt(1/2), sqrt(2)) and its
 * polynomial (~1 ulp). */
static inline __m512 sg_log512(__m512 x) {
    __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
    __m512 e = _mm512_getexp_ps(x);
    __mmask16 hi = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, hi, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, hi, e, _mm512_set1_ps(1.0f));
    const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f)), z = _mm512_mul_ps(f, f);
    __m512 y = _mm512_set1_ps(7.0376836292e-2f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.1514610310e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.1676998740e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.2420140846e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.4249322787e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.6668057665e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.0000714765e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-2.4999993993e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(3.3333331174e-1f));
    y = _mm512_mul_ps(_mm512_mul_ps(y, f), z);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
    y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
}

/* U_i in (0, 1) for token ids i, from (key halves k0, k1, i) as the file's header says. */
static inline __m512 race_uniform(__m512i ids, __m512i k0, __m512i k1) {
    __m512i x = mix32(_mm512_add_epi32(mix32(_mm512_xor_si512(ids, k0)), k1));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 9)), _mm512_set1_ps(0x1p-23f),
                           _mm512_set1_ps(0x1p-24f));
}

/* argmax's answer (torch.argmax's rule, which greedy decoding follows): the first NaN if the row has
 * one, else the first maximal logit. */
static int64_t first_max(const float *l, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 0; i < V; i++) {
        if (l[i] != l[i]) return i;
        if (l[i] > l[best]) best = i;
    }
    return best;
}

/* The row's maximum (NaN never wins), and in *nan / *pinf whether it holds a NaN / a +inf logit. */
static float row_max(const float *l, int64_t V, int *nan, int *pinf) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    const __m512 inf = _mm512_set1_ps(INFINITY);
    __mmask16 n = 0, p = 0;
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
        __m512 x = _mm512_loadu_ps(l + i);
        n |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        p |= _mm512_cmp_ps_mask(x, inf, _CMP_EQ_OQ);
        vm = _mm512_max_ps(vm, x);
    }
    float m = _mm512_reduce_max_ps(vm);
    for (; i < V; i++) {
        n |= l[i] != l[i];
        p |= l[i] == INFINITY;
        if (l[i] > m) m = l[i];
    }
    *nan = n != 0;
    *pinf = p != 0;
    return m;
}

/* Sum of 16 lanes of w[i..i+16) in double, masked. */
static inline __m512d add16_pd(__m512d acc, __m512 v) {
    acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm512_add_pd(acc, _mm512_cvtps_pd(upper));
}

static int64_t sample_row(const float *l, int64_t V, float T, int32_t k, float top_p, float min_p,
                          uint64_t key, float *w, float *kept_out) {
    int32_t *idx = (int32_t *)(w + V);
    /* 1. The row's maximum and the top-k floor. A NaN logit anywhere: argmax's answer, the first NaN
     * (the PyTorch path's softmax makes every probability NaN there). */
    int nan, pinf;
    const float m = row_max(l, V, &nan, &pinf);
    if (nan || m == -INFINITY) return first_max(l, V);
    int64_t i;
    float floor_l = -INFINITY;
    if (k > 0 && k < V) {
        floor_l = kth_largest(l, V, k, w, idx);
    }
    /* 2. Weights; 3. their total for top-p. */
    const __m512 vmax = _mm512_set1_ps(m), vt = _mm512_set1_ps(T), vfloor = _mm512_set1_ps(floor_l);
    const __m512 vmin = _mm512_set1_ps(SM_EXP_MIN);
    __m512d z = _mm512_setzero_pd();
    for (i = 0; i + 16 <= V; i += 16) {
        __m512 x = _mm512_loadu_ps(l + i);
        __m512 s = _mm512_div_ps(_mm512_sub_ps(x, vmax), vt);
        __mmask16 ok = _mm512_cmp_ps_mask(x, vfloor, _CMP_GE_OQ) & _mm512_cmp_ps_mask(s, vmin, _CMP_GE_OQ);
        if (!ok) { /* below the top-k floor (most of a row under top-k): no exp */
            _mm512_storeu_ps(w + i, _mm512_setzero_ps());
            continue;
        }
        __m512 e = _mm512_maskz_mov_ps(ok, sg_exp512(s));
        _mm512_storeu_ps(w + i, e);
        z = add16_pd(z, e);
    }
    double total = _mm512_reduce_add_pd(z);
    for (; i < V; i++) {
        float s = (l[i] - m) / T;
        w[i] = (l[i] >= floor_l && s >= SM_EXP_MIN) ? expf(s) : 0.0f;
        total += w[i];
    }
    float wstar = 0.0f; /* top-p: weights above it stay, equal ones by the tie rule */
    double before = 0.0, limit = 0.0;
    int nucleus = top_p < 1.0f && (limit = (double)top_p * total) < total;
    /* A top_p that rounded to 0 in float32 (1e-46 is in (0, 1]) still keeps one token, as any tiny one. */
    if (nucleus && !(limit > 0.0)) limit = 4.9406564584124654e-324;
    if (nucleus) {
        /* Only weights >= (1 - p) Z / V can stay: all those below sum to less than Z - limit, so the
         * tokens above them already reach the limit. Half that floor, for rounding. */
        const __m512 vcut = _mm512_set1_ps((float)(0.5 * (total - limit) / (double)V));
        int64_t cand = 0;
#define ABOVE_CUT(v) _mm512_cmp_ps_mask((v), vcut, _CMP_GE_OQ)
        COLLECT(V, idx, w, ABOVE_CUT, cand);
#undef ABOVE_CUT
        wstar = key_value(select_key(w, 1, idx, cand, limit, &before) ^ 0x80000000u);
    }
    /* 4. The kept weights. */
    const __m512 vstar = _mm512_set1_ps(wstar), vminp = _mm512_set1_ps(min_p);
    if (nucleus || min_p > 0.0f) {
        for (i = 0; i + 16 <= V; i += 16) {
            __m512 e = _mm512_loadu_ps(w + i);
            __mmask16 drop = _mm512_cmp_ps_mask(e, vminp, _CMP_LT_OQ);
            if (nucleus) drop |= _mm512_cmp_ps_mask(e, vstar, _CMP_LT_OQ);
            if (drop) _mm512_storeu_ps(w + i, _mm512_mask_mov_ps(e, drop, _mm512_setzero_ps()));
        }
        for (; i < V; i++)
            if (w[i] < min_p || (nucleus && w[i] < wstar)) w[i] = 0.0f;
    }
    if (nucleus) {
        /* Ties at w*: in index order, each stays while the mass before it is below the limit. */
        double mass = before;
        for (i = 0; i < V; i++) {
            if (w[i] != wstar) continue;
            if (mass < limit) mass += wstar;
            else w[i] = 0.0f;
        }
    }
    if (kept_out) memcpy(kept_out, w, (size_t)V * sizeof *w);
    /* 5. The race: per lane the best w / E so far and its token, then the best lane (lowest id on ties).
     * E = -log U >= 1 - U, so a token with w <= top (1 - U), top the best w / E so far, cannot win (nor
     * tie below a lower id already seen): a vector all of whose tokens are so skips the log. */
    const __m512i k0 = _mm512_set1_epi32((int)(uint32_t)key);
    const __m512i k1 = _mm512_set1_epi32((int)(uint32_t)(key >> 32));
    const __m512i step = _mm512_set1_epi32(16);
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 best = _mm512_set1_ps(-1.0f), vtop = _mm512_setzero_ps();
    __m512i best_id = _mm512_set1_epi32(-1);
    for (i = 0; i < V; i += 16, ids = _mm512_add_epi32(ids, step)) {
        const __mmask16 in = i + 16 <= V ? (__mmask16)0xffff : (__mmask16)((1u << (V - i)) - 1u);
        __m512 e = _mm512_maskz_loadu_ps(in, w + i);
        __mmask16 live = _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_GT_OQ);
        if (!live) continue; /* filtered tokens: no noise needed */
        const __m512 u = race_uniform(ids, k0, k1);
        live &= _mm512_cmp_ps_mask(e, _mm512_mul_ps(vtop, _mm512_sub_ps(one, u)), _CMP_GT_OQ);
        if (!live) continue;
        __m512 r = _mm512_div_ps(e, _mm512_sub_ps(_mm512_setzero_ps(), sg_log512(u)));
        __mmask16 better = live & _mm512_cmp_ps_mask(r, best, _CMP_GT_OQ);
        if (!better) continue;
        best = _mm512_mask_mov_ps(best, better, r);
        best_id = _mm512_mask_mov_epi32(best_id, better, ids);
        vtop = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    }
    const float top = _mm512_reduce_max_ps(best);
    if (!(top > 0.0f)) return first_max(l, V);
    __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(at, best_id);
}

int sg_sample(const sg_sample_args *a) {
    if (a->size != (int64_t)sizeof *a) return SM_ERR_LAYOUT;
    const int64_t n = a->n, V = a->V, ld = a->ld;
    if (n < 1 || V < 1 || V > INT32_MAX || ld < V) return SM_ERR_SHAPE;
    for (int64_t r = 0; r < n; r++)
        if (!(a->temperature[r] > 0.0f)) return SM_ERR_SHAPE;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (int64_t r = 0; r < n; r++) {
        float *w = scratch(V);
        if (!w) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        a->out[r] = sample_row(a->logits + r * ld, V, a->temperature[r], a->top_k[r], a->top_p[r],
                               a->min_p[r], (uint64_t)a->key[r], w, a->kept ? a->kept + r * V : NULL);
    }
    return failed ? SM_ERR_NOMEM : SM_OK;
}

/* ---- logprobs ---------------------------------------------------------------------------------- */

typedef struct {
    int64_t size;          /* sizeof(sg_logprobs_args) */
    int64_t n;             /* rows, >= 1 */
    int64_t V;             /* vocabulary (columns), >= 1 */
    const float *logits;   /* (n, V) float32, row stride ld: no NaN, no +inf (-inf is a masked token) */
    int64_t ld;            /* row stride of logits, elements, >= V */
    const int64_t *token;  /* (n,) the token of each row whose logprob and rank are wanted, < V */
    int64_t k;             /* top logprobs a row, 0 .. V */
    float *logprob;        /* (n,) log_softmax(row)[token] */
    int64_t *rank;         /* (n,) tokens whose logit is >= the token's (1 = the most likely) */
    float *top_logprob;    /* (n, k): the k largest logprobs, descending (ties: lower id first) */
    int64_t *top_id;       /* (n, k): their token ids */
} sg_logprobs_args;

/* A top-k candidate: its logit and id, ordered by value descending, then id ascending. */
struct vid { /* internal: no ctypes mirror */
    float v;
    int32_t i;
};

static int cmp_vid(const void *pa, const void *pb) {
    const struct vid *a = pa, *b = pb;
    if (a->v != b->v) return a->v > b->v ? -1 : 1;
    return (a->i > b->i) - (a->i < b->i);
}

/* One row: 0 on success, 1 when it holds a NaN or +inf logit (the caller's PyTorch path takes it). */
static int logprobs_row(const float *l, int64_t V, int64_t tok, int64_t k, float *lp, int64_t *rank,
                        float *top_lp, int64_t *top_id, float *buf, int32_t *idx) {
    int nan, pinf;
    const float m = row_max(l, V, &nan, &pinf);
    if (nan || pinf || m == -INFINITY) return 1;
    int64_t i;
    /* log Z = m + log sum exp(l - m), the sum and the log in double */
    const __m512 vmax = _mm512_set1_ps(m), vmin = _mm512_set1_ps(SM_EXP_MIN);
    const float lt = l[tok];
    const __m512 vt = _mm512_set1_ps(lt);
    __m512d z = _mm512_setzero_pd();
    int64_t ge = 0;
    for (i = 0; i + 16 <= V; i += 16) {
        __m512 x = _mm512_loadu_ps(l + i);
        __m512 s = _mm512_sub_ps(x, vmax);
        z = add16_pd(z, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, vmin, _CMP_GE_OQ), sg_exp512(s)));
        ge += __builtin_popcount(_mm512_cmp_ps_mask(x, vt, _CMP_GE_OQ));
    }
    double sum = _mm512_reduce_add_pd(z);
    for (; i < V; i++) {
        float s = l[i] - m;
        if (s >= SM_EXP_MIN) sum += expf(s);
        ge += l[i] >= lt;
    }
    const double logz = (double)m + log(sum); /* each logprob rounded once, from double */
    *lp = (float)((double)lt - logz);
    *rank = ge;
    if (k <= 0) return 0;
    int64_t cand = 0;
    if (k >= V) {
        for (i = 0; i < V; i++) idx[i] = (int32_t)i;
        cand = V;
    } else {
        const float floor_l = kth_largest(l, V, k, buf, idx);
        const __m512 vf = _mm512_set1_ps(floor_l);
#define AT_LEAST_FLOOR(v) _mm512_cmp_ps_mask((v), vf, _CMP_GE_OQ)
        COLLECT(V, idx, l, AT_LEAST_FLOOR, cand);
#undef AT_LEAST_FLOOR
    }
    struct vid *pairs = (struct vid *)buf; /* V floats of room: cand pairs fit when cand <= V / 2 */
    struct vid *heap = cand <= V / 2 ? pairs : malloc((size_t)cand * sizeof *heap);
    if (!heap) return 2;
    for (int64_t j = 0; j < cand; j++) heap[j] = (struct vid){l[idx[j]], idx[j]};
    qsort(heap, (size_t)cand, sizeof *heap, cmp_vid);
    for (int64_t j = 0; j < cand; j++) idx[j] = heap[j].i;
    if (heap != pairs) free(heap);
    for (int64_t j = 0; j < k; j++) {
        top_id[j] = idx[j];
        top_lp[j] = (float)((double)l[idx[j]] - logz);
    }
    return 0;
}

/* Per row: the logprob of row's token, its rank and the top k (log_softmax of the row). Returns
 * SM_OK, SM_ERR_LAYOUT, SM_ERR_SHAPE, SM_ERR_NOMEM, or SM_ERR_VALUE when a row holds a NaN or +inf
 * logit (nothing of that row is written; the caller computes such rows another way). */
int sg_logprobs(const sg_logprobs_args *a) {
    if (a->size != (int64_t)sizeof *a) return SM_ERR_LAYOUT;
    const int64_t n = a->n, V = a->V, ld = a->ld, k = a->k;
    if (n < 1 || V < 1 || V > INT32_MAX || ld < V || k < 0 || k > V) return SM_ERR_SHAPE;
    for (int64_t r = 0; r < n; r++)
        if (a->token[r] < 0 || a->token[r] >= V) return SM_ERR_SHAPE;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (int64_t r = 0; r < n; r++) {
        float *w = scratch(V);
        int rc = w ? logprobs_row(a->logits + r * ld, V, a->token[r], k, a->logprob + r, a->rank + r,
                                  a->top_logprob + r * k, a->top_id + r * k, w, (int32_t *)(w + V))
                   : 2;
        if (rc) {
#pragma omp atomic write
            failed = rc;
        }
    }
    return failed == 2 ? SM_ERR_NOMEM : failed == 1 ? SM_ERR_VALUE : SM_OK;
}
