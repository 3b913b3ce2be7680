/* segserve CPU kernels (AVX-512F + AVX-512 BF16), built on first use by segserve/kernels/build.py.
 *
 * What the eager PyTorch path spends a small-batch (decode) step on is dispatch, not arithmetic: ~50
 * small ops per layer at ~5 us each, GEMVs that reach ~20 GB/s of ~30, and per-segment flash calls that
 * cost more than the few thousand keys they read. These kernels do a layer's work in a handful of calls:
 *
 *   sg_linear            y = W x (+ bias) for M <= a few rows, optionally after an RMSNorm or SiLU-gate
 *                        prologue and with a residual-add epilogue; W streamed once for all rows.
 *   sg_rope              rotary embedding of the Q and K heads of a fused QKV output, in place.
 *   sg_write_kv          K/V rows into their cache slots.
 *   sg_decode_attention  decode attention through the block table, in place (no gathered copy), split
 *                        into fixed-size KV segments whose partials merge by log-sum-exp
 *                        (FlashAttention's online softmax; "Flash-Decoding" split-KV, Dao et al. 2023).
 *
 * Numerics: float32 accumulation everywhere. Elementwise results are rounded to the activation dtype at
 * the points where the eager model rounds (so float32 prologues and RoPE match it exactly); reductions
 * (dot products, norms, softmax sums) differ from PyTorch's only in summation order.
 * Compiled with -ffp-contract=off so scalar code is not fused into FMAs behind our back.
 * Threads: OpenMP, sharing PyTorch's runtime (same soname, loaded after torch).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "segserve CPU kernels need AVX-512F and AVX-512 BF16"
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_SILU_MUL = 2 };
enum { OK = 0, ERR_SHAPE = -1, ERR_NOMEM = -2 };

#define MT 4 /* rows of x per register tile */
#define NT 4 /* rows of W per register tile */

int sg_abi_version(void) { return 1; }

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

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* ---- linear ------------------------------------------------------------------------------------- */

/* One NT x (up to MT) tile: acc[i][j] = dot(x row m0+i, W row n0+j) over K, float32 weights. */
static inline void tile_f32(const float *w, const float *x, int64_t K, int64_t n0, int64_t m0, int mt,
                            float out[MT][NT]) {
    const float *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    __m512 a[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) a[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
        __m512 v2 = _mm512_loadu_ps(w2 + k), v3 = _mm512_loadu_ps(w3 + k);
        for (int i = 0; i < MT; i++) {
            if (i >= mt) break;
            __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
            a[i][0] = _mm512_fmadd_ps(v0, xv, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(v1, xv, a[i][1]);
            a[i][2] = _mm512_fmadd_ps(v2, xv, a[i][2]);
            a[i][3] = _mm512_fmadd_ps(v3, xv, a[i][3]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NT; j++) out[i][j] = _mm512_reduce_add_ps(a[i][j]);
}

/* The same for bfloat16 weights and bfloat16 x: vdpbf16ps multiplies pairs exactly and sums in float32. */
static inline void tile_bf16(const uint16_t *w, const uint16_t *x, int64_t K, int64_t n0, int64_t m0, int mt,
                             float out[MT][NT]) {
    const uint16_t *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    __m512 a[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) a[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + k), v1 = (__m512bh)_mm512_loadu_si512(w1 + k);
        __m512bh v2 = (__m512bh)_mm512_loadu_si512(w2 + k), v3 = (__m512bh)_mm512_loadu_si512(w3 + k);
        for (int i = 0; i < MT; i++) {
            if (i >= mt) break;
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * K + k);
            a[i][0] = _mm512_dpbf16_ps(a[i][0], v0, xv);
            a[i][1] = _mm512_dpbf16_ps(a[i][1], v1, xv);
            a[i][2] = _mm512_dpbf16_ps(a[i][2], v2, xv);
            a[i][3] = _mm512_dpbf16_ps(a[i][3], v3, xv);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NT; j++) out[i][j] = _mm512_reduce_add_ps(a[i][j]);
}

/* The prologue's result for row m, rounded to dt where the eager model rounds, into xin (float32 values
 * that dt represents exactly). */
static void prologue_row(int dt, int prologue, int64_t K, const void *x, int64_t ldx, int64_t m,
                         const void *norm_w, float eps, float *xin) {
    int64_t base = m * ldx;
    if (prologue == PRO_RMSNORM) {
        /* HF LlamaRMSNorm: x32 * rsqrt(mean(x32^2) + eps), rounded to dt, then weight * that. */
        double ss = 0.0;
        for (int64_t k = 0; k < K; k++) {
            float v = load_dt(x, base + k, dt);
            ss += (double)v * v;
        }
        float inv = 1.0f / sqrtf((float)(ss / (double)K) + eps);
        for (int64_t k = 0; k < K; k++) {
            float v = round_dt(load_dt(x, base + k, dt) * inv, dt);
            xin[k] = round_dt(load_dt(norm_w, k, dt) * v, dt);
        }
    } else if (prologue == PRO_SILU_MUL) {
        /* x row is [gate (K) | up (K)]: silu(gate) rounded, times up, rounded. */
        for (int64_t k = 0; k < K; k++) {
            float s = round_dt(silu(load_dt(x, base + k, dt)), dt);
            xin[k] = round_dt(s * load_dt(x, base + K + k, dt), dt);
        }
    } else {
        for (int64_t k = 0; k < K; k++) xin[k] = load_dt(x, base + k, dt);
    }
}

/* y[m, n] (= or +=) W[n, :] . prologue(x[m, :]) (+ bias[n]) for m < M, n < N.
 *
 * dt: dtype of x, W, norm_w, bias and of the rounding of the product; ydt: dtype of y. With accumulate,
 * y = round(y + round(W x)), the eager ``h.add_(linear(x))``. K must be a multiple of 32 and N of 4.
 * Returns OK, ERR_SHAPE or ERR_NOMEM. */
int sg_linear(int dt, int ydt, int64_t M, int64_t N, int64_t K, const void *x, int64_t ldx, int prologue,
              const void *norm_w, float eps, const void *w, const void *bias, void *y, int64_t ldy,
              int accumulate) {
    if (M < 1 || K % 32 || N % NT) return ERR_SHAPE;
    float *xin = (float *)malloc(sizeof(float) * M * K);
    uint16_t *xb = dt == DT_BF16 ? (uint16_t *)malloc(sizeof(uint16_t) * M * K) : NULL;
    if (!xin || (dt == DT_BF16 && !xb)) {
        free(xin);
        free(xb);
        return ERR_NOMEM;
    }
    for (int64_t m = 0; m < M; m++) prologue_row(dt, prologue, K, x, ldx, m, norm_w, eps, xin + m * K);
    if (xb)
        for (int64_t i = 0; i < M * K; i++) xb[i] = f32_to_bf16(xin[i]); /* exact: already dt values */
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NT) {
        float acc[MT][NT];
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            int mt = M - m0 < MT ? (int)(M - m0) : MT;
            if (dt == DT_F32) tile_f32((const float *)w, xin, K, n0, m0, mt, acc);
            else tile_bf16((const uint16_t *)w, xb, K, n0, m0, mt, acc);
            for (int i = 0; i < mt; i++) {
                for (int j = 0; j < NT; j++) {
                    int64_t n = n0 + j, at = (m0 + i) * ldy + n;
                    float v = acc[i][j];
                    if (bias) v += load_dt(bias, n, dt);
                    v = round_dt(v, dt);
                    if (accumulate) v = round_dt(load_dt(y, at, ydt) + v, ydt);
                    store_dt(y, at, v, ydt);
                }
            }
        }
    }
    free(xin);
    free(xb);
    return OK;
}

/* ---- RoPE and KV writes ------------------------------------------------------------------------- */

/* Rotate heads [0, H) of each row of x (T, row_stride) in place: x*cos + roll(x, D/2)*ssin with the
 * (T, D) float32 tables rounded to dt first, each product and the sum rounded to dt (the eager
 * ``apply_rope`` on dt tensors). */
int sg_rope(int dt, int64_t T, int64_t H, int64_t D, void *x, int64_t row_stride, const float *cos,
            const float *ssin) {
    if (D % 2 || D > 1024) return ERR_SHAPE;
#pragma omp parallel for schedule(static) if (T * H >= 256)
    for (int64_t t = 0; t < T; t++) {
        float tmp[1024], c[1024], s[1024];
        for (int64_t d = 0; d < D; d++) {
            c[d] = round_dt(cos[t * D + d], dt);
            s[d] = round_dt(ssin[t * D + d], dt);
        }
        for (int64_t h = 0; h < H; h++) {
            int64_t base = t * row_stride + h * D;
            for (int64_t d = 0; d < D; d++) tmp[d] = load_dt(x, base + d, dt);
            for (int64_t d = 0; d < D; d++) {
                float a = round_dt(tmp[d] * c[d], dt);
                float b = round_dt(tmp[(d + D / 2) % D] * s[d], dt);
                store_dt(x, base + d, round_dt(a + b, dt), dt);
            }
        }
    }
    return OK;
}

/* Copy rows t < n of k and v (each row Hkv*D values of dt, row strides ldk/ldv) into cache slots
 * slot_mapping[t] of the [2, num_slots, Hkv*D] cache (same dt). ERR_SHAPE, writing nothing, when a slot
 * is outside [0, num_slots). */
int sg_write_kv(int dt, int64_t n, int64_t width, const void *k, int64_t ldk, const void *v, int64_t ldv,
                void *cache, int64_t num_slots, const int64_t *slot_mapping) {
    size_t es = dt == DT_F32 ? 4 : 2;
    char *c = (char *)cache;
    for (int64_t t = 0; t < n; t++) /* all checked before any write: a bad slot leaves the cache as it was */
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return ERR_SHAPE;
    for (int64_t t = 0; t < n; t++) {
        int64_t slot = slot_mapping[t];
        memcpy(c + (size_t)slot * width * es, (const char *)k + (size_t)t * ldk * es, width * es);
        memcpy(c + (size_t)(num_slots + slot) * width * es, (const char *)v + (size_t)t * ldv * es, width * es);
    }
    return OK;
}

/* ---- decode attention --------------------------------------------------------------------------- */

/* exp(x) for float32 lanes (Cephes expf's range reduction and polynomial; ~1 ulp), inputs clamped below
 * at -87.3 so the result underflows to ~0 rather than misbehaving. */
static inline __m512 exp512(__m512 x) {
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

static inline __m512 load16(const void *p, int64_t i, int dt) {
    return dt == DT_F32 ? _mm512_loadu_ps((const float *)p + i) : bf16x16_to_f32((const uint16_t *)p + i);
}

#define MAX_G 16
#define MAX_D 256

/* One (decode, KV head, segment) work item: unnormalised output o[G][D], running max m[G] and sum l[G]
 * of exp(score - m) over tokens [t0, t1) of the request's cache, read in place through its block table. */
static void segment_partial(int dt, int64_t G, int64_t D, int64_t Hkv, int64_t h, const float *q,
                            const char *kc, const char *vc, int64_t block_size, const int32_t *blocks,
                            int64_t t0, int64_t t1, float scale, float *scores, float *o, float *m, float *l) {
    size_t es = dt == DT_F32 ? 4 : 2;
    int64_t n = t1 - t0, nv = D / 16;
    size_t token_bytes = (size_t)Hkv * D * es;
    /* Pass 1: scores[g][i] = scale * q_g . k_i */
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
    /* Softmax numerators per head, in place. */
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * n;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
        float mg = _mm512_reduce_max_ps(mx);
        for (; i < n; i++) mg = s[i] > mg ? s[i] : mg;
        __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(mg);
        for (i = 0; i < n; i += 16) {
            __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
            e = _mm512_maskz_mov_ps(k, e);
            _mm512_mask_storeu_ps(s + i, k, e);
            sum = _mm512_add_ps(sum, e);
        }
        m[g] = mg;
        l[g] = _mm512_reduce_add_ps(sum);
    }
    /* Pass 2: o_g = sum_i p[g][i] v_i */
    __m512 acc[MAX_G * (MAX_D / 16)];
    for (int64_t j = 0; j < G * nv; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        int64_t t = t0 + i;
        const char *vp = vc + ((size_t)blocks[t / block_size] * block_size + t % block_size) * token_bytes +
                         (size_t)h * D * es;
        for (int64_t c = 0; c < nv; c++) {
            __m512 vv = load16(vp, c * 16, dt);
            for (int64_t g = 0; g < G; g++)
                acc[g * nv + c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + i]), vv, acc[g * nv + c]);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(o + g * D + c * 16, acc[g * nv + c]);
}

/* Attention of n decode queries to their cached tokens, read in place through the block table.
 *
 * q: (T, >= Hq * D) of dt with row stride ldq, out: (T, Hq, D) of dt; decode j reads q row rows[j] and
 * writes out row rows[j] (query head
 * h*G + g uses KV head h, G = Hq / Hkv). cache: [2, num_blocks, block_size, Hkv, D] of dt.
 * block_table: (B, ld_bt) int32; decode j uses row req[j] and attends to its first lens[j] tokens
 * (its own token included, already written). Each decode's tokens are walked in segments of seg
 * tokens, one work item per (decode, KV head, segment), merged by log-sum-exp.
 * Needs D a multiple of 16 up to 256, G up to 16, lens >= 1. */
int sg_decode_attention(int dt, int64_t n, int64_t Hq, int64_t Hkv, int64_t D, const void *q, int64_t ldq, void *out,
                        const int64_t *rows, const void *cache, int64_t num_blocks, int64_t block_size,
                        const int32_t *block_table, int64_t ld_bt, const int64_t *req, const int64_t *lens,
                        int64_t seg, float scale) {
    int64_t G = Hq / Hkv;
    if (D % 16 || D > MAX_D || G > MAX_G || Hq % Hkv || seg < 1) return ERR_SHAPE;
    for (int64_t j = 0; j < n; j++)
        if (lens[j] < 1 || lens[j] > ld_bt * block_size) return ERR_SHAPE;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (n + 1)); /* first segment item of decode j */
    if (!first) return ERR_NOMEM;
    first[0] = 0;
    for (int64_t j = 0; j < n; j++) first[j + 1] = first[j] + (lens[j] + seg - 1) / seg;
    int64_t nseg = first[n], items = nseg * Hkv;
    float *po = (float *)malloc(sizeof(float) * items * G * D);
    float *pm = (float *)malloc(sizeof(float) * items * G);
    float *pl = (float *)malloc(sizeof(float) * items * G);
    int failed = !po || !pm || !pl;
    size_t es = dt == DT_F32 ? 4 : 2;
    const char *kc = (const char *)cache;
    const char *vc = kc + (size_t)num_blocks * block_size * Hkv * D * es;
    if (!failed) {
#pragma omp parallel
        {
            float *scores = (float *)malloc(sizeof(float) * G * (seg + 16));
            float qf[MAX_G * MAX_D];
            if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                if (!scores) continue;
                int64_t sidx = it / Hkv, h = it % Hkv, j = 0;
                int64_t lo = 0, hi = n - 1; /* decode j with first[j] <= sidx < first[j + 1] */
                while (lo < hi) {
                    int64_t mid = (lo + hi + 1) / 2;
                    if (first[mid] <= sidx) lo = mid;
                    else hi = mid - 1;
                }
                j = lo;
                int64_t s = sidx - first[j], t0 = s * seg, t1 = t0 + seg < lens[j] ? t0 + seg : lens[j];
                for (int64_t g = 0; g < G; g++)
                    for (int64_t d = 0; d < D; d++)
                        qf[g * D + d] = load_dt(q, rows[j] * ldq + (h * G + g) * D + d, dt);
                segment_partial(dt, G, D, Hkv, h, qf, kc, vc, block_size, block_table + req[j] * ld_bt, t0,
                                t1, scale, scores, po + it * G * D, pm + it * G, pl + it * G);
            }
            free(scores);
        }
    }
    if (!failed) {
        /* Merge each (decode, KV head)'s segments: L = max m_s; o = sum o_s e^(m_s - L) / sum l_s e^(m_s - L). */
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < n * Hkv; p++) {
            int64_t j = p / Hkv, h = p % Hkv;
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
                for (int64_t d = 0; d < D; d++)
                    store_dt(out, (rows[j] * Hq + h * G + g) * D + d, o[d] / denom, dt);
            }
        }
    }
    free(first);
    free(po);
    free(pm);
    free(pl);
    return failed ? ERR_NOMEM : OK;
}
