/* The body of one fused decoder layer (see decode_f32.c for what it computes), for any weight type.
 *
 * The including file defines, before including this:
 *   W                 the type of weights, norms, biases, cos/sin and the KV cache (float or bf16 bits)
 *   LOADW(v)          a W value as float;  STOREW(f): a float as W;  VLOADW(p): VL of them as a vector
 *   DECODE(name)      the exported names (decode_f32_layer, ...)
 *   WLIN              (optional) the type the linears' weight pointers point to; W unless defined
 *   LINEAR(x, w, b, y, M, N, K, nt)   y[M, N] (float) = x[M, K] (float) @ w[N, K]^T + b, w laid out as
 *                     that LINEAR reads it (float32: packed in panels, linear_f32.c); it may use
 *                     `scratch` (M * K values of W) for its input
 *   LINEAR_THEN(x, w, b, y, M, N, K, nt, wn, Nn, Kn)   (optional) LINEAR, told the weight wn [Nn, Kn]
 *                     the call after it reads (wn 0: none), to prefetch its start; LINEAR unless defined
 * Activations and the residual stream are float32 whatever W is. The KV cache is W too unless the file
 * defines WKV (its element type) with LOADKV(v), STOREKV(f) and VLOADKV(p) as for W (decode_q_kv16.c:
 * float32 weights and norms, K/V in bf16: half the bytes attention reads).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef WLIN
#define WLIN W /* the linears' weights; a quantized build has them as block structs (decode_q.c) */
#endif
#ifndef LINEAR_THEN
#define LINEAR_THEN(x, w, b, y, M, N, K, nt, wn, Nn, Kn) LINEAR(x, w, b, y, M, N, K, nt)
#endif
#ifndef WKV
#define WKV W
#define LOADKV(v) LOADW(v)
#define STOREKV(f) STOREW(f)
#define VLOADKV(p) VLOADW(p)
#endif

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps, scale;
    const W *ln1, *ln2;
    const WLIN *w_qkv, *w_o, *w_gate_up, *w_down;
    const W *b_qkv, *b_o, *b_gate_up, *b_down;
    WKV *kv;
    int64_t num_blocks, block_size;
} Layer;

typedef struct {
    int64_t num_rows;            /* M decode rows, one token each */
    float *hidden;               /* [M, H] float32 whatever W: in: the layer's input; out: its output */
    float *residual;             /* [M, H] float32, in/out; written from hidden when first */
    int64_t first;               /* 1 on the first layer */
    const W *cos_sin;            /* [M, D]: cos half | sin half at each row's position */
    const int64_t *slots;        /* [M] cache slot of each row's token */
    const int64_t *block_tables; /* [M, table_width] */
    int64_t table_width;
    const int64_t *seq_lens;     /* [M] context including the new token */
    int64_t sliding_window;      /* 0: full attention */
    float *work;                 /* DECODE(work_floats)() floats */
    int64_t num_threads;
    const int64_t *unit_starts;  /* [num_units + 1]: attention's units, DECODE(attention_units) */
    int64_t num_units;
    const uint8_t *in_prompt;    /* [M] 1: a prompt's token (attends in a tile), 0: an output token */
} Step;

#define KEY_CHUNK 32
#define MAX_HEAD_DIM 256

/* Vectors for attention: a chunk of VL keys is dotted with q as VL accumulators reduced together
 * (transposed: ~2 instructions a key where a horizontal sum took ~8). VLOADW(p): VL values of W. */
#include "reduce16.h"
#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VLOADF(p) _mm512_loadu_ps(p)
#define VSTOREF(p, v) _mm512_storeu_ps(p, v)
#define reduce_keys reduce16_avx512
#else
#define VL 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VLOADF(p) _mm256_loadu_ps(p)
#define VSTOREF(p, v) _mm256_storeu_ps(p, v)
static inline vf reduce_keys(const vf a[VL]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
#define MAX_GROUP 16
#define ROWS_PARALLEL 8 /* rows from which the per-row work between the linears runs on every thread */

int64_t DECODE(work_floats)(const Layer *L, int64_t num_rows) {
    int64_t qkv = (L->num_heads + 2 * L->num_kv_heads) * L->head_dim;
    int64_t widest = L->inter > L->hidden ? L->inter : L->hidden;
    if (L->num_heads * L->head_dim > widest) widest = L->num_heads * L->head_dim;
    /* + the linears' input in W, or in blocks (decode_q.c: with its scales and alignment, within
     * widest + 16 floats a row) */
    return num_rows * (2 * L->hidden + qkv + L->num_heads * L->head_dim + 3 * L->inter + widest + 16);
}

int64_t DECODE(max_head_dim)(void) { return MAX_HEAD_DIM; }

/* exp(x) to about 2 ulp (Cephes' expf): 2^k * p(r), r = x - k ln2, written so that it vectorises. */
static inline float exp_f32(float x) {
    x = x < -87.33654f ? -87.33654f : x;
    x = x > 88.72283f ? 88.72283f : x;
    float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The sums a row's result depends on are written out in vectors, in one order: VL lanes over i, the
 * lanes added 0 .. VL-1 (lanes_in_order), then the tail. GCC compiled the loop of `omp simd
 * reduction(+)` in more than one version within one function (the row loop's first row summed in 16
 * lanes, later rows in 4), so a row's RMS norm changed with its place in the batch: a decode row
 * beside others parted from its logits alone from the third layer of SmolLM2 on (2-core Intel Xeon,
 * the Q4_1 default). */
static inline float lanes_in_order(vf acc) {
    float lanes[VL], s = 0.0f;
    VSTOREF(lanes, acc);
    for (int l = 0; l < VL; l++) s += lanes[l];
    return s;
}

static inline float sum_of_squares(const float *x, int64_t n) {
    vf acc = VZERO();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) acc = VADD(acc, VMUL(VLOADF(x + i), VLOADF(x + i)));
    float s = lanes_in_order(acc);
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static inline void rms_norm_row(const float *x, const W *w, float *out, int64_t n, float eps) {
    const float ss = sum_of_squares(x, n);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * inv) * LOADW(w[i]);
}

static inline void rotate_neox(float *x, const W *cos_sin, int64_t d) {
    int64_t half = d / 2;
    const W *c = cos_sin, *s = cos_sin + half;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * LOADW(c[i]) + b * -LOADW(s[i]);
        x[i + half] = b * LOADW(c[i]) + a * LOADW(s[i]);
    }
}

static inline float dot(const float *a, const WKV *b, int64_t n) { /* in one order, as sum_of_squares */
    vf acc = VZERO();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) acc = VADD(acc, VMUL(VLOADF(a + i), VLOADKV(b + i)));
    float s = lanes_in_order(acc);
    for (; i < n; i++) s += a[i] * LOADKV(b[i]);
    return s;
}

static inline void store_row(WKV *dst, const float *src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = STOREKV(src[i]);
}

/* One query head of one row over its keys [t0, len): chunks of KEY_CHUNK scores, running max and sum. */
static inline void attend_one(const float *q, const Layer *L, const Step *S, int64_t m, int64_t g, float *out) {
    const int64_t d = L->head_dim, bs = L->block_size;
    const int64_t len = S->seq_lens[m];
    const int64_t t0 = S->sliding_window > 0 && len > S->sliding_window ? len - S->sliding_window : 0;
    const int64_t plane = L->num_blocks * bs * d; /* one (K or V, kv head) plane */
    const WKV *kbase = L->kv + g * plane, *vbase = L->kv + (L->num_kv_heads + g) * plane;
    const int64_t *table = S->block_tables + m * S->table_width;
    float acc[MAX_HEAD_DIM], scores[KEY_CHUNK];
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
    for (int64_t c0 = t0; c0 < len; c0 += KEY_CHUNK) {
        int64_t n = len - c0 < KEY_CHUNK ? len - c0 : KEY_CHUNK;
        float cmax = mx;
        for (int64_t j = 0; j < n; j++) {
            int64_t t = c0 + j;
            const WKV *key = kbase + (table[t / bs] * bs + t % bs) * d;
            scores[j] = dot(q, key, d) * L->scale;
            cmax = scores[j] > cmax ? scores[j] : cmax;
        }
        if (cmax > mx) { /* rescale what was summed under the old max */
            float f = exp_f32(mx - cmax);
            sum *= f;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[i] *= f;
            mx = cmax;
        }
        for (int64_t j = 0; j < n; j++) {
            int64_t t = c0 + j;
            const WKV *value = vbase + (table[t / bs] * bs + t % bs) * d;
            float p = exp_f32(scores[j] - mx);
            sum += p;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[i] += p * LOADKV(value[i]);
        }
    }
    float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t i = 0; i < d; i++) out[i] = acc[i] * inv;
}

/* Keys ahead of the chunk in hand whose K and V attend_group_body prefetches into L2, beside the next
 * chunk's into L1. A 32-row step's cache is ~10 MB a layer at 200 tokens of context, long out of L3
 * when its layer comes round again, and a (row, kv head) reads it a block (4 KB) at a time: the next
 * chunk alone came too late to hide DRAM's latency. 32-row decode step, 2 threads, Zen 4 EPYC VM
 * (medians of 30 steps alternated in one process, this prefetch alone): AVX2 64.3 -> 62.5 ms at ~200
 * tokens, 72.2 -> 67.7 at ~300; AVX-512 62.3 -> 59.6, 68.5 -> 64.4. 48 or 64 keys ahead: level. */
#define PREFETCH_AHEAD 32

/* The G query heads of one row that share kv head g, over its keys [t0, len), when head_dim (d) is a
 * multiple of VL: each chunk of VL keys is read once for all G heads (scores, then values), an online
 * softmax per head. attend_one is the same sum for any head_dim, a head at a time. attend_group (below)
 * calls this body with `group` and `d` as constants where it can.
 * Register blocks: the scores of KB keys for all G heads at once (G * KB accumulators beside G vectors
 * of q: each key vector loaded once for the G heads, not once a head), the values IB vectors of
 * head_dim at a time for all G heads (G * IB accumulators beside G broadcast p's: head by head, AVX2's
 * 16 registers could not hold 3 heads' 8 accumulators each, and they lived on the stack). Every sum
 * runs over the same terms in the same order as head by head did: the same bits. With the prefetch
 * above, against the body before both (same step, medians of 30 alternated): AVX2 0.975 / 0.960 /
 * 0.943 of the time at ~150 / 250 / 400 tokens, AVX-512 0.981 / 0.980 / 0.962; the blocks on top of
 * the prefetch, AVX2 at ~250 tokens, 62.0 -> 61.0 ms (AVX-512 level; without it, slower). */
static inline __attribute__((always_inline)) void attend_group_body(const float *q0, const Layer *L,
                                                                    const Step *S, int64_t m, int64_t g,
                                                                    const int64_t group, const int64_t d,
                                                                    float *out0) {
    enum { KB = VL == 16 ? 4 : 2, IB = VL == 16 ? 4 : 2 };
    const int64_t bs = L->block_size, nv = d / VL;
    const int64_t len = S->seq_lens[m];
    const int64_t t0 = S->sliding_window > 0 && len > S->sliding_window ? len - S->sliding_window : 0;
    const int64_t plane = L->num_blocks * bs * d;
    const WKV *kbase = L->kv + g * plane, *vbase = L->kv + (L->num_kv_heads + g) * plane;
    const int64_t *table = S->block_tables + m * S->table_width;
    vf acc[MAX_GROUP][MAX_HEAD_DIM / VL];
    float mx[MAX_GROUP], sum[MAX_GROUP], p[MAX_GROUP][VL];
    for (int64_t h = 0; h < group; h++) {
        mx[h] = -INFINITY, sum[h] = 0.0f;
        for (int64_t i = 0; i < nv; i++) acc[h][i] = VZERO();
    }
    /* Each key's offset into its plane, this chunk's and the next's: key t is row t % bs of block
     * table[t / bs], walked a key at a time. The next chunk's keys and values are prefetched into L1
     * a key at a time beside this chunk's (the cache's blocks are scattered pages, where the hardware
     * prefetcher stops at each block's end), spread over the score blocks and the value loop rather
     * than all at once: 64 lines at once filled the core's line fill buffers (2-core Intel Xeon
     * AVX-512, ~190-token contexts: the model call 58.5 -> 57.0 ms). A third cursor walks
     * PREFETCH_AHEAD keys ahead, into L2. */
    int64_t rows_a[VL], rows_b[VL], *rows = rows_a, *next = rows_b;
    int64_t blk = t0 / bs, off = t0 % bs;
    int64_t ahead = t0 + PREFETCH_AHEAD, ahead_blk = ahead / bs, ahead_off = ahead % bs;
    const int64_t lines = (d * (int64_t)sizeof(WKV) + 63) / 64;
    int64_t n = len - t0 < VL ? len - t0 : VL;
    for (int64_t j = 0; j < n; j++) {
        rows[j] = (table[blk] * bs + off) * d;
        if (++off == bs) off = 0, blk++;
    }
    for (int64_t c0 = t0; c0 < len; c0 += VL) {
        const int64_t after = c0 + n, n_next = len - after < VL ? len - after : VL;
        for (int64_t j = 0; j < n_next; j++) {
            next[j] = (table[blk] * bs + off) * d;
            if (++off == bs) off = 0, blk++;
        }
        for (int64_t j = 0; j < VL && ahead < len; j++, ahead++) {
            const int64_t row = (table[ahead_blk] * bs + ahead_off) * d;
            for (int64_t l = 0; l < lines; l++) {
                _mm_prefetch((const char *)(kbase + row) + 64 * l, _MM_HINT_T1);
                _mm_prefetch((const char *)(vbase + row) + 64 * l, _MM_HINT_T1);
            }
            if (++ahead_off == bs) ahead_off = 0, ahead_blk++;
        }
        for (int64_t j = n; j < VL; j++) rows[j] = rows[n - 1]; /* past the chunk: a key, its lane unused */
        /* scores: q_h . k_j for KB keys at a time; lanes past n are ignored below */
        vf dots[MAX_GROUP][VL];
        for (int64_t j = 0; j < VL; j += KB) {
            vf a[MAX_GROUP][KB];
            for (int64_t h = 0; h < group; h++)
                for (int64_t jj = 0; jj < KB; jj++) a[h][jj] = VZERO();
            if (j < n) {
                for (int64_t jj = 0; jj < KB && j + jj < n_next; jj++)
                    for (int64_t l = 0; l < lines; l++)
                        _mm_prefetch((const char *)(kbase + next[j + jj]) + 64 * l, _MM_HINT_T0);
                for (int64_t i = 0; i < nv; i++) {
                    vf qv[MAX_GROUP];
                    for (int64_t h = 0; h < group; h++) qv[h] = VLOADF(q0 + h * d + i * VL);
                    for (int64_t jj = 0; jj < KB; jj++) {
                        vf k = VLOADKV(kbase + rows[j + jj] + i * VL);
                        for (int64_t h = 0; h < group; h++) a[h][jj] = VFMA(qv[h], k, a[h][jj]);
                    }
                }
            }
            for (int64_t h = 0; h < group; h++)
                for (int64_t jj = 0; jj < KB; jj++) dots[h][j + jj] = a[h][jj];
        }
        for (int64_t h = 0; h < group; h++) {
            float scores[VL];
            VSTOREF(scores, VMUL(reduce_keys(dots[h]), VSET1(L->scale)));
            float cmax = mx[h];
            for (int64_t j = 0; j < n; j++) cmax = scores[j] > cmax ? scores[j] : cmax;
            if (cmax > mx[h]) { /* rescale what was summed under the old max */
                float f = exp_f32(mx[h] - cmax);
                sum[h] *= f;
                for (int64_t i = 0; i < nv; i++) acc[h][i] = VMUL(acc[h][i], VSET1(f));
                mx[h] = cmax;
            }
            const float top = mx[h];
#pragma omp simd
            for (int64_t j = 0; j < VL; j++) p[h][j] = exp_f32(scores[j] - top);
            for (int64_t j = n; j < VL; j++) p[h][j] = 0.0f;
            for (int64_t j = 0; j < n; j++) sum[h] += p[h][j];
        }
        /* values: acc_h += p_h[j] * v_j over the chunk's keys in order, IB vectors of head_dim at a time */
        for (int64_t i = 0; i < nv; i += IB) {
            vf a[MAX_GROUP][IB];
            for (int64_t h = 0; h < group; h++)
                for (int64_t ii = 0; ii < IB && i + ii < nv; ii++) a[h][ii] = acc[h][i + ii];
            for (int64_t j = 0; j < n; j++) {
                if (i == 0 && j < n_next)
                    for (int64_t l = 0; l < lines; l++)
                        _mm_prefetch((const char *)(vbase + next[j]) + 64 * l, _MM_HINT_T0);
                vf pb[MAX_GROUP];
                for (int64_t h = 0; h < group; h++) pb[h] = VSET1(p[h][j]);
                for (int64_t ii = 0; ii < IB && i + ii < nv; ii++) {
                    vf v = VLOADKV(vbase + rows[j] + (i + ii) * VL);
                    for (int64_t h = 0; h < group; h++) a[h][ii] = VFMA(pb[h], v, a[h][ii]);
                }
            }
            for (int64_t h = 0; h < group; h++)
                for (int64_t ii = 0; ii < IB && i + ii < nv; ii++) acc[h][i + ii] = a[h][ii];
        }
        int64_t *swap = rows;
        rows = next, next = swap, n = n_next;
    }
    for (int64_t h = 0; h < group; h++) {
        vf inv = VSET1(1.0f / sum[h]);
        for (int64_t i = 0; i < nv; i++) VSTOREF(out0 + h * d + i * VL, VMUL(acc[h][i], inv));
    }
}

/* BODY(G, D): an attention body called with the (group, head_dim) of common models as constants
 * where (group, d) is one of them (SmolLM2 135M / 360M: 3, 64; 1.7B: 1, 64; Llama 3.2 1B: 4, 64;
 * Llama 3 8B, Mistral 7B: 4, 128), else with the run-time values: the head_dim loops unroll and the
 * accumulators stay in registers, where indexed at run time they lived on the stack. The same
 * operations in the same order either way (the same bits): only the speed differs. */
#define WITH_COMMON_SHAPES(group, d, BODY)                                                                    \
    do {                                                                                                    \
        if ((group) == 3 && (d) == 64)                                                                      \
            BODY(3, 64);                                                                                    \
        else if ((group) == 1 && (d) == 64)                                                                 \
            BODY(1, 64);                                                                                    \
        else if ((group) == 4 && (d) == 64)                                                                 \
            BODY(4, 64);                                                                                    \
        else if ((group) == 4 && (d) == 128)                                                                \
            BODY(4, 128);                                                                                   \
        else                                                                                                \
            BODY(group, d);                                                                                 \
    } while (0)

static void attend_group(const float *q0, const Layer *L, const Step *S, int64_t m, int64_t g, int64_t group,
                         float *out0) {
    const int64_t d = L->head_dim;
#define GROUP_BODY(G, D) attend_group_body(q0, L, S, m, g, G, D, out0)
    WITH_COMMON_SHAPES(group, d, GROUP_BODY);
#undef GROUP_BODY
}

/* A prompt's rows in tiles: up to VL consecutive rows of one sequence (a chunk) attend together,
 * a row a vector lane, the G query heads that share kv head g beside each other. A chunk of TILE_KEYS
 * keys is gathered once for the tile (as float), its scores come from broadcast key values times the
 * lanes' queries (whole vectors, no per-key horizontal sum), the online softmax runs lane-wise (each
 * row its own max, sum and causal or window mask), and the values go in the same way. Row by row
 * (attend_group) each row read its keys itself and spent most of its time on per-key reductions and
 * scalar softmax steps: a 1,000-token prompt's attention ran at ~74 GFLOPS on the 2-core Xeon. */
#define TILE_KEYS 16         /* keys a chunk */
#define TILE_MAX_WIDTH 512   /* G * head_dim the tile takes: its buffers live on the stack */
#define TILE_MASKED -1.0e30f /* a masked score (finite: no inf - inf in the rescale) */
#if VL == 16
#define TILE_KB 4 /* keys whose scores accumulate at once: G * TILE_KB vectors in registers */
#else
#define TILE_KB 3
#endif

/* Rows m and m + 1 are one sequence's consecutive tokens: one position apart over the same blocks. */
static inline int same_sequence(const Step *S, int64_t m, int64_t bs) {
    if (S->seq_lens[m + 1] != S->seq_lens[m] + 1) return 0;
    int64_t blocks = (S->seq_lens[m + 1] + bs - 1) / bs;
    return memcmp(S->block_tables + m * S->table_width, S->block_tables + (m + 1) * S->table_width,
                  (size_t)blocks * sizeof(int64_t)) == 0;
}

static inline __attribute__((always_inline)) void attend_tile_body(const float *q0, int64_t q_stride,
                                                                   const Layer *L, const Step *S, int64_t m0,
                                                                   int64_t n, int64_t g, const int64_t group,
                                                                   const int64_t d, float *out0,
                                                                   int64_t out_stride) {
    const int64_t bs = L->block_size, width = group * d, window = S->sliding_window;
    const int64_t plane = L->num_blocks * bs * d;
    const WKV *kbase = L->kv + g * plane, *vbase = L->kv + (L->num_kv_heads + g) * plane;
    const int64_t *table = S->block_tables + m0 * S->table_width; /* every row's: one sequence */
    /* DB value dims a pass: G * DB accumulators in registers */
    const int64_t db = group <= 3 ? (VL == 16 ? 8 : 4) : group <= 6 ? (VL == 16 ? 4 : 2) : 1;
    float qt[TILE_MAX_WIDTH * VL] __attribute__((aligned(64)));  /* [h * d + i][lane] */
    float acc[TILE_MAX_WIDTH * VL] __attribute__((aligned(64))); /* [h * d + i][lane] */
    float kc[(TILE_KEYS + TILE_KB) * MAX_HEAD_DIM], vc[TILE_KEYS * MAX_HEAD_DIM];
    float sc[MAX_GROUP * TILE_KEYS * VL] __attribute__((aligned(64))); /* [h][j][lane]: scores, then p */
    float mx[MAX_GROUP * VL], sum[MAX_GROUP * VL];
    int64_t lens[VL], starts[VL];
    for (int64_t r = 0; r < VL; r++) { /* lanes past n: no valid key */
        lens[r] = r < n ? S->seq_lens[m0 + r] : 0;
        starts[r] = r < n && window > 0 && lens[r] > window ? lens[r] - window : 0;
    }
    for (int64_t k = 0; k < width; k++)
        for (int64_t r = 0; r < VL; r++) {
            qt[k * VL + r] = r < n ? q0[r * q_stride + k] : 0.0f;
            acc[k * VL + r] = 0.0f;
        }
    for (int64_t k = 0; k < group * VL; k++) mx[k] = TILE_MASKED, sum[k] = 0.0f;
    for (int64_t k = TILE_KEYS * d; k < (TILE_KEYS + TILE_KB) * d; k++) kc[k] = 0.0f;
    const int64_t t_end = lens[n - 1];
    /* chunks of keys at multiples of TILE_KEYS, whichever rows the tile holds: a lane's sums then run
     * over the same keys in the same order in any tile (keys outside its window or past its token are
     * masked: p = 0, its max unmoved, a rescale by exp(0) = 1), so its result is the same bits */
    for (int64_t c0 = starts[0] / TILE_KEYS * TILE_KEYS; c0 < t_end; c0 += TILE_KEYS) {
        const int64_t nk = t_end - c0 < TILE_KEYS ? t_end - c0 : TILE_KEYS;
        for (int64_t j = 0; j < nk; j++) { /* the chunk's keys and values, as float */
            const int64_t t = c0 + j, off = (table[t / bs] * bs + t % bs) * d;
            for (int64_t i = 0; i < d; i += VL) {
                VSTOREF(kc + j * d + i, VLOADKV(kbase + off + i));
                VSTOREF(vc + j * d + i, VLOADKV(vbase + off + i));
            }
        }
        for (int64_t j = nk; j < TILE_KEYS; j++) /* past the last key: zeros, never used */
            for (int64_t i = 0; i < d; i++) kc[j * d + i] = 0.0f;
        /* scores: sc[h][j] = q_h . k_j over the lanes, TILE_KB keys at once */
        for (int64_t j = 0; j < nk; j += TILE_KB) {
            vf a[MAX_GROUP][TILE_KB];
            for (int64_t h = 0; h < group; h++)
                for (int64_t jj = 0; jj < TILE_KB; jj++) a[h][jj] = VZERO();
            for (int64_t i = 0; i < d; i++) {
                vf k[TILE_KB];
                for (int64_t jj = 0; jj < TILE_KB; jj++) k[jj] = VSET1(kc[(j + jj) * d + i]);
                for (int64_t h = 0; h < group; h++) {
                    vf q = VLOADF(qt + (h * d + i) * VL);
                    for (int64_t jj = 0; jj < TILE_KB; jj++) a[h][jj] = VFMA(q, k[jj], a[h][jj]);
                }
            }
            for (int64_t h = 0; h < group; h++)
                for (int64_t jj = 0; jj < TILE_KB && j + jj < nk; jj++)
                    VSTOREF(sc + (h * TILE_KEYS + j + jj) * VL, VMUL(a[h][jj], VSET1(L->scale)));
        }
        if (c0 < starts[n - 1] || c0 + nk > lens[0]) /* past a row's own token, or before its window */
            for (int64_t h = 0; h < group; h++)
                for (int64_t j = 0; j < nk; j++)
                    for (int64_t r = 0; r < VL; r++)
                        if (c0 + j >= lens[r] || c0 + j < starts[r]) sc[(h * TILE_KEYS + j) * VL + r] = TILE_MASKED;
        /* the online softmax, lane-wise: each row its own running max and sum */
        for (int64_t h = 0; h < group; h++) {
            float *m = mx + h * VL, *l = sum + h * VL, *s = sc + h * TILE_KEYS * VL;
            float top[VL], f[VL];
            int grew = 0;
            for (int64_t r = 0; r < VL; r++) top[r] = m[r];
            for (int64_t j = 0; j < nk; j++)
#pragma omp simd
                for (int64_t r = 0; r < VL; r++) top[r] = s[j * VL + r] > top[r] ? s[j * VL + r] : top[r];
            for (int64_t r = 0; r < VL; r++) grew |= top[r] > m[r];
            if (grew) { /* rescale what was summed under the old max */
#pragma omp simd
                for (int64_t r = 0; r < VL; r++) {
                    f[r] = exp_f32(m[r] - top[r]);
                    l[r] *= f[r];
                    m[r] = top[r];
                }
                vf fv = VLOADF(f);
                for (int64_t i = 0; i < d; i++) VSTOREF(acc + (h * d + i) * VL, VMUL(VLOADF(acc + (h * d + i) * VL), fv));
            }
            for (int64_t j = 0; j < nk; j++)
#pragma omp simd
                for (int64_t r = 0; r < VL; r++) {
                    float x = s[j * VL + r];
                    float p = x > TILE_MASKED ? exp_f32(x - m[r]) : 0.0f;
                    s[j * VL + r] = p;
                    l[r] += p;
                }
        }
        /* values: acc[h][i] += p[h][j] * v_j[i] over the lanes, db dims at once */
        for (int64_t i = 0; i < d; i += db) {
            vf a[MAX_GROUP][8];
            for (int64_t h = 0; h < group; h++)
                for (int64_t ii = 0; ii < db; ii++) a[h][ii] = VLOADF(acc + (h * d + i + ii) * VL);
            for (int64_t j = 0; j < nk; j++) {
                vf p[MAX_GROUP];
                for (int64_t h = 0; h < group; h++) p[h] = VLOADF(sc + (h * TILE_KEYS + j) * VL);
                for (int64_t ii = 0; ii < db; ii++) {
                    vf v = VSET1(vc[j * d + i + ii]);
                    for (int64_t h = 0; h < group; h++) a[h][ii] = VFMA(p[h], v, a[h][ii]);
                }
            }
            for (int64_t h = 0; h < group; h++)
                for (int64_t ii = 0; ii < db; ii++) VSTOREF(acc + (h * d + i + ii) * VL, a[h][ii]);
        }
    }
    for (int64_t r = 0; r < n; r++)
        for (int64_t h = 0; h < group; h++) {
            float inv = 1.0f / sum[h * VL + r];
            for (int64_t i = 0; i < d; i++) out0[r * out_stride + h * d + i] = acc[(h * d + i) * VL + r] * inv;
        }
}

static void attend_tile(const float *q0, int64_t q_stride, const Layer *L, const Step *S, int64_t m0, int64_t n,
                        int64_t g, int64_t group, float *out0, int64_t out_stride) {
    const int64_t d = L->head_dim;
#define TILE_BODY(G, D) attend_tile_body(q0, q_stride, L, S, m0, n, g, G, D, out0, out_stride)
    WITH_COMMON_SHAPES(group, d, TILE_BODY);
#undef TILE_BODY
}

/* Whether this layer's prompt rows attend in tiles (attend_tile's shapes), else all row by row. */
static inline int tiles_fit(const Layer *L) {
    const int64_t group = L->num_heads / L->num_kv_heads;
    return L->head_dim % VL == 0 && group <= MAX_GROUP && group * L->head_dim <= TILE_MAX_WIDTH;
}

/* Attention's units for a step's rows, the same in every layer (so computed once a step, before the
 * first): a tile of 1 to VL consecutive prompt rows of one sequence, else a single output row (a
 * decode, or an output token recomputed after a preemption). A row's attention is then computed the
 * same way whatever else is in the step: a tile's lane does not depend on the tile's other rows
 * (attend_tile), so how a prompt was cut into chunks and slices moves no bit, and an output row is
 * always attend_group's. starts[u] is unit u's first row and starts[units] = num_rows: starts holds
 * num_rows + 1 values. Returns the number of units. */
int64_t DECODE(attention_units)(const Layer *L, const Step *S, int64_t *starts) {
    const int64_t M = S->num_rows;
    const int tiles = tiles_fit(L) && S->in_prompt;
    int64_t units = 0;
    for (int64_t m = 0; m < M;) {
        int64_t run = 1;
        if (tiles && S->in_prompt[m])
            while (run < VL && m + run < M && S->in_prompt[m + run] &&
                   same_sequence(S, m + run - 1, L->block_size))
                run++;
        starts[units++] = m;
        m += run;
    }
    starts[units] = M;
    return units;
}

void DECODE(layer)(const Layer *L, const Step *S) {
    const int64_t M = S->num_rows, H = L->hidden, D = L->head_dim, I = L->inter;
    const int64_t hq = L->num_heads, hkv = L->num_kv_heads, group = hq / hkv;
    const int64_t qkv_out = (hq + 2 * hkv) * D, attn_width = hq * D;
    const int nt = (int)S->num_threads;
    float *xn = S->work, *qkv = xn + M * H, *attn = qkv + M * qkv_out, *gate_up = attn + M * attn_width;
    float *act = gate_up + M * 2 * I;
    W *scratch = (W *)(act + M * I); /* LINEAR's input converted to W, where W is not float */
    (void)scratch;
    float *residual = S->residual, *hidden = S->hidden;

#pragma omp parallel for num_threads(nt) schedule(static) if (M >= ROWS_PARALLEL)
    for (int64_t m = 0; m < M; m++) {
        float *r = residual + m * H;
        const float *h = hidden + m * H;
        if (S->first) {
            memcpy(r, h, (size_t)H * sizeof(float));
        } else {
#pragma omp simd
            for (int64_t i = 0; i < H; i++) r[i] = h[i] + r[i];
        }
        rms_norm_row(r, L->ln1, xn + m * H, H, L->eps);
    }
    LINEAR_THEN(xn, L->w_qkv, L->b_qkv, qkv, M, qkv_out, H, nt, L->w_o, H, attn_width);

    const int64_t plane = L->num_blocks * L->block_size * D;
#pragma omp parallel for num_threads(nt) schedule(static) if (M >= ROWS_PARALLEL)
    for (int64_t m = 0; m < M; m++) {
        float *row = qkv + m * qkv_out;
        for (int64_t h = 0; h < hq + hkv; h++) rotate_neox(row + h * D, S->cos_sin + m * D, D);
        for (int64_t g = 0; g < hkv; g++) {
            store_row(L->kv + g * plane + S->slots[m] * D, row + (hq + g) * D, D);
            store_row(L->kv + (hkv + g) * plane + S->slots[m] * D, row + (hq + hkv + g) * D, D);
        }
    }
    if (D % VL == 0 && group <= MAX_GROUP) {
        /* a task a (unit, kv head): a unit is a tile of a prompt's consecutive rows or an output row */
        const int64_t units = S->num_units, *starts = S->unit_starts;
        const int tiles = tiles_fit(L) && S->in_prompt;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int64_t task = 0; task < units * hkv; task++) {
            int64_t u = task / hkv, g = task % hkv, m = starts[u], rows = starts[u + 1] - m;
            const float *q = qkv + m * qkv_out + g * group * D;
            float *out = attn + m * attn_width + g * group * D;
            if (rows == 1 && !(tiles && S->in_prompt[m]))
                attend_group(q, L, S, m, g, group, out);
            else
                attend_tile(q, qkv_out, L, S, m, rows, g, group, out, attn_width);
        }
    } else {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int64_t task = 0; task < M * hq; task++) {
            int64_t m = task / hq, h = task % hq;
            attend_one(qkv + m * qkv_out + h * D, L, S, m, h / group, attn + m * attn_width + h * D);
        }
    }

    /* xn is free again: the projection */
    LINEAR_THEN(attn, L->w_o, L->b_o, xn, M, H, attn_width, nt, L->w_gate_up, 2 * I, H);
#pragma omp parallel for num_threads(nt) schedule(static) if (M >= ROWS_PARALLEL)
    for (int64_t m = 0; m < M; m++) {
        float *r = residual + m * H, *o = xn + m * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) r[i] = o[i] + r[i];
        rms_norm_row(r, L->ln2, o, H, L->eps);
    }
    LINEAR_THEN(xn, L->w_gate_up, L->b_gate_up, gate_up, M, 2 * I, H, nt, L->w_down, H, I);
#pragma omp parallel for num_threads(nt) schedule(static) if (M >= ROWS_PARALLEL)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *a = act + m * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            float silu = g[i] / (1.0f + exp_f32(-g[i]));
            a[i] = silu * u[i];
        }
    }
    LINEAR(act, L->w_down, L->b_down, hidden, M, H, I, nt);
}
