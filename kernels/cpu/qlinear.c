/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) with w in GGUF's 32-wide blocks (Q8_0, Q4_0, Q4_1).
 *
 * x is quantized on the fly per block of 32 (d = max|x| / 127, q = round(x / d), and s = d * sum(q)
 * kept for the weights' offset term), so that a block's dot product is integer arithmetic and one
 * float scale. In int8 (bits = 8) as llama.cpp computes it; in int16 (bits = 16, d = max|x| / 32767)
 * its rounding is ~250x finer, and the products follow the dequantized weights' (SmolLM2's Q4_1:
 * teacher-forced top-1 agreement with the float model 0.97 in int8, 1.00 in int16):
 *
 *     y[m, n] = sum_b  dw[n, b] * dx[m, b] * sum_k qw[n, b, k] * qx[m, b, k]     (integer sums)
 *             + sum_b  cw[n, b] * sx[m, b]                                          (Q4 offset term)
 *
 * Q4_1 (w = d q + m): cw = m.  Q4_0 (w = d (q - 8)): cw = -8 d.  Q8_0 (w = d q): no cw (NULL).
 * q8_c (int8 quants with an offset, w = d q + c; kernels/quant_format.py): Q8's bytes, and cw = c.
 *
 * Layout: eight weight rows interleaved (repacked at load, values unchanged: worker/models/quant.py,
 * kernels/quant_format.py), so that each 32-bit lane of a 256-bit vector is one output row:
 *
 *   Q4  per (group of 8 rows, block): 4 x 32 bytes; vector q, lane l = row l, byte i: element 8q + i
 *       in its low nibble and 8q + 4 + i in its high one
 *   Q8  per (group, block): 8 x 32 bytes; vector q, lane l, byte i: element 4q + i of row l
 *   d, c  per (group, block): 8 floats, lane l = row l
 *
 * int8: one unsigned-by-signed byte dot (VNNI dpbusd on AVX512-VNNI, maddubs + madd on AVX2) against
 * four bytes of x broadcast to every lane adds four products to each of the eight rows: a block is 8
 * such instructions and one scale for 8 rows, with no horizontal sum. Q4's nibbles (0..15) go in as
 * they are; Q8_0's signed weights as |w| against x with w's sign. int16: a lane's bytes split into
 * int16 pairs (even bytes, odd bytes) against pairs of x (dpwssd / madd): twice the instructions.
 *
 * Tiles of GR groups (8 rows each) x MR rows of x; one OpenMP loop over tiles of weight groups
 * (libgomp is torch's, so this shares its threads). The VNNI build runs pairs of groups against x in
 * int16 as tile512: 512-bit vectors, up to 8 rows of x a weight vector, bit-identical to tile. Each (m, n) is summed in the same order whatever
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
static inline __m256i dot16_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#else
#define GR 1
#define QNAME(name) name##_avx2
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline __m256i dot16_acc(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
#endif

enum { KIND_Q8 = 0, KIND_Q4 = 1 };

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* One block of 32 floats at p: d = amax / qmax, q[i] = round-half-even(x * (1 / d)) as int32 (8 a
 * vector); returns the int32 partial sums of q (for s = d * sum(q)). */
static inline __m256i block_quants(const float *p, float qmax, __m256i q[4], float *d_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(p + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float d = _mm_cvtss_f32(m) / qmax;
    float id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    *d_out = d;
    return _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
}

/* One row of x in int8: per block, d = amax / 127, q = round-half-even(x * (1 / d)), s = d * sum(q). */
static void quantize_row(const float *x, int64_t K, int8_t *qx, float *dx, float *sx) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / QK; b++) {
        __m256i q[4];
        float d;
        const __m256i sum = block_quants(x + b * QK, 127.0f, q, &d);
        /* packs work within 128-bit lanes: the permute puts the 32 bytes back in order */
        __m256i q01 = _mm256_packs_epi32(q[0], q[1]), q23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), order);
        _mm256_storeu_si256((__m256i *)(qx + b * QK), bytes);
        dx[b] = d;
        sx[b] = d * (float)hsum8i(sum);
    }
}

static inline __m256i bcast4(const void *p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The integer sums of block b of gr weight groups against mr rows of x, added to isum (isum2: a
 * second chain, for few tiles in flight). bits 8: x in bytes; 16: x in int16 pairs in
 * quantize_row16's order, each lane's weights widened to int16 pairs from the same bytes. */
static inline __attribute__((always_inline)) void block_sums(int kind, int bits, int gr, int mr, int split,
                                                             const void *qx, int64_t m0, int64_t K,
                                                             const uint8_t *qs, int64_t g0, int64_t b,
                                                             __m256i isum[GR][MR], __m256i isum2[GR][MR]) {
    const int64_t group_bytes = (kind == KIND_Q8 ? K : K / 2) * LANES;
    const int64_t block_bytes = (kind == KIND_Q8 ? QK : QK / 2) * LANES;
    const __m256i low = _mm256_set1_epi8(0x0F), even = _mm256_set1_epi16(0x00FF);
    const int nvec = kind == KIND_Q8 ? 8 : 4; /* 32-byte weight vectors a block */
    for (int q = 0; q < nvec; q++) {
        /* x for this vector, each row: Q4 elements 8q .. 8q + 7, Q8 4q .. 4q + 3 */
        __m256i xa[MR], xb[MR], xc[MR], xd[MR];
        for (int j = 0; j < mr; j++) {
            const int64_t e = kind == KIND_Q8 ? 4 * q : 8 * q;
            if (bits == 8) {
                const int8_t *xr = (const int8_t *)qx + (m0 + j) * K + b * QK;
                xa[j] = bcast4(xr + e);
                if (kind == KIND_Q4) xb[j] = bcast4(xr + e + 4);
            } else { /* pairs (e, e + 2), (e + 1, e + 3), then (e + 4, e + 6), (e + 5, e + 7) */
                const int16_t *xr = (const int16_t *)qx + (m0 + j) * K + b * QK;
                xa[j] = bcast4(xr + e);
                xb[j] = bcast4(xr + e + 2);
                if (kind == KIND_Q4) {
                    xc[j] = bcast4(xr + e + 4);
                    xd[j] = bcast4(xr + e + 6);
                }
            }
        }
        for (int g = 0; g < gr; g++) {
            const uint8_t *p = qs + (g0 + g) * group_bytes + b * block_bytes + 32 * q;
            const __m256i v = _mm256_loadu_si256((const __m256i *)p);
            const int second = split && (q & 1);
            __m256i lo = v, hi = v;
            if (kind == KIND_Q4) {
                lo = _mm256_and_si256(v, low);
                hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int j = 0; j < mr; j++) {
                __m256i acc = second ? isum2[g][j] : isum[g][j];
                if (kind == KIND_Q4 && bits == 8) {
                    acc = dot_acc(acc, lo, xa[j]);
                    acc = dot_acc(acc, hi, xb[j]);
                } else if (kind == KIND_Q4) {
                    acc = dot16_acc(acc, _mm256_and_si256(lo, even), xa[j]);
                    acc = dot16_acc(acc, _mm256_srli_epi16(lo, 8), xb[j]);
                    acc = dot16_acc(acc, _mm256_and_si256(hi, even), xc[j]);
                    acc = dot16_acc(acc, _mm256_srli_epi16(hi, 8), xd[j]);
                } else if (bits == 8) {
                    acc = dot_acc(acc, _mm256_abs_epi8(v), _mm256_sign_epi8(xa[j], v));
                } else {
                    acc = dot16_acc(acc, _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), xa[j]);
                    acc = dot16_acc(acc, _mm256_srai_epi16(v, 8), xb[j]);
                }
                if (second) isum2[g][j] = acc;
                else isum[g][j] = acc;
            }
        }
    }
}

/* gr weight groups (rows n0 .. n0 + 8 gr) x mr rows of x (m0 ..); constants once inlined. */
static inline __attribute__((always_inline)) void tile(int kind, int bits, int gr, int mr, const void *qx,
                                                       const float *dx, const float *sx, int64_t m0,
                                                       int64_t K, const uint8_t *qs, const float *dw,
                                                       const float *cw, const float *bias, float *y,
                                                       int64_t n0, int64_t N) {
    const int64_t nb = K / QK, g0 = n0 / LANES;
    __m256 acc[GR][MR];
    for (int g = 0; g < gr; g++)
        for (int j = 0; j < mr; j++) acc[g][j] = _mm256_setzero_ps();
    /* Few tiles in flight (one row of x): alternate vectors go to two chains of integer sums, added
     * at the block's end (exact), so that the dot instructions' latency overlaps. */
    const int split = gr * mr < 4;
    const int has_c = kind == KIND_Q4 || cw != 0; /* Q4 always; bytes with an offset: q8_c */
    for (int64_t b = 0; b < nb; b++) {
        __m256i isum[GR][MR], isum2[GR][MR];
        for (int g = 0; g < gr; g++)
            for (int j = 0; j < mr; j++) isum[g][j] = isum2[g][j] = _mm256_setzero_si256();
        block_sums(kind, bits, gr, mr, split, qx, m0, K, qs, g0, b, isum, isum2);
        for (int g = 0; g < gr; g++) {
            __m256 d = _mm256_loadu_ps(dw + ((g0 + g) * nb + b) * LANES);
            __m256 c = has_c ? _mm256_loadu_ps(cw + ((g0 + g) * nb + b) * LANES) : d;
            for (int j = 0; j < mr; j++) {
                if (split) isum[g][j] = _mm256_add_epi32(isum[g][j], isum2[g][j]);
                __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[(m0 + j) * nb + b]));
                acc[g][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[g][j]), scale, acc[g][j]);
                if (has_c) acc[g][j] = _mm256_fmadd_ps(c, _mm256_set1_ps(sx[(m0 + j) * nb + b]), acc[g][j]);
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

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* The same sums for two weight groups at once in 512-bit vectors (lanes 0-7 group g0's rows, 8-15
 * g0 + 1's) against up to MR512 rows of x, x in int16: a weight vector is unpacked once for eight rows
 * and each dpwssd does 32 products, twice tile's. Every lane sums the same integers and applies the
 * same float operations in the same order as tile, so the outputs are bit-identical to it. */
#define MR512 8
static inline __m512i load_pair(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}
static inline __m512 load_pair_ps(const float *p0, const float *p1) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p0)), _mm256_loadu_ps(p1), 1);
}
static inline __m512i bcast4_512(const void *p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline __attribute__((always_inline)) void tile512(int kind, int mr, const int16_t *qx,
                                                          const float *dx, const float *sx, int64_t m0,
                                                          int64_t K, const uint8_t *qs, const float *dw,
                                                          const float *cw, const float *bias, float *y,
                                                          int64_t n0, int64_t N) {
    const int64_t nb = K / QK, g0 = n0 / LANES;
    const int64_t group_bytes = (kind == KIND_Q8 ? K : K / 2) * LANES;
    const int64_t block_bytes = (kind == KIND_Q8 ? QK : QK / 2) * LANES;
    const int nvec = kind == KIND_Q8 ? 8 : 4;
    const int has_c = kind == KIND_Q4 || cw != 0;
    const __m512i low = _mm512_set1_epi8(0x0F), even = _mm512_set1_epi16(0x00FF);
    __m512 acc[MR512];
    for (int j = 0; j < mr; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i isum[MR512];
        for (int j = 0; j < mr; j++) isum[j] = _mm512_setzero_si512();
        const uint8_t *p0 = qs + g0 * group_bytes + b * block_bytes, *p1 = p0 + group_bytes;
        for (int q = 0; q < nvec; q++) {
            const __m512i v = load_pair(p0 + 32 * q, p1 + 32 * q);
            if (kind == KIND_Q4) {
                const __m512i lo = _mm512_and_si512(v, low);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                const __m512i a0 = _mm512_and_si512(lo, even), a1 = _mm512_srli_epi16(lo, 8);
                const __m512i a2 = _mm512_and_si512(hi, even), a3 = _mm512_srli_epi16(hi, 8);
                for (int j = 0; j < mr; j++) {
                    const int16_t *xr = qx + (m0 + j) * K + b * QK + 8 * q;
                    isum[j] = _mm512_dpwssd_epi32(isum[j], a0, bcast4_512(xr));
                    isum[j] = _mm512_dpwssd_epi32(isum[j], a1, bcast4_512(xr + 2));
                    isum[j] = _mm512_dpwssd_epi32(isum[j], a2, bcast4_512(xr + 4));
                    isum[j] = _mm512_dpwssd_epi32(isum[j], a3, bcast4_512(xr + 6));
                }
            } else {
                const __m512i a0 = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), a1 = _mm512_srai_epi16(v, 8);
                for (int j = 0; j < mr; j++) {
                    const int16_t *xr = qx + (m0 + j) * K + b * QK + 4 * q;
                    isum[j] = _mm512_dpwssd_epi32(isum[j], a0, bcast4_512(xr));
                    isum[j] = _mm512_dpwssd_epi32(isum[j], a1, bcast4_512(xr + 2));
                }
            }
        }
        const __m512 d = load_pair_ps(dw + (g0 * nb + b) * LANES, dw + ((g0 + 1) * nb + b) * LANES);
        const __m512 c = has_c ? load_pair_ps(cw + (g0 * nb + b) * LANES, cw + ((g0 + 1) * nb + b) * LANES) : d;
        for (int j = 0; j < mr; j++) {
            __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[(m0 + j) * nb + b]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), scale, acc[j]);
            if (has_c) acc[j] = _mm512_fmadd_ps(c, _mm512_set1_ps(sx[(m0 + j) * nb + b]), acc[j]);
        }
    }
    const int64_t here = N - n0 < 2 * LANES ? N - n0 : 2 * LANES; /* the last group's padding: not stored */
    const __mmask16 keep = (__mmask16)((1u << here) - 1u);
    for (int j = 0; j < mr; j++) {
        __m512 v = acc[j];
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + n0));
        _mm512_mask_storeu_ps(y + (m0 + j) * N + n0, keep, v);
    }
}

#define ROWS_OF_X512(KIND)                                                                              \
    for (int64_t m0 = 0; m0 < M; m0 += MR512) {                                                         \
        switch (M - m0 >= MR512 ? MR512 : (int)(M - m0)) {                                              \
        case 8: tile512(KIND, 8, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;               \
        case 7: tile512(KIND, 7, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;               \
        case 6: tile512(KIND, 6, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;               \
        case 5: tile512(KIND, 5, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;               \
        case 4: tile512(KIND, 4, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;               \
        case 3: tile512(KIND, 3, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;               \
        case 2: tile512(KIND, 2, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;               \
        default: tile512(KIND, 1, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;              \
        }                                                                                               \
    }
#endif

#define ROWS_OF_X(KIND, BITS, GRV)                                                                      \
    for (int64_t m0 = 0; m0 < M; m0 += MR) {                                                            \
        switch (M - m0 >= MR ? MR : (int)(M - m0)) {                                                    \
        case 4: tile(KIND, BITS, GRV, 4, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;       \
        case 3: tile(KIND, BITS, GRV, 3, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;       \
        case 2: tile(KIND, BITS, GRV, 2, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;       \
        default: tile(KIND, BITS, GRV, 1, qx, dx, sx, m0, K, qs, dw, cw, bias, y, n0, N); break;      \
        }                                                                                               \
    }
#define BY_GROUPS(KIND, BITS)                                                                           \
    if (groups == GR) {                                                                                 \
        ROWS_OF_X(KIND, BITS, GR)                                                                       \
    } else {                                                                                            \
        ROWS_OF_X(KIND, BITS, 1)                                                                        \
    }

static void weight_tile(int kind, int bits, const void *qx, const float *dx, const float *sx, int64_t M,
                        int64_t K, const uint8_t *qs, const float *dw, const float *cw, const float *bias,
                        float *y, int64_t n0, int64_t groups, int64_t N) {
#ifdef MR512
    if (bits == 16 && groups == 2) {
        if (kind == KIND_Q8) { ROWS_OF_X512(KIND_Q8) }
        else { ROWS_OF_X512(KIND_Q4) }
        return;
    }
#endif
    if (bits == 8 && kind == KIND_Q8) { BY_GROUPS(KIND_Q8, 8) }
    else if (bits == 8) { BY_GROUPS(KIND_Q4, 8) }
    else if (kind == KIND_Q8) { BY_GROUPS(KIND_Q8, 16) }
    else { BY_GROUPS(KIND_Q4, 16) }
}

/* One row of x in int16: per block, d = amax / 32767, q = round-half-even(x * (1 / d)), s = d * sum(q);
 * each 4 elements [a b c d] stored as [a c b d], the pairs block_sums reads in a 32-bit lane. */
static void quantize_row16(const float *x, int64_t K, int16_t *qx, float *dx, float *sx) {
    for (int64_t b = 0; b < K / QK; b++) {
        __m256i q[4];
        float d;
        const __m256i sum = block_quants(x + b * QK, 32767.0f, q, &d);
        for (int h = 0; h < 2; h++) {
            /* packs interleaves 128-bit lanes; the permute restores order, the shuffles make [a c b d] */
            __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8);
            w = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(w, 0xD8), 0xD8);
            _mm256_storeu_si256((__m256i *)(qx + b * QK + 16 * h), w);
        }
        dx[b] = d;
        sx[b] = d * (float)hsum8i(sum);
    }
}

/* x [M, K] float32 -> its blocks in bits 8 or 16: qx [M, K] of int8 / int16, dx and sx [M, K/32]. */
void QNAME(quantize_rows)(int64_t bits, const float *x, int64_t M, int64_t K, void *qx, float *dx, float *sx,
                          int num_threads) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        if (bits == 8) quantize_row(x + m * K, K, (int8_t *)qx + m * K, dx + m * nb, sx + m * nb);
        else quantize_row16(x + m * K, K, (int16_t *)qx + m * K, dx + m * nb, sx + m * nb);
    }
}

/* y = x @ w^T + bias from x's blocks (quantize_rows). kind: 0 bytes (cw NULL: Q8_0, else q8_c), 1 Q4
 * (cw: Q4_0 / Q4_1).
 * The weight holds ceil(N / 8) groups (the last padded). */
void QNAME(qlinear_blocks)(int64_t kind, int64_t bits, const void *qx, const float *dx, const float *sx,
                           int64_t M, int64_t K, const uint8_t *qs, const float *dw, const float *cw,
                           const float *bias, float *y, int64_t N, int num_threads) {
    /* one or two rows of x: one group a tile reads faster (measured: fewer streams in flight) */
    const int64_t step = M <= 2 ? 1 : GR;
    const int64_t groups = (N + LANES - 1) / LANES, tiles = (groups + step - 1) / step;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t g = t * step, here = groups - g < step ? groups - g : step;
        weight_tile((int)kind, (int)bits, qx, dx, sx, M, K, qs, dw, cw, bias, y, g * LANES, here, N);
    }
}

static inline int64_t x_bytes(int64_t bits, int64_t M, int64_t K) {
    return (M * K * (bits / 8) + 63) & ~(int64_t)63;
}

/* Both in one call: scratch holds x's blocks, then 2 * M * K/32 floats (dx, sx). */
void QNAME(qlinear_f32)(int64_t kind, int64_t bits, const float *x, int64_t M, int64_t K, void *scratch,
                        const uint8_t *qs, const float *dw, const float *cw, const float *bias, float *y,
                        int64_t N, int num_threads) {
    float *dx = (float *)((char *)scratch + x_bytes(bits, M, K)), *sx = dx + M * (K / QK);
    QNAME(quantize_rows)(bits, x, M, K, scratch, dx, sx, num_threads);
    QNAME(qlinear_blocks)(kind, bits, scratch, dx, sx, M, K, qs, dw, cw, bias, y, N, num_threads);
}

/* Bytes of scratch qlinear_f32 needs. */
int64_t QNAME(qlinear_scratch_bytes)(int64_t bits, int64_t M, int64_t K) {
    return x_bytes(bits, M, K) + 2 * M * (K / QK) * (int64_t)sizeof(float);
}
