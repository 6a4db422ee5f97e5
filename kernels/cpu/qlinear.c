/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) with w in GGUF's 32-wide blocks (Q8_0, Q4_0, Q4_1).
 *
 * As llama.cpp computes it: x is quantized on the fly to int8 per block of 32 (d = max|x| / 127, q =
 * round(x / d), and s = d * sum(q) kept for the weights' offset term), so that a block's dot product
 * is integer arithmetic and one float scale:
 *
 *     y[m, n] = sum_b  dw[n, b] * dx[m, b] * sum_k qw[n, b, k] * qx[m, b, k]     (integer sums)
 *             + sum_b  cw[n, b] * sx[m, b]                                          (Q4 offset term)
 *
 * Q4_1 (w = d q + m): cw = m.  Q4_0 (w = d (q - 8)): cw = -8 d.  Q8_0 (w = d q): no cw.
 *
 * Layout: eight weight rows interleaved (repacked at load, values unchanged: worker/models/quant.py,
 * kernels/quant_format.py), so that each 32-bit lane of a 256-bit vector is one output row:
 *
 *   Q4  per (group of 8 rows, block): 4 x 32 bytes; vector q, lane l = row l, byte i: element 8q + i
 *       in its low nibble and 8q + 4 + i in its high one
 *   Q8  per (group, block): 8 x 32 bytes; vector q, lane l, byte i: element 4q + i of row l
 *   d, c  per (group, block): 8 floats, lane l = row l
 *
 * One unsigned-by-signed byte dot (VNNI dpbusd on AVX512-VNNI, maddubs + madd on AVX2) against four
 * bytes of x broadcast to every lane adds four products to each of the eight rows: a block is 8 such
 * instructions and one scale for 8 rows, with no horizontal sum. Q4's nibbles (0..15) go in as they
 * are; Q8_0's signed weights as |w| against x with w's sign.
 *
 * Tiles of GR groups (8 rows each) x MR rows of x; one OpenMP loop over tiles of weight groups
 * (libgomp is torch's, so this shares its threads). Each (m, n) is summed in the same order whatever
 * M and the tile: a row's output does not depend on its batch. Built once per ISA
 * (kernels/cpu/build.py); QNAME gives the exported names their ISA suffix.
 */
#include <immintrin.h>
#include <stdint.h>

#define QK 32
#define LANES 8
#define MR 4
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GR 2 /* 32 vector registers: 2 groups x 4 rows of accumulators fit */
#define QNAME(name) name##_avx512_vnni
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
#define GR 1
#define QNAME(name) name##_avx2
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

enum { KIND_Q8 = 0, KIND_Q4 = 1 };

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* One row of x: per block, d = amax / 127, q = round-half-even(x * (1 / d)), s = d * sum(q). */
static void quantize_row(const float *x, int64_t K, int8_t *qx, float *dx, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / QK; b++) {
        const float *p = x + b * QK;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(p + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        float d = _mm_cvtss_f32(m) / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        /* packs work within 128-bit lanes: the permute puts the 32 bytes back in order */
        __m256i q01 = _mm256_packs_epi32(q[0], q[1]), q23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), order);
        _mm256_storeu_si256((__m256i *)(qx + b * QK), bytes);
        dx[b] = d;
        sx[b] = d * (float)hsum8i(sum);
    }
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* gr weight groups (rows n0 .. n0 + 8 gr) x mr rows of x (m0 ..); constants once inlined. */
static inline __attribute__((always_inline)) void tile(int kind, int gr, int mr, const int8_t *qx,
                                                       const float *dx, const float *sx, int64_t m0,
                                                       int64_t K, const uint8_t *qs, const float *dw,
                                                       const float *cw, const float *bias, float *y,
                                                       int64_t n0, int64_t N) {
    const int64_t nb = K / QK, group_bytes = (kind == KIND_Q8 ? K : K / 2) * LANES;
    const int64_t block_bytes = (kind == KIND_Q8 ? QK : QK / 2) * LANES;
    const int64_t g0 = n0 / LANES;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[GR][MR];
    for (int g = 0; g < gr; g++)
        for (int j = 0; j < mr; j++) acc[g][j] = _mm256_setzero_ps();
    /* Few tiles in flight (one row of x): the low and high nibbles' products go to two chains of
     * integer sums, added at the block's end (exact), so that dpbusd's latency overlaps. */
    const int split = gr * mr < 4;
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[GR][MR], isum2[GR][MR];
        for (int g = 0; g < gr; g++)
            for (int j = 0; j < mr; j++) isum[g][j] = isum2[g][j] = _mm256_setzero_si256();
        if (kind == KIND_Q4) {
            for (int q = 0; q < 4; q++) {
                __m256i xlo[MR], xhi[MR];
                for (int j = 0; j < mr; j++) {
                    const int8_t *xb = qx + (m0 + j) * K + b * QK + 8 * q;
                    xlo[j] = bcast4(xb);
                    xhi[j] = bcast4(xb + 4);
                }
                for (int g = 0; g < gr; g++) {
                    const uint8_t *p = qs + (g0 + g) * group_bytes + b * block_bytes + 32 * q;
                    __m256i v = _mm256_loadu_si256((const __m256i *)p);
                    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int j = 0; j < mr; j++) {
                        isum[g][j] = dot_acc(isum[g][j], lo, xlo[j]);
                        if (split) isum2[g][j] = dot_acc(isum2[g][j], hi, xhi[j]);
                        else isum[g][j] = dot_acc(isum[g][j], hi, xhi[j]);
                    }
                }
            }
        } else {
            for (int q = 0; q < 8; q++) {
                __m256i xq[MR];
                for (int j = 0; j < mr; j++) xq[j] = bcast4(qx + (m0 + j) * K + b * QK + 4 * q);
                for (int g = 0; g < gr; g++) {
                    const uint8_t *p = qs + (g0 + g) * group_bytes + b * block_bytes + 32 * q;
                    __m256i w = _mm256_loadu_si256((const __m256i *)p), wabs = _mm256_abs_epi8(w);
                    for (int j = 0; j < mr; j++) {
                        __m256i xs = _mm256_sign_epi8(xq[j], w);
                        if (split && (q & 1)) isum2[g][j] = dot_acc(isum2[g][j], wabs, xs);
                        else isum[g][j] = dot_acc(isum[g][j], wabs, xs);
                    }
                }
            }
        }
        for (int g = 0; g < gr; g++) {
            __m256 d = _mm256_loadu_ps(dw + ((g0 + g) * nb + b) * LANES);
            __m256 c = kind == KIND_Q4 ? _mm256_loadu_ps(cw + ((g0 + g) * nb + b) * LANES) : d;
            for (int j = 0; j < mr; j++) {
                if (split) isum[g][j] = _mm256_add_epi32(isum[g][j], isum2[g][j]);
                __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[(m0 + j) * nb + b]));
                acc[g][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[g][j]), scale, acc[g][j]);
                if (kind == KIND_Q4) acc[g][j] = _mm256_fmadd_ps(c, _mm256_set1_ps(sx[(m0 + j) * nb + b]), acc[g][j]);
            }
        }
    }
    for (int g = 0; g < gr; g++) {
        int64_t n = n0 + LANES * g;
        for (int j = 0; j < mr; j++) {
            float *out = y + (m0 + j) * N + n;
            if (n + LANES <= N) {
                __m256 v = acc[g][j];
                if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
                _mm256_storeu_ps(out, v);
            } else { /* the last group's padding rows are not stored */
                float lanes[LANES];
                _mm256_storeu_ps(lanes, acc[g][j]);
                for (int64_t l = 0; n + l < N; l++) out[l] = lanes[l] + (bias ? bias[n + l] : 0.0f);
            }
        }
    }
}

#define ROWS_OF_X(KIND, GRV)                                                                            \
    for (int64_t m0 = 0; m0 < M; m0 += MR) {                                                            \
        switch (M - m0 >= MR ? MR : (int)(M - m0)) {                                                    \
        case 4: tile(KIND, GRV, 4, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;             \
        case 3: tile(KIND, GRV, 3, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;             \
        case 2: tile(KIND, GRV, 2, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;             \
        default: tile(KIND, GRV, 1, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;            \
        }                                                                                               \
    }

static void weight_tile(int kind, const int8_t *qx, const float *dx, const float *sx, int64_t M, int64_t K,
                        const uint8_t *qs, const float *dw, const float *cw, const float *bias, float *y,
                        int64_t n0, int64_t groups, int64_t N) {
    if (kind == KIND_Q8) {
        if (groups == GR) { ROWS_OF_X(KIND_Q8, GR) }
        else { ROWS_OF_X(KIND_Q8, 1) }
    } else {
        if (groups == GR) { ROWS_OF_X(KIND_Q4, GR) }
        else { ROWS_OF_X(KIND_Q4, 1) }
    }
}

/* x [M, K] float32 -> its int8 blocks: qx [M, K], dx and sx [M, K/32]. K: a multiple of 32. */
void QNAME(quantize_rows)(const float *x, int64_t M, int64_t K, int8_t *qx, float *dx, float *sx,
                          int num_threads) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, qx + m * K, dx + m * nb, sx + m * nb);
}

/* y = x @ w^T + bias from x's int8 blocks (quantize_rows). kind: 0 Q8_0, 1 Q4 (cw: Q4_0 / Q4_1).
 * The weight holds ceil(N / 8) groups (the last padded). */
void QNAME(qlinear_blocks)(int64_t kind, const int8_t *qx, const float *dx, const float *sx, int64_t M,
                           int64_t K, const uint8_t *qs, const float *dw, const float *cw, const float *bias,
                           float *y, int64_t N, int num_threads) {
    /* one or two rows of x: one group a tile reads faster (measured: fewer streams in flight) */
    const int64_t step = M <= 2 ? 1 : GR;
    const int64_t groups = (N + LANES - 1) / LANES, tiles = (groups + step - 1) / step;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t g = t * step, here = groups - g < step ? groups - g : step;
        weight_tile((int)kind, qx, dx, sx, M, K, qs, dw, cw, bias, y, g * LANES, here, N);
    }
}

/* Both in one call: scratch holds M * K bytes of qx, then 2 * M * K/32 floats (dx, sx). */
void QNAME(qlinear_f32)(int64_t kind, const float *x, int64_t M, int64_t K, void *scratch,
                        const uint8_t *qs, const float *dw, const float *cw, const float *bias, float *y,
                        int64_t N, int num_threads) {
    int8_t *qx = (int8_t *)scratch;
    float *dx = (float *)((char *)scratch + ((M * K + 63) & ~(int64_t)63)), *sx = dx + M * (K / QK);
    QNAME(quantize_rows)(x, M, K, qx, dx, sx, num_threads);
    QNAME(qlinear_blocks)(kind, qx, dx, sx, M, K, qs, dw, cw, bias, y, N, num_threads);
}

/* Bytes of scratch qlinear_f32 needs. */
int64_t QNAME(qlinear_scratch_bytes)(int64_t M, int64_t K) {
    return ((M * K + 63) & ~(int64_t)63) + 2 * M * (K / QK) * (int64_t)sizeof(float);
}
