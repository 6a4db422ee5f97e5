/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in bfloat16 (fp32 accumulation, one rounding at the end),
 * for the rows of a decode step on a CPU with AVX512-BF16.
 *
 * vdpbf16ps multiplies 32 bf16 pairs exactly and adds them into 16 fp32 lanes. The loop is
 * linear_f32.c's: tiles of NR w rows by up to MR x rows, acc[MR][NR] vector accumulators, each w tile
 * read from memory once and from L1 for every further tile of x rows. With the weights on 2 MiB pages
 * this read SmolLM2's layers at ~50 GB/s on a 2-core EPYC, oneDNN's packed bf16 GEMV at 22.
 *
 * A tile's 16 accumulators are reduced together, transposed (reduce16: ~2 instructions an output
 * where a horizontal sum each took ~8, as many as the dot products of a 576-long row).
 * Every (m, n) output is summed in the same order whatever M and whichever tile it falls in (one
 * accumulator per output, k in steps of 32, reduce16's tree, then the bias; tree_sum is that tree
 * for one accumulator), so a row's result does not depend on the batch it came in: batching does not
 * change greedy output. Rounding to bf16 is round-to-nearest-even, as torch's. OpenMP as in
 * linear_f32.c.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "prefetch.h"
#include "reduce16.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define NR 4 /* w rows per tile */
#define MR 4 /* x rows per tile: 16 accumulators, 4 w vectors and an x vector of the 32 registers */

static inline float as_float(float f) { return f; }

TARGET static inline __m512bh load(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

TARGET static inline __m512bh load_masked(__mmask32 mask, const uint16_t *p) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* reduce16_avx512's tree (reduce16.h) for one accumulator. */
TARGET static inline float tree_sum(__m512 v) {
    float x[16];
    _mm512_storeu_ps(x, v);
    float s[4];
    for (int L = 0; L < 4; L++) s[L] = (x[4 * L] + x[4 * L + 2]) + (x[4 * L + 1] + x[4 * L + 3]);
    return (s[0] + s[2]) + (s[1] + s[3]);
}

/* A 4-wide tile's outputs, lane 4a+b of r for (m0+a, n0+b), bias added, rows a < mr stored with one
 * masked store each (the pointer is offset back by 4a so that the row's lanes land on its outputs).
 * The bf16 rounding is to_bf16's, lane for lane. */
TARGET static inline __m512 with_bias(__m512 r, const uint16_t *bias, int64_t n0) {
    if (!bias) return r;
    float b4[4] = {from_bf16(bias[n0]), from_bf16(bias[n0 + 1]), from_bf16(bias[n0 + 2]), from_bf16(bias[n0 + 3])};
    return _mm512_add_ps(r, _mm512_broadcast_f32x4(_mm_loadu_ps(b4)));
}

TARGET static inline void store_tile_f32(float *y, int64_t N, int64_t m0, int64_t n0, int mr, __m512 r) {
    for (int a = 0; a < mr; a++) _mm512_mask_storeu_ps(y + (m0 + a) * N + n0 - 4 * a, (__mmask16)(0xFu << (4 * a)), r);
}

TARGET static inline void store_tile_bf16(uint16_t *y, int64_t N, int64_t m0, int64_t n0, int mr, __m512 r) {
    __m512i u = _mm512_castps_si512(r);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rne = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __m256i h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), rne, quiet));
    for (int a = 0; a < mr; a++) _mm256_mask_storeu_epi16(y + (m0 + a) * N + n0 - 4 * a, (__mmask16)(0xFu << (4 * a)), h);
}

/* One tile of MR_ x rows by NR_ w rows, both compile-time (the accumulators stay in registers);
 * OUT_T / TO_OUT: the output's type and rounding (bf16 for torch's layers, float for decode_bf16.c). */
#define TILE(MR_, NR_, SUF, OUT_T, TO_OUT)                                                               \
    TARGET static void tile_##MR_##x##NR_##SUF(const uint16_t *x, const uint16_t *w, OUT_T *y,           \
                                          const uint16_t *bias, int64_t m0, int64_t n0, int64_t N,       \
                                          int64_t K) {                                                   \
        __m512 acc[MR_][NR_];                                                                            \
        for (int a = 0; a < MR_; a++)                                                                    \
            for (int b = 0; b < NR_; b++) acc[a][b] = _mm512_setzero_ps();                               \
        int64_t k = 0;                                                                                   \
        for (; k + 32 <= K; k += 32) {                                                                   \
            __m512bh wv[NR_];                                                                            \
            for (int b = 0; b < NR_; b++) wv[b] = load(w + (n0 + b) * K + k);                            \
            for (int a = 0; a < MR_; a++) {                                                              \
                __m512bh xv = load(x + (m0 + a) * K + k);                                                \
                for (int b = 0; b < NR_; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[b], xv);        \
            }                                                                                            \
        }                                                                                                \
        if (k < K) { /* the tail, masked, apart from the body (see linear_f32.c) */                      \
            __mmask32 mask = (__mmask32)((1u << (K - k)) - 1u);                                          \
            __m512bh wv[NR_];                                                                            \
            for (int b = 0; b < NR_; b++) wv[b] = load_masked(mask, w + (n0 + b) * K + k);               \
            for (int a = 0; a < MR_; a++) {                                                              \
                __m512bh xv = load_masked(mask, x + (m0 + a) * K + k);                                   \
                for (int b = 0; b < NR_; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[b], xv);        \
            }                                                                                            \
        }                                                                                                \
        if (MR_ * NR_ == 1) {                                                                            \
            float dot = tree_sum(acc[0][0]);                                                             \
            y[m0 * N + n0] = TO_OUT(bias ? dot + from_bf16(bias[n0]) : dot);                             \
        } else {                                                                                         \
            __m512 flat[16];                                                                             \
            for (int j = 0; j < 16; j++) flat[j] = _mm512_setzero_ps();                                  \
            for (int a = 0; a < MR_; a++)                                                                \
                for (int b = 0; b < NR_; b++) flat[a * 4 + b] = acc[a][b];                               \
            store_tile##SUF(y, N, m0, n0, MR_, with_bias(reduce16_avx512(flat), bias, n0));              \
        }                                                                                                \
    }

/* The entry point: tiles of MR x NR, the last w rows one output at a time (the same sums); one x row
 * goes w row by row (one stream per thread: faster at batch 1, still the same sum per output). */
#define DEFINE_LINEAR(NAME, SUF, OUT_T)                                                                         \
    TILE(1, 4, SUF, OUT_T, CONVERT##SUF)                                                                 \
    TILE(2, 4, SUF, OUT_T, CONVERT##SUF)                                                                 \
    TILE(3, 4, SUF, OUT_T, CONVERT##SUF)                                                                 \
    TILE(4, 4, SUF, OUT_T, CONVERT##SUF)                                                                 \
    TILE(1, 1, SUF, OUT_T, CONVERT##SUF)                                                                 \
    TARGET void NAME(const uint16_t *x, const uint16_t *w, const uint16_t *bias, OUT_T *y, int64_t M,     \
                     int64_t N, int64_t K, int num_threads) {                                            \
        if (M == 1) {                                                                                    \
            _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                       \
            for (int64_t n = 0; n < N; n++) tile_1x1##SUF(x, w, y, bias, 0, n, N, K);                    \
            return;                                                                                      \
        }                                                                                                \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                           \
        for (int64_t n0 = 0; n0 < N; n0 += NR) {                                                         \
            struct prefetcher pf = prefetch_ahead(w, n0, NR, N, K * 2, (M + MR - 1) / MR);               \
            for (int64_t m0 = 0; m0 < M; m0 += MR) {                                                     \
                int64_t mr = M - m0 < MR ? M - m0 : MR;                                                  \
                prefetch_share(&pf);                                                                     \
                if (N - n0 < NR) {                                                                       \
                    for (int64_t a = m0; a < m0 + mr; a++)                                               \
                        for (int64_t n = n0; n < N; n++) tile_1x1##SUF(x, w, y, bias, a, n, N, K);       \
                } else if (mr == 4) {                                                                    \
                    tile_4x4##SUF(x, w, y, bias, m0, n0, N, K);                                          \
                } else if (mr == 3) {                                                                    \
                    tile_3x4##SUF(x, w, y, bias, m0, n0, N, K);                                          \
                } else if (mr == 2) {                                                                    \
                    tile_2x4##SUF(x, w, y, bias, m0, n0, N, K);                                          \
                } else {                                                                                 \
                    tile_1x4##SUF(x, w, y, bias, m0, n0, N, K);                                          \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

#define CONVERT_bf16 to_bf16
#define CONVERT_f32 as_float
DEFINE_LINEAR(linear_bf16_avx512_bf16, _bf16, uint16_t)
DEFINE_LINEAR(linear_bf16_f32out_avx512_bf16, _f32, float)
