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
 * Built and loaded at run time by kernels/cpu_attention.py through oscar/native_build.compile_library.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Vectors are the machine's: 16 floats with AVX-512, else 8 (AVX2). A 64-byte vector type on a 256-bit
 * machine is lowered by GCC through general registers and the stack (the float32 kernel then ran at 4.7
 * GFLOP/s on an AVX2-only EPYC, 5x slower than torch's SDPA). Scores and outputs sum in the same order at
 * either width; only the softmax's row sum (a horizontal add) rounds differently. */
#ifdef __AVX512F__
#define VL 16
#define CW 4    /* score columns per pass: RQ x 4 vectors = 16 of the 32 zmm registers */
#else
#define VL 8
#define CW 2    /* RQ x 2 accumulators + 2 key vectors + a broadcast: 11 of the 16 ymm registers */
#endif
#define NV (BK / VL)  /* vectors per key block */
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
#define BK 64   /* keys per block */
#define BQ 64   /* queries per block */
#define RQ 4    /* query rows computed together */

static inline vf ld(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vf v) { memcpy(p, &v, sizeof v); }
#if VL == 16
static inline vf bc(float x) { return (vf){x,x,x,x,x,x,x,x,x,x,x,x,x,x,x,x}; }  /* a broadcast (a loop is not) */
#else
static inline vf bc(float x) { return (vf){x,x,x,x,x,x,x,x}; }
#endif

/* exp(x) for x <= 0 (x = s - rowmax): 2^(x log2 e) = 2^n 2^f, f in [-1/2, 1/2], degree-6 polynomial
 * (relative error ~2e-7); below -87 the result is flushed to 0. */
static inline vf vexp(vf x) {
    const vf lo = bc(-87.0f);
    vi keep = x > lo;
    x = (vf)(((vi)x & keep) | ((vi)lo & ~keep));
    vf y = x * bc(1.4426950408889634f);
    vf n = (y + bc(12582912.0f)) - bc(12582912.0f);  /* round to nearest */
    vf f = y - n;
    vf p = bc(1.5353362e-4f);
    p = p * f + bc(1.3398874e-3f);
    p = p * f + bc(9.6181291e-3f);
    p = p * f + bc(5.5504109e-2f);
    p = p * f + bc(2.4022651e-1f);
    p = p * f + bc(6.9314718e-1f);
    p = p * f + bc(1.0f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf r = p * (vf)e;
    return (vf)((vi)r & keep);
}

static inline vf vmax(vf a, vf b) { vi gt = a > b; return (vf)(((vi)a & gt) | ((vi)b & ~gt)); }
#ifdef __AVX512F__
static inline float hmax(vf v) { return _mm512_reduce_max_ps((__m512)v); }
static inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }
#else
static inline float hmax(vf v) { float m = v[0]; for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m; return m; }
static inline float hsum(vf v) { float s = 0; for (int i = 0; i < VL; i++) s += v[i]; return s; }
#endif

/* One row's online-softmax step over a key block: scores sr (NV vectors = BK keys from k0) scaled and
 * masked beyond key lim, the running max *m and sum *l updated, p = exp(s - max) returned in p; the
 * factor that rescales the row's previous output is returned (0 for a padding row, live = 0). */
static inline float softmax_step(vf sr[NV], float scale, int64_t k0, int64_t lim, float *m, float *l,
                                 int live, vf p[NV]) {
    for (int c = 0; c < NV; c++) {
        vf sc = sr[c] * bc(scale);
        if (k0 + c * VL + VL - 1 > lim) {
            vi j;
            for (int i = 0; i < VL; i++) j[i] = (int32_t)(k0 + c * VL + i);
            vi ok = j <= (int32_t)lim;
            sc = (vf)(((vi)sc & ok) | ((vi)bc(-INFINITY) & ~ok));
        }
        sr[c] = sc;
    }
    vf mv = sr[0];
    for (int c = 1; c < NV; c++) mv = vmax(mv, sr[c]);
    float mx = hmax(mv);
    float mo = *m, mn = mo > mx ? mo : mx;
    float alpha = live ? expf(mo - mn) : 0.0f;  /* mo = -inf at the first block: 0 */
    vf sum = bc(0.0f);
    for (int c = 0; c < NV; c++) { p[c] = vexp(sr[c] - bc(mn)); sum += p[c]; }
    if (live) { *m = mn; *l = *l * alpha + hsum(sum); }
    return alpha;
}

/* A query block's state: rows r0..r1 (returned in *r1) with max -inf, sum 0, output 0; returns the
 * end of the keys its last row reads. */
static inline int64_t rows_init(float *acc, float *m, float *l, int64_t r0, int64_t Tq, int64_t Tk, int D,
                                int64_t off, int64_t *r1) {
    *r1 = r0 + BQ < Tq ? r0 + BQ : Tq;
    for (int64_t i = r0; i < *r1; i++) { m[i - r0] = -INFINITY; l[i - r0] = 0.0f; }
    memset(acc, 0, sizeof(float) * BQ * D);
    return *r1 + off < Tk ? *r1 + off : Tk;
}

/* Rows r0..r1 of a query block: out = acc / l, lse = max + log l. */
static inline void rows_finish(const float *acc, const float *m, const float *l, float *out, float *lse,
                               int64_t r0, int64_t r1, int D) {
    for (int64_t i = r0; i < r1; i++) {
        float inv = 1.0f / l[i - r0];
        for (int d = 0; d < D; d++) out[i * D + d] = acc[(i - r0) * D + d] * inv;
        lse[i] = m[i - r0] + logf(l[i - r0]);
    }
}

/* q (H, Tq, D), kt (Hkv, D, Tkp) keys transposed and zero-padded to Tkp = ceil(Tk/BK)*BK, v (Hkv, Tkp, D),
 * out (H, Tq, D), lse (H, Tq). Query i reads keys j <= i + off (and j < Tk). */
static inline __attribute__((always_inline)) void block(const float *q, const float *kt, const float *v, float *out, float *lse,
                  int64_t Tq, int64_t Tk, int64_t Tkp, int D, int64_t off, float scale, int64_t r0) {
    float acc[BQ * 256], m[BQ], l[BQ];
    int64_t r1, kend = rows_init(acc, m, l, r0, Tq, Tk, D, off, &r1);
    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
        for (int64_t i0 = r0; i0 < r1; i0 += RQ) {
            int nr = (int)(r1 - i0 < RQ ? r1 - i0 : RQ);
            if (i0 + nr - 1 + off < k0) continue;  /* no row of this quad reads a key of this block */
            vf s[RQ][NV];
            for (int c0 = 0; c0 < NV; c0 += CW) {  /* CW score columns of RQ rows in registers over the head dim */
                vf t[RQ][CW];
                for (int r = 0; r < RQ; r++) for (int c = 0; c < CW; c++) t[r][c] = bc(0.0f);
                for (int d = 0; d < D; d++) {
                    const float *kd = kt + (int64_t)d * Tkp + k0 + c0 * VL;
                    vf kk[CW];
                    for (int c = 0; c < CW; c++) kk[c] = ld(kd + c * VL);
                    for (int r = 0; r < RQ; r++) {
                        vf qd = bc(q[(i0 + (r < nr ? r : 0)) * D + d]);
                        for (int c = 0; c < CW; c++) t[r][c] += qd * kk[c];
                    }
                }
                for (int r = 0; r < RQ; r++) for (int c = 0; c < CW; c++) s[r][c0 + c] = t[r][c];
            }
            float alpha[RQ];
            vf p[RQ][NV];
            float pb[RQ][BK];
            for (int r = 0; r < RQ; r++) {
                int64_t lim = i0 + r + off < Tk - 1 ? i0 + r + off : Tk - 1;  /* last key this row reads */
                alpha[r] = softmax_step(s[r], scale, k0, lim, &m[i0 + r - r0], &l[i0 + r - r0], r < nr, p[r]);
                for (int c = 0; c < NV; c++) st(pb[r] + c * VL, p[r][c]);
            }
            for (int dc = 0; dc < D; dc += CW * VL) {  /* CW x VL output channels of RQ rows in registers */
                int w = D - dc < CW * VL ? (D - dc) / VL : CW;
                vf a[RQ][CW];
                for (int r = 0; r < RQ; r++) for (int c = 0; c < w; c++)
                    a[r][c] = r < nr ? ld(acc + (i0 + r - r0) * D + dc + c * VL) * bc(alpha[r]) : bc(0.0f);
                for (int j = 0; j < BK; j++) {
                    const float *vj = v + (k0 + j) * D + dc;
                    vf v_[CW];
                    for (int c = 0; c < w; c++) v_[c] = ld(vj + c * VL);
                    for (int r = 0; r < RQ; r++) {
                        vf pj = bc(pb[r][j]);
                        for (int c = 0; c < w; c++) a[r][c] += pj * v_[c];
                    }
                }
                for (int r = 0; r < nr; r++) for (int c = 0; c < w; c++) st(acc + (i0 + r - r0) * D + dc + c * VL, a[r][c]);
            }
        }
    }
    rows_finish(acc, m, l, out, lse, r0, r1, D);
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
    int64_t r1, kend = rows_init(acc, m, l, r0, Tq, Tk, D, off, &r1);
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
                int64_t lim = i0 + r + off < Tk - 1 ? i0 + r + off : Tk - 1;
                vf sr[NV] = {(vf)s[r][0], (vf)s[r][1], (vf)s[r][2], (vf)s[r][3]}, p[NV];
                alpha[r] = softmax_step(sr, scale, k0, lim, &m[i0 + r - r0], &l[i0 + r - r0], r < nr, p);
                for (int c = 0; c < 4; c++)
                    _mm256_store_si256((__m256i *)(pb[r] + c * 16), (__m256i)_mm512_cvtneps_pbh((__m512)p[c]));
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
                for (int r = 0; r < nr; r++) for (int c = 0; c < w; c++) st(acc + (i0 + r - r0) * D + dc + c * 16, (vf)a[r][c]);
            }
        }
    }
    rows_finish(acc, m, l, out, lse, r0, r1, D);
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
