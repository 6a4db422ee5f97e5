/* One decoder layer of a decode-only step, whole, in float32: one call per layer instead of ~45 torch
 * ops (a batch-1 CPU step paid ~7 ms of per-op overhead on SmolLM2's 30 layers, the weights 13 ms).
 *
 *   residual += hidden (first layer: residual = hidden)     xn = rms_norm(residual) * ln1
 *   qkv = xn @ w_qkv^T + b           q, k rotated (neox pairs)      k, v stored at the token's slot
 *   attn = softmax(q k^T * scale) v  over the paged cache, read in place (no gather), online softmax
 *   residual += attn @ w_o^T + b     xn = rms_norm(residual) * ln2
 *   hidden = (silu(gate) * up) @ w_down^T + b,   [gate | up] = xn @ w_gate_up^T + b
 *
 * The same arithmetic as the torch path (kernels/rms_norm.py, rotary.py, activation.py,
 * paged_attention.py) up to float32 rounding: sums in another order, an exp of a few ulp.
 * Linears are linear_f32.c's (one OpenMP region each); attention runs one (row, head) per task.
 * Cache layout: [2, Hkv, num_blocks, block_size, D] (kernels/paged_attention.py).
 *
 * Built once per ISA, with that ISA's -m flags (build.py: one library each), so that every loop here,
 * the OpenMP task bodies included, vectorises for it; the caller loads the one the CPU probe allows.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "linear_f32.c"

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps, scale;
    const float *ln1, *ln2;
    const float *w_qkv, *b_qkv, *w_o, *b_o, *w_gate_up, *b_gate_up, *w_down, *b_down;
    float *kv;
    int64_t num_blocks, block_size;
} Layer;

typedef struct {
    int64_t num_rows;            /* M decode rows, one token each */
    float *hidden;               /* [M, H] in: the layer's input; out: its output */
    float *residual;             /* [M, H] in/out; written from hidden when first */
    int64_t first;               /* 1 on the first layer */
    const float *cos_sin;        /* [M, D]: cos half | sin half at each row's position */
    const int64_t *slots;        /* [M] cache slot of each row's token */
    const int64_t *block_tables; /* [M, table_width] */
    int64_t table_width;
    const int64_t *seq_lens;     /* [M] context including the new token */
    int64_t sliding_window;      /* 0: full attention */
    float *work;                 /* decode_f32_work_floats() floats */
    int64_t num_threads;
} Step;

#define KEY_CHUNK 32
#define MAX_HEAD_DIM 256

int64_t decode_f32_work_floats(const Layer *L, int64_t num_rows) {
    int64_t qkv = (L->num_heads + 2 * L->num_kv_heads) * L->head_dim;
    return num_rows * (2 * L->hidden + qkv + L->num_heads * L->head_dim + 3 * L->inter);
}

int64_t decode_f32_max_head_dim(void) { return MAX_HEAD_DIM; }

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

static inline void rms_norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

static inline void rotate_neox(float *x, const float *cos_sin, int64_t d) {
    int64_t half = d / 2;
    const float *c = cos_sin, *s = cos_sin + half;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * c[i] + b * -s[i];
        x[i + half] = b * c[i] + a * s[i];
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One query head of one row over its keys [t0, len): chunks of KEY_CHUNK scores, running max and sum. */
static inline void attend_one(const float *q, const Layer *L, const Step *S, int64_t m, int64_t g, float *out) {
    const int64_t d = L->head_dim, bs = L->block_size;
    const int64_t len = S->seq_lens[m];
    const int64_t t0 = S->sliding_window > 0 && len > S->sliding_window ? len - S->sliding_window : 0;
    const int64_t plane = L->num_blocks * bs * d; /* one (K or V, kv head) plane */
    const float *kbase = L->kv + g * plane, *vbase = L->kv + (L->num_kv_heads + g) * plane;
    const int64_t *table = S->block_tables + m * S->table_width;
    float acc[MAX_HEAD_DIM], scores[KEY_CHUNK];
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
    for (int64_t c0 = t0; c0 < len; c0 += KEY_CHUNK) {
        int64_t n = len - c0 < KEY_CHUNK ? len - c0 : KEY_CHUNK;
        float cmax = mx;
        for (int64_t j = 0; j < n; j++) {
            int64_t t = c0 + j;
            const float *key = kbase + (table[t / bs] * bs + t % bs) * d;
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
            const float *value = vbase + (table[t / bs] * bs + t % bs) * d;
            float p = exp_f32(scores[j] - mx);
            sum += p;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[i] += p * value[i];
        }
    }
    float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t i = 0; i < d; i++) out[i] = acc[i] * inv;
}

#if defined(__AVX512F__)
#define linear linear_f32_avx512
#elif defined(__AVX2__)
#define linear linear_f32_avx2
#else
#error "build with -mavx2 -mfma or the AVX-512 flags (kernels/cpu/build.py)"
#endif

void decode_f32_layer(const Layer *L, const Step *S) {
    const int64_t M = S->num_rows, H = L->hidden, D = L->head_dim, I = L->inter;
    const int64_t hq = L->num_heads, hkv = L->num_kv_heads, group = hq / hkv;
    const int64_t qkv_out = (hq + 2 * hkv) * D, attn_width = hq * D;
    const int nt = (int)S->num_threads;
    float *xn = S->work, *qkv = xn + M * H, *attn = qkv + M * qkv_out, *gate_up = attn + M * attn_width;
    float *act = gate_up + M * 2 * I;
    float *residual = S->residual, *hidden = S->hidden;

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
    linear(xn, L->w_qkv, L->b_qkv, qkv, M, qkv_out, H, nt);

    const int64_t plane = L->num_blocks * L->block_size * D;
    for (int64_t m = 0; m < M; m++) {
        float *row = qkv + m * qkv_out;
        for (int64_t h = 0; h < hq + hkv; h++) rotate_neox(row + h * D, S->cos_sin + m * D, D);
        for (int64_t g = 0; g < hkv; g++) {
            memcpy(L->kv + g * plane + S->slots[m] * D, row + (hq + g) * D, (size_t)D * sizeof(float));
            memcpy(L->kv + (hkv + g) * plane + S->slots[m] * D, row + (hq + hkv + g) * D, (size_t)D * sizeof(float));
        }
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t task = 0; task < M * hq; task++) {
        int64_t m = task / hq, h = task % hq;
        attend_one(qkv + m * qkv_out + h * D, L, S, m, h / group, attn + m * attn_width + h * D);
    }

    linear(attn, L->w_o, L->b_o, xn, M, H, attn_width, nt); /* xn is free again: the projection */
    for (int64_t m = 0; m < M; m++) {
        float *r = residual + m * H, *o = xn + m * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) r[i] = o[i] + r[i];
        rms_norm_row(r, L->ln2, o, H, L->eps);
    }
    linear(xn, L->w_gate_up, L->b_gate_up, gate_up, M, 2 * I, H, nt);
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *a = act + m * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            float silu = g[i] / (1.0f + exp_f32(-g[i]));
            a[i] = silu * u[i];
        }
    }
    linear(act, L->w_down, L->b_down, hidden, M, H, I, nt);
}
