/* Causal attention for CPU prefill and perplexity windows: flash attention (online softmax) in C.
 *
 * Why: torch's CPU flash kernel runs SmolLM2's 4k prefill attention at ~40 GFLOP/s on one core
 * (74 % of the prefill, bench/results/cpu_attention.json); its small tiles never reach the GEMM
 * speed of the same core. Here a block of BQ queries sweeps the keys in blocks of BK: RQ query
 * rows at a time hold their RQ x BK scores in registers (broadcast-FMA over the head dim), the
 * online softmax rescales the running output, and P @ V accumulates RQ rows x 64 channels in
 * registers (broadcast-FMA over the block's keys). Two entry points:
 *
 *   oscar_flash_causal       float32 q/k/v, float32 FMAs;
 *   oscar_flash_causal_bf16  bfloat16 q/k/v (a bf16 model's own values, exact), vdpbf16ps: pairs of
 *                            bf16 products summed in float32, P rounded to bf16 for P @ V (as any bf16
 *                            attention's P @ V); needs AVX512-BF16, else returns 2 (caller uses float32).
 *
 * Query i reads keys j <= i + off, j < Tk (off = Tk - Tq: the queries are the last Tq positions).
 * Scores, softmax, running max/sum and outputs are float32; the output is float32 and the
 * log-sum-exp is returned too (perplexity merges two attentions through it). exp is a degree-6
 * polynomial (relative error ~2e-7, flushed to 0 below e^-87). No -ffast-math: nothing is
 * reassociated beyond what is written. Tests: tests/test_cpu_attention.py, against float64 loops.
 *
 * Built and loaded at run time by pipeline/cpu_attention.py through pipeline/native.compile_library.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define BK 64   /* keys per block: 4 vectors */
#define BQ 64   /* queries per block */
#define RQ 4    /* query rows computed together: 16 score vectors in registers */

static inline v16f ld(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16f bc(float x) { return (v16f){x,x,x,x,x,x,x,x,x,x,x,x,x,x,x,x}; }

/* exp(x) for x <= 0 (x = s - rowmax): 2^(x log2 e) = 2^n 2^f, f in [-1/2, 1/2], degree-6 polynomial
 * (relative error ~2e-7); below -87 the result is flushed to 0. */
static inline v16f vexp(v16f x) {
    const v16f lo = bc(-87.0f);
    v16i keep = x > lo;
    x = (v16f)(((v16i)x & keep) | ((v16i)lo & ~keep));
    v16f y = x * bc(1.4426950408889634f);
    v16f n = (y + bc(12582912.0f)) - bc(12582912.0f);  /* round to nearest */
    v16f f = y - n;
    v16f p = bc(1.5353362e-4f);
    p = p * f + bc(1.3398874e-3f);
    p = p * f + bc(9.6181291e-3f);
    p = p * f + bc(5.5504109e-2f);
    p = p * f + bc(2.4022651e-1f);
    p = p * f + bc(6.9314718e-1f);
    p = p * f + bc(1.0f);
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16f r = p * (v16f)e;
    return (v16f)((v16i)r & keep);
}

static inline v16f vmax(v16f a, v16f b) { v16i gt = a > b; return (v16f)(((v16i)a & gt) | ((v16i)b & ~gt)); }
#ifdef __AVX512F__
static inline float hmax(v16f v) { return _mm512_reduce_max_ps((__m512)v); }
static inline float hsum(v16f v) { return _mm512_reduce_add_ps((__m512)v); }
#else
static inline float hmax(v16f v) { float m = v[0]; for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m; return m; }
static inline float hsum(v16f v) { float s = 0; for (int i = 0; i < 16; i++) s += v[i]; return s; }
#endif

/* q (H, Tq, D), kt (Hkv, D, Tkp) keys transposed and zero-padded to Tkp = ceil(Tk/BK)*BK, v (Hkv, Tkp, D),
 * out (H, Tq, D), lse (H, Tq). Query i reads keys j <= i + off (and j < Tk). */
static inline __attribute__((always_inline)) void block(const float *q, const float *kt, const float *v, float *out, float *lse,
                  int64_t Tq, int64_t Tk, int64_t Tkp, int D, int64_t off, float scale, int64_t r0) {
    float acc[BQ * 256], m[BQ], l[BQ];
    const int64_t r1 = r0 + BQ < Tq ? r0 + BQ : Tq;
    for (int64_t i = r0; i < r1; i++) { m[i - r0] = -INFINITY; l[i - r0] = 0.0f; }
    memset(acc, 0, sizeof(float) * BQ * D);
    int64_t kend = r1 - 1 + off + 1; if (kend > Tk) kend = Tk;
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        for (int64_t i0 = r0; i0 < r1; i0 += RQ) {
            int nr = (int)(r1 - i0 < RQ ? r1 - i0 : RQ);
            if (i0 + nr - 1 + off < k0) continue;  /* no row of this quad reads a key of this block */
            v16f s[RQ][4];
            for (int r = 0; r < RQ; r++) for (int c = 0; c < 4; c++) s[r][c] = bc(0.0f);
            for (int d = 0; d < D; d++) {
                const float *kd = kt + (int64_t)d * Tkp + k0;
                v16f k_0 = ld(kd), k_1 = ld(kd + 16), k_2 = ld(kd + 32), k_3 = ld(kd + 48);
                for (int r = 0; r < RQ; r++) {
                    v16f qd = bc(q[(i0 + (r < nr ? r : 0)) * D + d]);
                    s[r][0] += qd * k_0; s[r][1] += qd * k_1; s[r][2] += qd * k_2; s[r][3] += qd * k_3;
                }
            }
            float alpha[RQ];
            v16f p[RQ][4];
            float pb[RQ][BK];
            for (int r = 0; r < RQ; r++) {
                int64_t lim = i0 + r + off;  /* last key this row reads */
                if (lim > Tk - 1) lim = Tk - 1;
                float mx = -INFINITY;
                for (int c = 0; c < 4; c++) {
                    v16f sc = s[r][c] * bc(scale);
                    if (k0 + c * 16 + 15 > lim) {
                        v16i j = {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15};
                        j += (int32_t)(k0 + c * 16);
                        v16i ok = j <= (int32_t)lim;
                        sc = (v16f)(((v16i)sc & ok) | ((v16i)bc(-INFINITY) & ~ok));
                    }
                    s[r][c] = sc;
                }
                mx = hmax(vmax(vmax(s[r][0], s[r][1]), vmax(s[r][2], s[r][3])));
                float mo = m[i0 + r - r0];
                float mn = mo > mx ? mo : mx;
                alpha[r] = r < nr ? expf(mo - mn) : 0.0f;  /* mo = -inf at the first block: 0 */
                v16f sum = bc(0.0f);
                for (int c = 0; c < 4; c++) { p[r][c] = vexp(s[r][c] - bc(mn)); sum += p[r][c]; st(pb[r] + c * 16, p[r][c]); }
                if (r < nr) { m[i0 + r - r0] = mn; l[i0 + r - r0] = l[i0 + r - r0] * alpha[r] + hsum(sum); }
            }
            for (int dc = 0; dc < D; dc += 64) {
                int w = D - dc < 64 ? (D - dc) / 16 : 4;
                v16f a[RQ][4];
                for (int r = 0; r < RQ; r++) for (int c = 0; c < w; c++)
                    a[r][c] = r < nr ? ld(acc + (i0 + r - r0) * D + dc + c * 16) * bc(alpha[r]) : bc(0.0f);
                for (int j = 0; j < BK; j++) {
                    const float *vj = v + (k0 + j) * D + dc;
                    v16f v_[4];
                    for (int c = 0; c < w; c++) v_[c] = ld(vj + c * 16);
                    for (int r = 0; r < RQ; r++) {
                        v16f pj = bc(pb[r][j]);
                        for (int c = 0; c < w; c++) a[r][c] += pj * v_[c];
                    }
                }
                for (int r = 0; r < nr; r++) for (int c = 0; c < w; c++) st(acc + (i0 + r - r0) * D + dc + c * 16, a[r][c]);
            }
        }
    }
    for (int64_t i = r0; i < r1; i++) {
        float inv = 1.0f / l[i - r0];
        for (int d = 0; d < D; d++) out[i * D + d] = acc[(i - r0) * D + d] * inv;
        lse[i] = m[i - r0] + logf(l[i - r0]);
    }
}

int oscar_flash_causal(const float *q, const float *kt, const float *v, float *out, float *lse,
                       int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t Tkp, int D, int64_t off,
                       float scale, int threads) {
    if (D % 16 || D > 256 || H % Hkv) return 1;
    const int64_t nq = (Tq + BQ - 1) / BQ;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < H * nq; t++) {
        int64_t h = t / nq, b = nq - 1 - t % nq;  /* long blocks first */
        int64_t g = h / (H / Hkv);
#define CALL(DD) block(q + h * Tq * D, kt + g * D * Tkp, v + g * Tkp * D, out + h * Tq * D, lse + h * Tq, \
              Tq, Tk, Tkp, DD, off, scale, b * BQ)
        if (D == 64) CALL(64); else if (D == 128) CALL(128); else CALL(D);
    }
    return 0;
}

#ifdef __AVX512BF16__
/* The bfloat16 variant: q (H, Tq, D) bf16; kp (Hkv, D/2, Tkp, 2) keys as channel pairs; vp (Hkv, Tkp/2, D, 2)
 * values as key pairs. vdpbf16ps multiplies bf16 pairs exactly and accumulates in float32, two products per
 * lane: scores s_j += q_{2u} k_{j,2u} + q_{2u+1} k_{j,2u+1}; outputs o_c += p_j v_{j,c} + p_{j+1} v_{j+1,c}
 * with p rounded to bf16 (as a bf16 attention's P @ V). */
static inline __attribute__((always_inline)) void block_bf16(
        const uint16_t *q, const uint16_t *kp, const uint16_t *vp, float *out, float *lse,
        int64_t Tq, int64_t Tk, int64_t Tkp, int D, int64_t off, float scale, int64_t r0) {
    float acc[BQ * 256], m[BQ], l[BQ];
    const int64_t r1 = r0 + BQ < Tq ? r0 + BQ : Tq;
    for (int64_t i = r0; i < r1; i++) { m[i - r0] = -INFINITY; l[i - r0] = 0.0f; }
    memset(acc, 0, sizeof(float) * BQ * D);
    int64_t kend = r1 - 1 + off + 1; if (kend > Tk) kend = Tk;
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        for (int64_t i0 = r0; i0 < r1; i0 += RQ) {
            int nr = (int)(r1 - i0 < RQ ? r1 - i0 : RQ);
            if (i0 + nr - 1 + off < k0) continue;
            __m512 s[RQ][4];
            for (int r = 0; r < RQ; r++) for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();
            const uint32_t *qw[RQ];
            for (int r = 0; r < RQ; r++) qw[r] = (const uint32_t *)(q + (i0 + (r < nr ? r : 0)) * D);
            for (int u = 0; u < D / 2; u++) {
                const uint16_t *ku = kp + ((int64_t)u * Tkp + k0) * 2;
                __m512bh k_0 = (__m512bh)_mm512_loadu_si512(ku), k_1 = (__m512bh)_mm512_loadu_si512(ku + 32),
                         k_2 = (__m512bh)_mm512_loadu_si512(ku + 64), k_3 = (__m512bh)_mm512_loadu_si512(ku + 96);
                for (int r = 0; r < RQ; r++) {
                    __m512bh qu = (__m512bh)_mm512_set1_epi32((int)qw[r][u]);
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], qu, k_0); s[r][1] = _mm512_dpbf16_ps(s[r][1], qu, k_1);
                    s[r][2] = _mm512_dpbf16_ps(s[r][2], qu, k_2); s[r][3] = _mm512_dpbf16_ps(s[r][3], qu, k_3);
                }
            }
            float alpha[RQ];
            uint16_t pb[RQ][BK] __attribute__((aligned(64)));
            for (int r = 0; r < RQ; r++) {
                int64_t lim = i0 + r + off;
                if (lim > Tk - 1) lim = Tk - 1;
                v16f sr[4];
                for (int c = 0; c < 4; c++) {
                    v16f sc = (v16f)s[r][c] * bc(scale);
                    if (k0 + c * 16 + 15 > lim) {
                        v16i j = {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15};
                        j += (int32_t)(k0 + c * 16);
                        v16i ok = j <= (int32_t)lim;
                        sc = (v16f)(((v16i)sc & ok) | ((v16i)bc(-INFINITY) & ~ok));
                    }
                    sr[c] = sc;
                }
                float mx = hmax(vmax(vmax(sr[0], sr[1]), vmax(sr[2], sr[3])));
                float mo = m[i0 + r - r0];
                float mn = mo > mx ? mo : mx;
                alpha[r] = r < nr ? expf(mo - mn) : 0.0f;
                v16f sum = bc(0.0f);
                for (int c = 0; c < 4; c++) {
                    v16f p = vexp(sr[c] - bc(mn)); sum += p;
                    _mm256_store_si256((__m256i *)(pb[r] + c * 16), (__m256i)_mm512_cvtneps_pbh((__m512)p));
                }
                if (r < nr) { m[i0 + r - r0] = mn; l[i0 + r - r0] = l[i0 + r - r0] * alpha[r] + hsum(sum); }
            }
            for (int dc = 0; dc < D; dc += 64) {
                int w = D - dc < 64 ? (D - dc) / 16 : 4;
                __m512 a[RQ][4];
                for (int r = 0; r < RQ; r++) for (int c = 0; c < w; c++)
                    a[r][c] = r < nr ? (__m512)(ld(acc + (i0 + r - r0) * D + dc + c * 16) * bc(alpha[r])) : _mm512_setzero_ps();
                for (int j = 0; j < BK; j += 2) {
                    const uint16_t *vj = vp + (((k0 + j) / 2) * D + dc) * 2;  /* (v_{j,c}, v_{j+1,c}) pairs */
                    __m512bh v_[4];
                    for (int c = 0; c < w; c++) v_[c] = (__m512bh)_mm512_loadu_si512(vj + c * 32);
                    for (int r = 0; r < RQ; r++) {
                        __m512bh pj = (__m512bh)_mm512_set1_epi32((int)*(const uint32_t *)(pb[r] + j));
                        for (int c = 0; c < w; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], pj, v_[c]);
                    }
                }
                for (int r = 0; r < nr; r++) for (int c = 0; c < w; c++) st(acc + (i0 + r - r0) * D + dc + c * 16, (v16f)a[r][c]);
            }
        }
    }
    for (int64_t i = r0; i < r1; i++) {
        float inv = 1.0f / l[i - r0];
        for (int d = 0; d < D; d++) out[i * D + d] = acc[(i - r0) * D + d] * inv;
        lse[i] = m[i - r0] + logf(l[i - r0]);
    }
}
#endif

int oscar_flash_causal_bf16(const uint16_t *q, const uint16_t *kp, const uint16_t *vp, float *out, float *lse,
                            int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t Tkp, int D, int64_t off,
                            float scale, int threads) {
#ifdef __AVX512BF16__
    if (D % 32 || D > 256 || H % Hkv) return 1;
    const int64_t nq = (Tq + BQ - 1) / BQ;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < H * nq; t++) {
        int64_t h = t / nq, b = nq - 1 - t % nq;
        int64_t g = h / (H / Hkv);
#define CALLB(DD) block_bf16(q + h * Tq * D, kp + g * D * Tkp, vp + g * Tkp * D, out + h * Tq * D, lse + h * Tq, \
              Tq, Tk, Tkp, DD, off, scale, b * BQ)
        if (D == 64) CALLB(64); else if (D == 128) CALLB(128); else CALLB(D);
    }
    return 0;
#else
    return 2;  /* no AVX512-BF16 on the build machine: the caller uses the float32 kernel */
#endif
}
