/* One pass over a sequence's captured rows: per-head float64 Gram and per-channel moments.
 *
 * As torch ops the capture's statistics cost a float64 copy of every row (MKL's dgemm wants
 * float64 operands) plus five passes for x^2, x^3, x^4, their sums and the |x| maximum: ~65 MB
 * of memory traffic per SmolLM2 layer and sequence, more than the layer's own forward. Here
 * each row is read once (float32 or float64, any head/row stride, channels contiguous),
 * widened in registers and folded into
 *   - the head's Gram sum_t x_t x_t^T, upper triangle only (it is symmetric: half the FMAs),
 *     four rows per sweep so that each load/store of the L1-resident Gram feeds four FMAs;
 *   - sum x, sum x^3, sum x^4 and max x^2 per channel.
 * Products of float32 values are exact in float64; every sum runs in row order in float64 (no
 * -ffast-math: nothing is reassociated across rows). Accuracy is that of a float64 dot product;
 * the tests compare against brute-force loops to 1e-10.
 *
 * oscar_sequence adds all of one sequence's statistics to a layer's totals and picks its reservoir candidates in
 * one call: the capture's per-sequence work, no torch op in between.
 *
 * Built by oscar/native_build.py and loaded by pipeline/native.py (C11 + OpenMP, no Python or torch
 * headers); torch ops are the fallback and the reference in the tests.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAXD 512   /* the Python side checks it too */

typedef struct {
    const void *base;   /* first element of the source's first head, first row */
    int64_t heads;      /* heads in this source */
    int64_t s_head;     /* element strides */
    int64_t s_row;
} oscar_src;

/* One sequence's reservoir candidates of one kind (k/v: G = 1; q/o: the query group): of its n G keys (key i:
 * row row0 + i / G, group member i % G), the R smallest with their rows (oscar_reservoir below). */
typedef struct {
    const double *key;  /* n G keys */
    int64_t G, R;
    int64_t *idx;       /* n G scratch */
    double *out_key;    /* (R,) the chosen keys */
    float *out_rows;    /* (R, 2H, D) their rows: heads hG+g of a, then of b */
    int64_t count;      /* set: how many were chosen, min(R, n G) */
} oscar_res;

typedef struct {
    int is_f64;
    int64_t row0, nrows, D, htot;
    double *gram;       /* (Htot, D, D) */
    double *mom;        /* (3, Htot, D): sum x, sum x^3, sum x^4 */
    double *max2;       /* (Htot, D): max x^2 */
} job;

/* Rows are handled in blocks of RB: each block is widened to float64 once into a buffer that
 * stays in L1/L2, then the moments and every Gram tile sweep it. */
#define RB 64

/* Vectors are the machine's: 8 doubles with AVX-512, else 4 (AVX2). A 64-byte vector type on a 256-bit
 * machine is lowered by GCC through general registers and the stack, and sixteen of them spill AVX2's
 * sixteen registers. The tiles below are sized in vectors; every sum runs in row order whatever the width
 * (the Gram and the moments are bit-identical across widths; the value target's weights sum their lanes
 * in another order). */
#ifdef __AVX512F__
#define VL 8
#define TI 8    /* Gram tile rows: TI x 2 accumulators = 16 of the 32 zmm registers */
#else
#define VL 4
#define TI 4    /* TI x 2 accumulators + 2 row vectors + a broadcast: 11 of the 16 ymm registers */
#endif
#define TC (2 * VL)  /* Gram tile columns */
typedef double vd __attribute__((vector_size(VL * 8)));
typedef long long vl __attribute__((vector_size(VL * 8)));

static inline vd load(const double *p) { vd v; memcpy(&v, p, sizeof v); return v; }
static inline void store(double *p, vd v) { memcpy(p, &v, sizeof v); }
#if VL == 8
static inline vd bcd(double x) { return (vd){x, x, x, x, x, x, x, x}; }
#else
static inline vd bcd(double x) { return (vd){x, x, x, x}; }
#endif

/* Rows r0 .. r0+m of head hs of source s, widened into out (m, D) float64. */
static void widen(const oscar_src *s, int is_f64, int64_t hs, int64_t r0, int64_t m, int64_t D, double *restrict out) {
    for (int64_t r = 0; r < m; r++) {
        const int64_t off = hs * s->s_head + r0 * s->s_row + r * s->s_row;
        double *o = out + r * D;
        if (is_f64) {
            const double *x = (const double *)s->base + off;
            for (int64_t d = 0; d < D; d++) o[d] = x[d];
        } else {
            const float *x = (const float *)s->base + off;
            for (int64_t d = 0; d < D; d++) o[d] = (double)x[d];
        }
    }
}

static inline vd vmax(vd a, vd b) {  /* a > b ? a : b per lane; a NaN lane keeps b */
    vl k = a > b;
    return (vd)(((vl)a & k) | ((vl)b & ~k));
}

/* Per-channel sum x, x^3, x^4 and max x^2 of the block, in row order (v^2 is exact for float32
 * inputs; NaN rows are found by the caller in s1). 2 VL channels at a time: eight vector
 * accumulators in registers, two independent chains each, so the adds don't wait on latency. */
static void moments(const double *restrict buf, int64_t m, int64_t D, double *restrict s1, double *restrict s3,
                    double *restrict s4, double *restrict mx) {
    int64_t c = 0;
    for (; c + 2 * VL <= D; c += 2 * VL) {
        vd a1 = load(s1 + c), b1 = load(s1 + c + VL), a3 = load(s3 + c), b3 = load(s3 + c + VL);
        vd a4 = load(s4 + c), b4 = load(s4 + c + VL), am = load(mx + c), bm = load(mx + c + VL);
        const double *x = buf + c;
        for (int64_t r = 0; r < m; r++, x += D) {
            const vd u = load(x), v = load(x + VL), u2 = u * u, v2 = v * v;
            a1 += u;       b1 += v;
            a3 += u2 * u;  b3 += v2 * v;
            a4 += u2 * u2; b4 += v2 * v2;
            am = vmax(u2, am); bm = vmax(v2, bm);
        }
        store(s1 + c, a1); store(s1 + c + VL, b1); store(s3 + c, a3); store(s3 + c + VL, b3);
        store(s4 + c, a4); store(s4 + c + VL, b4); store(mx + c, am); store(mx + c + VL, bm);
    }
    for (; c < D; c++)
        for (int64_t r = 0; r < m; r++) {
            const double v = buf[r * D + c], v2 = v * v;
            s1[c] += v;
            s3[c] += v2 * v;
            s4[c] += v2 * v2;
            mx[c] = v2 > mx[c] ? v2 : mx[c];
        }
}

/* Gram tile g[i:i+TI, c:c+TC] += sum_r a[r, i:i+TI]^T b[r, c:c+TC] (a = b: the Gram; a = w b: the
 * weighted one of the value target). The TI x TC partial sums are 2 TI vectors held in registers
 * across the block, so a row costs two vector loads, TI broadcasts and 2 TI independent FMAs (enough
 * to hide the FMA latency on two ports). Tiles left of the diagonal are skipped (mirrored at the
 * end). Needs D % 16 == 0 (a multiple of TI and TC at either width). */
static void gram_tiles(double *restrict g, const double *restrict a_, const double *restrict b_, int64_t m, int64_t D) {
    for (int64_t i = 0; i < D; i += TI)
        for (int64_t c = i & ~(int64_t)(TC - 1); c < D; c += TC) {
            vd a[TI][2];
            for (int k = 0; k < TI; k++) {
                a[k][0] = load(g + (i + k) * D + c);
                a[k][1] = load(g + (i + k) * D + c + VL);
            }
            const double *x = a_, *y = b_;
            for (int64_t r = 0; r < m; r++, x += D, y += D) {
                const vd y0 = load(y + c), y1 = load(y + c + VL);
                for (int k = 0; k < TI; k++) {
                    const vd xk = bcd(x[i + k]);
                    a[k][0] += xk * y0;
                    a[k][1] += xk * y1;
                }
            }
            for (int k = 0; k < TI; k++) {
                store(g + (i + k) * D + c, a[k][0]);
                store(g + (i + k) * D + c + VL, a[k][1]);
            }
        }
}

/* Any D (small test shapes, odd head dims): one row at a time into the upper triangle. */
static void gram_plain(double *restrict g, const double *restrict a, const double *restrict b, int64_t m, int64_t D) {
    for (int64_t r = 0; r < m; r++) {
        const double *x = a + r * D, *y = b + r * D;
        for (int64_t i = 0; i < D; i++)
            for (int64_t c = i; c < D; c++) g[i * D + c] += x[i] * y[c];
    }
}

static void gram(double *restrict g, const double *a, const double *b, int64_t m, int64_t D) {
    if (D % 16 == 0) gram_tiles(g, a, b, m, D); else gram_plain(g, a, b, m, D);
}

static void mirror(double *g, int64_t D) {  /* lower triangle <- upper */
    for (int64_t i = 1; i < D; i++)
        for (int64_t c = 0; c < i; c++) g[i * D + c] = g[c * D + i];
}

static void one_head(const job *j, const oscar_src *s, int64_t hs, int64_t h, double *restrict buf) {
    const int64_t D = j->D, n = j->nrows, H = j->htot;
    double *restrict g = j->gram + h * D * D;
    double *restrict s1 = j->mom + h * D, *restrict s3 = j->mom + (H + h) * D;
    double *restrict s4 = j->mom + (2 * H + h) * D, *restrict mx = j->max2 + h * D;
    memset(g, 0, sizeof(double) * D * D);
    for (int64_t d = 0; d < D; d++) s1[d] = s3[d] = s4[d] = mx[d] = 0.0;
    for (int64_t r0 = 0; r0 < n; r0 += RB) {
        const int64_t m = n - r0 < RB ? n - r0 : RB;
        widen(s, j->is_f64, hs, j->row0 + r0, m, D, buf);
        moments(buf, m, D, s1, s3, s4, mx);
        gram(g, buf, buf, m, D);
    }
    mirror(g, D);
}

/* fn(ctx, h, buf) for h in [0, nheads), heads shared out with OpenMP, each thread with its own
 * 64-byte aligned scratch of buf_doubles. The library links libgomp.so.1, which resolves to the
 * copy torch already loaded, so this loop runs on torch's own thread team instead of competing
 * with it. Heads, never rows, are split: results do not depend on the thread count.
 * Returns 0, or -2 when a thread could not get its scratch. */
typedef void (*head_fn)(const void *ctx, int64_t h, double *buf);

/* A thread's 64-byte aligned scratch of n doubles; NULL (and *failed set) when out of memory. */
static double *thread_scratch(size_t n, int *failed) {
    double *buf = aligned_alloc(64, (sizeof(double) * n + 63) & ~(size_t)63);  /* aligned_alloc: a multiple of 64 */
    if (!buf) {
        #pragma omp atomic write
        *failed = 1;
    }
    return buf;
}

static int for_each_head(head_fn fn, const void *ctx, int64_t nheads, size_t buf_doubles, int nthreads) {
    int failed = 0;
    #pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
    {
        double *buf = thread_scratch(buf_doubles, &failed);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t h = 0; h < nheads; h++)
            if (buf) fn(ctx, h, buf);
        free(buf);
    }
    return failed ? -2 : 0;
}

typedef struct {
    job j;
    const oscar_src *src;
    int nsrc;
    int64_t first[64];  /* global index of each source's first head */
} gm_ctx;

static void gm_head(const void *ctx_, int64_t h, double *buf) {
    const gm_ctx *c = ctx_;
    int i = 0;
    while (i + 1 < c->nsrc && c->first[i + 1] <= h) i++;
    one_head(&c->j, &c->src[i], h - c->first[i], h, buf);
}

/* Rows row0 .. row0+nrows of every head of `src` (nsrc sources, heads numbered in order).
 * Returns 0, -1 when D or nsrc is out of range, -2 when out of memory. */
int oscar_gram_moments(const oscar_src *src, int nsrc, int is_f64, int64_t row0, int64_t nrows, int64_t D,
                       double *gram, double *mom, double *max2, int nthreads) {
    if (nsrc > 64 || D > MAXD || D < 1) return -1;
    gm_ctx c = {.src = src, .nsrc = nsrc};
    int64_t htot = 0;
    for (int i = 0; i < nsrc; i++) { c.first[i] = htot; htot += src[i].heads; }
    c.j = (job){is_f64, row0, nrows, D, htot, gram, mom, max2};
    return for_each_head(gm_head, &c, htot, RB * MAXD, nthreads);
}

/* w[r] = k_r^T C k_r for the block's rows k (m, D), C (D, D) symmetric. Tiled like the Gram: for
 * TI rows and TC columns, y = k C accumulates in registers over i, then its dot with k's columns is
 * added to w. */
static void weights(const double *restrict k, const double *restrict C, int64_t m, int64_t D, double *restrict w) {
    int64_t r = 0;
    for (int64_t q = 0; q < m; q++) w[q] = 0.0;
    if (D % 16 == 0)
        for (; r + TI <= m; r += TI)
            for (int64_t c = 0; c < D; c += TC) {
                vd a[TI][2];
                for (int q = 0; q < TI; q++) a[q][0] = a[q][1] = bcd(0.0);
                for (int64_t i = 0; i < D; i++) {
                    const vd c0 = load(C + i * D + c), c1 = load(C + i * D + c + VL);
                    for (int q = 0; q < TI; q++) {
                        const vd kq = bcd(k[(r + q) * D + i]);
                        a[q][0] += kq * c0;
                        a[q][1] += kq * c1;
                    }
                }
                for (int q = 0; q < TI; q++) {
                    const vd t = a[q][0] * load(k + (r + q) * D + c) + a[q][1] * load(k + (r + q) * D + c + VL);
                    double acc = 0.0;
                    for (int l = 0; l < VL; l++) acc += t[l];
                    w[r + q] += acc;
                }
            }
    for (; r < m; r++)  /* rows left over (and any D) */
        for (int64_t i = 0; i < D; i++) {
            double y = 0.0;
            for (int64_t c = 0; c < D; c++) y += C[i * D + c] * k[r * D + c];
            w[r] += k[r * D + i] * y;
        }
}

typedef struct {
    const oscar_src *k, *v;
    int is_f64;
    int64_t row0, nrows, D;
    const double *C;
    double *vw, *wsum;
} vt_ctx;

static void vt_head(const void *ctx_, int64_t h, double *kb) {
    const vt_ctx *c = ctx_;
    const int64_t D = c->D;
    double *vb = kb + RB * MAXD, *wv = vb + RB * MAXD, *w = wv + RB * MAXD;
    double *g = c->vw + h * D * D, ws = 0.0;
    memset(g, 0, sizeof(double) * D * D);
    for (int64_t r0 = 0; r0 < c->nrows; r0 += RB) {
        const int64_t m = c->nrows - r0 < RB ? c->nrows - r0 : RB;
        widen(c->k, c->is_f64, h, c->row0 + r0, m, D, kb);
        widen(c->v, c->is_f64, h, c->row0 + r0, m, D, vb);
        weights(kb, c->C + h * D * D, m, D, w);
        for (int64_t r = 0; r < m; r++) {
            ws += w[r];
            for (int64_t d = 0; d < D; d++) wv[r * D + d] = w[r] * vb[r * D + d];
        }
        gram(g, wv, vb, m, D);
    }
    mirror(g, D);
    c->wsum[h] = ws;
}

/* The value target of one sequence (docs/decisions/0015-capture-value-target-w-t-v-t-v-t-uses-the-c-q-of.md): for every KV head h, with w_t = k_t^T C_h k_t,
 *   vw[h] <- sum_t w_t v_t v_t^T (D, D),  wsum[h] <- sum_t w_t,
 * over rows row0 .. row0+nrows of k and v (each one source of H heads). C: (H, D, D) float64.
 * Returns 0 / -1 / -2. */
int oscar_value_target(const oscar_src *k, const oscar_src *v, int is_f64, int64_t row0, int64_t nrows, int64_t D,
                       const double *C, double *vw, double *wsum, int nthreads) {
    if (D > MAXD || D < 1 || k->heads != v->heads) return -1;
    vt_ctx c = {k, v, is_f64, row0, nrows, D, C, vw, wsum};
    return for_each_head(vt_head, &c, k->heads, 3 * RB * MAXD + RB, nthreads);  /* k, v, w*v blocks + w */
}

/* The reservoir's candidates of one sequence: of the N = n G keys (n rows row0 .. row0+n, G keys per row; key
 * i belongs to row i / G and group member g = i % G), the R smallest (all N when N <= R), in no particular
 * order, with their rows gathered as float32: out_rows[j] (2H, D) = heads hG+g of a, then heads hG+g of b, for
 * h < H, at the key's row (k and v with G = 1; q and o with the query group). The sampling keeps the R
 * smallest keys of the block, so the order here never matters; keys are distinct uniforms. */
static void select_smallest(const double *key, int64_t *idx, int64_t N, int64_t R) {
    int64_t lo = 0, hi = N - 1;  /* quickselect: idx[0 .. R) end up holding the R smallest keys */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        double a = key[idx[lo]], b = key[idx[mid]], c = key[idx[hi]];
        const double pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (key[idx[i]] < pivot) i++;
            while (key[idx[j]] > pivot) j--;
            if (i <= j) { int64_t t = idx[i]; idx[i] = idx[j]; idx[j] = t; i++; j--; }
        }
        if (R - 1 <= j) hi = j;
        else if (R - 1 >= i) lo = i;
        else break;
    }
}

static void reservoir_into(oscar_res *r, int64_t n, const oscar_src *a, const oscar_src *b, int is_f64, int64_t row0,
                           int64_t H, int64_t D) {
    const int64_t G = r->G, N = n * G, m = N < r->R ? N : r->R;
    for (int64_t i = 0; i < N; i++) r->idx[i] = i;
    if (N > r->R) select_smallest(r->key, r->idx, N, r->R);
    for (int64_t j = 0; j < m; j++) {
        const int64_t t = row0 + r->idx[j] / G, g = r->idx[j] % G;
        r->out_key[j] = r->key[r->idx[j]];
        for (int s = 0; s < 2; s++) {
            const oscar_src *p = s ? b : a;
            for (int64_t h = 0; h < H; h++) {
                const int64_t off = (h * G + g) * p->s_head + t * p->s_row;
                float *o = r->out_rows + (j * 2 * H + s * H + h) * D;
                if (is_f64) for (int64_t d = 0; d < D; d++) o[d] = (float)((const double *)p->base)[off + d];
                else memcpy(o, (const float *)p->base + off, sizeof(float) * D);
            }
        }
    }
    r->count = m;
}

/* One kind's candidates on their own (the tests' entry; oscar_sequence does both kinds inside its call).
 * Returns the count. */
int64_t oscar_reservoir(oscar_res *r, int64_t n, const oscar_src *a, const oscar_src *b, int is_f64, int64_t row0,
                        int64_t H, int64_t D) {
    reservoir_into(r, n, a, b, is_f64, row0, H, D);
    return r->count;
}

/* One sequence of one layer, everything the capture adds for it, in one call (one thread team, no torch op
 * between the steps; on the 2-core host each torch op right after a parallel region cost 0.07-0.2 ms):
 *   1. every head's Gram and moments into `scratch` (as oscar_gram_moments);
 *   2. NaN/Inf anywhere: return 1 with nothing added (the caller redoes the sequence with torch ops and
 *      drops those rows);
 *   3. the running totals += this sequence's (gram, mom; max2 <- max);
 *   4. C_Q of each KV head from this sequence's own query Grams, sum_g G_{hG+g} / (n G) (the query heads of
 *      KV head h are hG .. hG+G-1), and the value target with it (as oscar_value_target) added to vw, wsum;
 *   5. with res (two: k/v then q/o, else NULL), the reservoir candidates of both kinds (oscar_reservoir), two more
 *      tasks beside the heads' (the caller ignores them when 1 is returned).
 * src: q (Hq heads), k (H), v (H), o (Hq), Hq = H G. The sums and their order are those of the separate
 * calls and the torch adds between them. scratch: Htot D D + 4 Htot D + 2 H D D + H doubles.
 * Returns 0 (added), 1 (non-finite rows, nothing added), -1 (shapes), -2 (out of memory). */
int oscar_sequence(const oscar_src *src, int is_f64, int64_t row0, int64_t nrows, int64_t D, int64_t H, int64_t G,
                   double *gram, double *mom, double *max2, double *vw, double *wsum, double *scratch, oscar_res *res,
                   int nthreads) {
    const int64_t Hq = H * G, htot = 2 * Hq + 2 * H;
    if (D > MAXD || D < 1 || H < 1 || G < 1 || src[0].heads != Hq || src[1].heads != H || src[2].heads != H
        || src[3].heads != Hq || (res && (res[0].G != 1 || res[1].G != G)))
        return -1;
    const int64_t ntasks = htot + (res ? 2 : 0);
    double *sg = scratch, *sm = sg + htot * D * D, *sx = sm + 3 * htot * D;
    double *cq = sx + htot * D, *svw = cq + H * D * D, *sws = svw + H * D * D;
    gm_ctx c = {.src = src, .nsrc = 4};
    for (int i = 0, h = 0; i < 4; h += (int)src[i].heads, i++) c.first[i] = h;
    c.j = (job){is_f64, row0, nrows, D, htot, sg, sm, sx};
    vt_ctx vt = {&src[1], &src[2], is_f64, row0, nrows, D, cq, svw, sws};
    const double denom = (double)(nrows * G);
    int failed = 0, finite = 1;
    #pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
    {
        double *buf = thread_scratch(3 * RB * MAXD + RB, &failed);  /* vt_head's k, v, w*v blocks + w */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t h = 0; h < ntasks; h++)
            if (h >= htot)  /* the reservoir: k/v (sources 1, 2), then q/o (sources 0, 3) */
                reservoir_into(&res[h - htot], nrows, &src[h == htot ? 1 : 0], &src[h == htot ? 2 : 3], is_f64, row0,
                               H, D);
            else if (buf)
                gm_head(&c, h, buf);
        #pragma omp single
        {
            for (int64_t i = 0; i < 3 * htot * D; i++)
                if (sm[i] - sm[i] != 0.0) { finite = 0; break; }  /* x - x is NaN for NaN and +-Inf */
        }
        if (finite && !failed) {  /* the same branch in every thread: both flags were set before a barrier */
            #pragma omp for schedule(static)
            for (int64_t h = 0; h < htot; h++) {
                double *g = gram + h * D * D;
                const double *s = sg + h * D * D;
                for (int64_t i = 0; i < D * D; i++) g[i] += s[i];
                for (int m = 0; m < 3; m++)
                    for (int64_t d = 0; d < D; d++) mom[(m * htot + h) * D + d] += sm[(m * htot + h) * D + d];
                for (int64_t d = 0; d < D; d++) {
                    const double x = sx[h * D + d], *t = max2 + h * D + d;
                    max2[h * D + d] = x > *t ? x : *t;
                }
            }
            if (nrows > 0) {  /* no rows: no C_Q (0/0), nothing to add */
            #pragma omp for schedule(static)
            for (int64_t h = 0; h < H; h++) {
                double *q = cq + h * D * D;
                const double *s = sg + h * G * D * D;
                for (int64_t i = 0; i < D * D; i++) q[i] = s[i];
                for (int64_t g = 1; g < G; g++)
                    for (int64_t i = 0; i < D * D; i++) q[i] += s[g * D * D + i];
                for (int64_t i = 0; i < D * D; i++) q[i] /= denom;
            }
            #pragma omp for schedule(dynamic, 1)
            for (int64_t h = 0; h < H; h++)
                if (buf) {
                    vt_head(&vt, h, buf);
                    double *g = vw + h * D * D;
                    const double *s = svw + h * D * D;
                    for (int64_t i = 0; i < D * D; i++) g[i] += s[i];
                    wsum[h] += sws[h];
                }
            }
        }
        free(buf);
    }
    return failed ? -2 : finite ? 0 : 1;
}

