/* The sampler's row operations in C (kernels/sampling.py has the torch references and the rules):
 *
 *   argmax_rows_f32   each row's first maximal index (the first NaN where there is one)
 *   cut_rows_f32      each row's top-k / top-p cut as a logit (the row keeps the logits >= it), and
 *                     the weights it drops set to 0
 *   race_rows_f32     each row's exponential race over its weights, its noise a hash of the row's key
 *                     and the token's index (race_uniform; kernels/sampling.py draws the same)
 *
 * Over a 32-row step of SmolLM2 (49152 logits a row, 2-core Intel Xeon) torch's max(dim) took ~1.1 ms
 * where argmax_rows takes ~0.3; torch's sort of the rows for top-p ~48 ms where the cut's selection
 * is a few passes a row. No ISA target: the build's baseline vectors serve every x86-64 CPU. Rows are
 * shared out between the threads, a row a task.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define BLOCK 64

/* A row in blocks: a vectorised max (and NaN check) a block, keeping the first block that raised the
 * row's max; at the end that block alone is scanned for the first index holding it. */
static int64_t argmax_row(const float *row, int64_t n) {
    float m = row[0];
    int64_t at = 0; /* the first block whose max is m; or the block holding the first NaN */
    int nan = m != m;
    for (int64_t b = 0; b < n && !nan; b += BLOCK) {
        const int64_t e = b + BLOCK < n ? b + BLOCK : n;
        float bm = row[b];
        int bnan = 0;
#pragma omp simd reduction(max : bm) reduction(| : bnan)
        for (int64_t j = b; j < e; j++) {
            bm = row[j] > bm ? row[j] : bm;
            bnan |= row[j] != row[j];
        }
        if (bnan)
            nan = 1, at = b;
        else if (bm > m)
            m = bm, at = b;
    }
    for (int64_t j = at; j < n; j++)
        if (nan ? row[j] != row[j] : row[j] == m) return j;
    return at; /* not reached: m is one of the row's values */
}

void argmax_rows_f32(const float *x, int64_t M, int64_t N, int num_threads, int64_t *out) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) out[m] = argmax_row(x + m * N, N);
}

/* [lo, hi) of v (and w beside it) in three: > pivot, == pivot, < pivot; returns the ends of the first
 * two in *g, *e and the first two parts' masses (w summed) in *mg, *me. */
static void partition3(float *v, float *w, int64_t lo, int64_t hi, float pivot, int64_t *g, int64_t *e,
                       double *mg, double *me) {
    int64_t a = lo, i = lo, b = hi; /* [lo,a) >, [a,i) ==, [i,b) unseen, [b,hi) < */
    double sg = 0, se = 0;
    while (i < b) {
        float x = v[i], y = w[i];
        if (x > pivot) {
            v[i] = v[a], w[i] = w[a], v[a] = x, w[a] = y;
            sg += y, a++, i++;
        } else if (x == pivot) {
            se += y, i++;
        } else {
            b--;
            v[i] = v[b], w[i] = w[b], v[b] = x, w[b] = y;
        }
    }
    *g = a, *e = i, *mg = sg, *me = se;
}

static float median3(float a, float b, float c) {
    return a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
}

/* The k-th largest of v[0, n) (1 <= k <= n); v reordered. */
static float kth_largest(float *v, float *w, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n;
    for (;;) {
        float pivot = median3(v[lo], v[lo + (hi - lo) / 2], v[hi - 1]);
        int64_t g, e;
        double mg, me;
        partition3(v, w, lo, hi, pivot, &g, &e, &mg, &me);
        if (k <= g) /* among the larger */
            hi = g;
        else if (k <= e) /* the pivot itself */
            return pivot;
        else
            lo = e;
    }
}

/* Weights (relative to the top token's 1) a row's selections look among first: the tokens at or above
 * a level are a top set, closed under ties (a weight is monotone in its logit), so when they hold the
 * k tokens, or the mass, a cut needs, the cut is among them. Partitioning mispredicts a branch a token:
 * over the whole vocabulary it took ~1.5 ms a row of 49152 for top-p; one vectorised pass counts and
 * weighs every level at once, and the selection runs over the first level that suffices. */
#define NUM_LEVELS 8
static const float LEVELS[NUM_LEVELS] = {1e-1f, 1e-2f, 1e-3f, 1e-4f, 1e-5f, 1e-6f, 1e-8f, 0.0f};

/* One pass over a row's weights (a NaN among the logits, or an infinite one, makes them NaN): whether
 * it holds a NaN, each level's tokens (count) and weight (mass, in float: a guide only, the mass that
 * decides is gather's), and the row's whole weight in float64 (returned). */
static double survey(const float *weights, int64_t n, int count[NUM_LEVELS], float mass[NUM_LEVELS], int *nan) {
    int c0 = 0, c1 = 0, c2 = 0, c3 = 0, c4 = 0, c5 = 0, c6 = 0, bad = 0;
    float m0 = 0, m1 = 0, m2 = 0, m3 = 0, m4 = 0, m5 = 0, m6 = 0;
    double total = 0;
#define LEVEL(j) c##j += x >= LEVELS[j], m##j += x >= LEVELS[j] ? x : 0.0f
#pragma omp simd reduction(+ : c0, c1, c2, c3, c4, c5, c6, m0, m1, m2, m3, m4, m5, m6, total) reduction(| : bad)
    for (int64_t i = 0; i < n; i++) {
        const float x = weights[i];
        bad |= x != x;
        LEVEL(0), LEVEL(1), LEVEL(2), LEVEL(3), LEVEL(4), LEVEL(5), LEVEL(6);
        total += x;
    }
#undef LEVEL
    const int counts[NUM_LEVELS] = {c0, c1, c2, c3, c4, c5, c6, (int)n};
    const float masses[NUM_LEVELS] = {m0, m1, m2, m3, m4, m5, m6, (float)total};
    for (int j = 0; j < NUM_LEVELS; j++) count[j] = counts[j], mass[j] = masses[j];
    *nan = bad;
    return total;
}

/* Tokens with logit >= floor and weight >= level, into v and w (a branch a token, taken rarely at the
 * levels that serve); returns how many, their weight (float64) in *mass. */
static int64_t gather(const float *logits, const float *weights, int64_t n, float floor, float level, float *v,
                      float *w, double *mass) {
    int64_t m = 0;
    double sum = 0;
    for (int64_t i = 0; i < n; i++)
        if (weights[i] >= level && logits[i] >= floor) { /* the logit read only for the few kept */
            v[m] = logits[i], w[m] = weights[i], sum += weights[i];
            m++;
        }
    *mass = sum;
    return m;
}

/* The smallest logit top-p keeps of v[0, m) (w beside it), given that their mass reaches target and
 * that every token outside them is below them all: a three-way quickselect by mass. */
static float mass_cut(float *v, float *w, int64_t m, double target) {
    double above = 0; /* the mass of the tokens decided kept, all above [lo, hi) */
    float cut = v[0];
    int64_t lo = 0, hi = m;
    while (lo < hi) {
        float pivot = median3(v[lo], v[lo + (hi - lo) / 2], v[hi - 1]);
        int64_t g, e;
        double mg, me;
        partition3(v, w, lo, hi, pivot, &g, &e, &mg, &me);
        if (above + mg >= target) { /* the pivot's mass above reaches p: the cut is among the larger */
            hi = g;
            continue;
        }
        cut = pivot; /* the pivot and all above it are kept */
        above += mg + me;
        if (above >= target) break; /* nothing below is */
        lo = e;
    }
    return cut;
}

/* One row's cut (kernels/sampling.py's rule); v, w: scratch of n floats each. */
static float cut_row(const float *logits, const float *weights, int64_t n, int64_t k, float p, float *v,
                     float *w) {
    const int limited = k > 0 && k < n;
    if (!limited && p >= 1.0f) return -INFINITY;
    int count[NUM_LEVELS], nan;
    float mass[NUM_LEVELS];
    double kept = survey(weights, n, count, mass, &nan);
    if (nan) return -INFINITY; /* no cut: the sampler takes the row's first NaN */
    if (limited) { /* the k-th largest among the first level holding k tokens; then top-k's set */
        int j = 0;
        while (count[j] < k) j++;
        const float kth = kth_largest(v, w, gather(logits, weights, n, -INFINITY, LEVELS[j], v, w, &kept), k);
        if (p >= 1.0f) return kth;
        int64_t m = gather(logits, weights, n, kth, 0.0f, v, w, &kept);
        return mass_cut(v, w, m, (double)p * kept);
    }
    const double target = (double)p * kept;
    for (int j = 0; j < NUM_LEVELS; j++) {
        if (mass[j] < target * 0.999 && j < NUM_LEVELS - 1) continue; /* short by more than rounding */
        double held;
        int64_t m = gather(logits, weights, n, -INFINITY, LEVELS[j], v, w, &held);
        if (held >= target || j == NUM_LEVELS - 1) return mass_cut(v, w, m, target);
    }
    return -INFINITY; /* not reached: the last level holds every token */
}

/* thresholds[m] for rows of logits and weights [M, N]; top_k[m] (0: none), top_p[m] (1: none); scratch:
 * 2 N floats a thread. With `drop`, also each row's weights below its cut set to 0 (the caller's own),
 * while the row is still in this core's cache: torch's compare and masked_fill took two more passes. */
void cut_rows_f32(const float *logits, float *weights, int64_t M, int64_t N, const int64_t *top_k,
                  const float *top_p, int drop, int num_threads, float *scratch, float *thresholds) {
#pragma omp parallel num_threads(num_threads) if (M > 1)
    {
        float *v = scratch + 2 * N * (int64_t)omp_get_thread_num(), *w = v + N;
#pragma omp for schedule(dynamic, 1)
        for (int64_t m = 0; m < M; m++) {
            const float *row = logits + m * N;
            float *weight = weights + m * N;
            const float cut = cut_row(row, weight, N, top_k[m], top_p[m], v, w);
            thresholds[m] = cut;
            if (drop && cut > -INFINITY) {
#pragma omp simd
                for (int64_t i = 0; i < N; i++) weight[i] = row[i] >= cut ? weight[i] : 0.0f;
            }
        }
    }
}

/* The race's uniform for token i of a row keyed `key`: murmur3's 32-bit finaliser of key ^ (i times the
 * golden ratio), its top 24 bits with the lowest set, times 2^-24: an odd multiple of 2^-24 in
 * [2^-24, 1 - 2^-24], exact in float32 (adding 0.5 to the top 24 bits instead rounded 2^24 - 0.5 up to
 * 2^24, a u of 1, an infinite score). kernels/sampling.py's race_uniforms computes the same numbers. */
static inline float race_uniform(uint32_t key, int64_t i) {
    uint32_t x = key ^ ((uint32_t)i * 0x9E3779B9u);
    x ^= x >> 16, x *= 0x85EBCA6Bu, x ^= x >> 13, x *= 0xC2B2AE35u, x ^= x >> 16;
    return (float)((x >> 8) | 1u) * 0x1p-24f;
}

/* argmax_i w_i / -log(u_i), the exponential race (token i wins with probability w_i / sum w). Since
 * 1 - u <= -log(u) <= (1 - u) / u, a token's score lies in [w u / (1 - u), w / (1 - u)]: one vectorised
 * pass finds the largest lower bound B, and the log is taken only where the upper bound reaches B (less
 * a margin far above float rounding): a token or two a row, where uniform_ and a log a token took
 * ~4.7 ms for 32 rows of 49152. A row with a NaN weight takes its first NaN, as torch's max. */
static int64_t race_row(const float *w, int64_t n, uint32_t key) {
    float bound = 0;
    int nan = 0;
#pragma omp simd reduction(max : bound) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        const float u = race_uniform(key, i), low = w[i] * u / (1.0f - u);
        bound = low > bound ? low : bound;
        nan |= w[i] != w[i];
    }
    if (nan) {
        for (int64_t i = 0; i < n; i++)
            if (w[i] != w[i]) return i;
    }
    bound *= 1.0f - 1e-5f;
    float best = -1.0f;
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        const float u = race_uniform(key, i);
        if (w[i] >= bound * (1.0f - u)) { /* w / (1 - u) >= bound, without the division */
            const float score = w[i] / -logf(u);
            if (score > best) best = score, at = i;
        }
    }
    return at;
}

/* out[m] = the race's winner of row m of weights [M, N] (non-negative, unnormalised), keyed keys[m]. */
void race_rows_f32(const float *weights, int64_t M, int64_t N, const int64_t *keys, int num_threads,
                   int64_t *out) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) out[m] = race_row(weights + m * N, N, (uint32_t)keys[m]);
}
