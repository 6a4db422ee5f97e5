/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in bfloat16 (fp32 accumulation, one rounding at the end),
 * for the rows of a decode step on a CPU with AVX512-BF16.
 *
 * vdpbf16ps multiplies 32 bf16 pairs exactly and adds them into 16 fp32 lanes. The loop is
 * linear_f32.c's: tiles of NR w rows by up to MR x rows, acc[MR][NR] vector accumulators, each w tile
 * read from memory once and from L1 for every further tile of x rows. With the weights on 2 MiB pages
 * this read SmolLM2's layers at ~50 GB/s on a 2-core EPYC, oneDNN's packed bf16 GEMV at 22.
 *
 * Every (m, n) output is summed in the same order whatever M and whichever tile it falls in (one
 * accumulator per output, k in steps of 32, one reduction, then the bias), so a row's result does not
 * depend on the batch it came in: batching does not change greedy output. Rounding to bf16 is
 * round-to-nearest-even, as torch's. OpenMP as in linear_f32.c.
 */
#include <immintrin.h>
#include <stdint.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define NR 4 /* w rows per tile */
#define MR 4 /* x rows per tile: 16 accumulators, 4 w vectors and an x vector of the 32 registers */

static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7F800000u) == 0x7F800000u && (v.u & 0x007FFFFFu)) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

TARGET static inline __m512bh load(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

TARGET static inline __m512bh load_masked(__mmask32 mask, const uint16_t *p) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* One tile of MR_ x rows by NR_ w rows, both compile-time (the accumulators stay in registers). */
#define TILE(MR_, NR_)                                                                                   \
    TARGET static void tile_##MR_##x##NR_(const uint16_t *x, const uint16_t *w, uint16_t *y,             \
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
        for (int a = 0; a < MR_; a++)                                                                    \
            for (int b = 0; b < NR_; b++) {                                                              \
                float dot = _mm512_reduce_add_ps(acc[a][b]);                                             \
                y[(m0 + a) * N + n0 + b] = to_bf16(bias ? dot + from_bf16(bias[n0 + b]) : dot);         \
            }                                                                                            \
    }

TILE(1, 4)
TILE(2, 4)
TILE(3, 4)
TILE(4, 4)
TILE(1, 1)

typedef void (*tile_fn)(const uint16_t *, const uint16_t *, uint16_t *, const uint16_t *, int64_t, int64_t,
                        int64_t, int64_t);
static const tile_fn TILES[MR + 1] = {0, tile_1x4, tile_2x4, tile_3x4, tile_4x4};

TARGET void linear_bf16_avx512_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                    int64_t M, int64_t N, int64_t K, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int64_t mr = M - m0 < MR ? M - m0 : MR;
            if (N - n0 >= NR) {
                TILES[mr](x, w, y, bias, m0, n0, N, K);
            } else { /* the last few w rows, one output at a time: the same sums */
                for (int64_t a = m0; a < m0 + mr; a++)
                    for (int64_t n = n0; n < N; n++) tile_1x1(x, w, y, bias, a, n, N, K);
            }
        }
    }
}
