/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32, for the few rows of a decode step.
 *
 * At batch 1 a decode step is a matrix-vector product per linear, bound by reading w once from memory.
 * MKL's sgemm reads a cold w at about 12 GB/s there (2-core EPYC, 36-50 GB/s read bandwidth); a row
 * sweep that streams w once, with the M rows of x kept hot, reads it at 30.
 *
 *     w rows n0..n0+NR   x rows m0..m0+MR         acc[MR][NR] vector accumulators, one per (m, n)
 *     [------ K ------]  [------ K ------]        k walks both in steps of one vector
 *
 * Each w tile (NR rows) is read from memory once and from L1 for every further tile of x rows. One
 * OpenMP loop over w's row tiles: libgomp is the one torch loaded (same soname), so this shares torch's
 * thread pool. One function per ISA (target attributes), the caller picks by the CPU probe; the build
 * needs no -m flags, so one .so serves every CPU.
 */
#include <immintrin.h>
#include <stdint.h>

#include "prefetch.h"
#include "reduce16.h"

#define NR 4 /* w rows per tile */
#define ROW_BLOCK 128 /* x rows a pass over w: 128 x 1536 floats, 768 KiB */

/* mr (<= 4) x rows by nr (<= NR) w rows, one accumulator an output. Always inlined with mr and nr
 * constants (tile_mn_avx512's switch), so the loops unroll and the 16 accumulators stay in registers;
 * with bounds known only at run time they lived on the stack (an FMA a load and a store). SmolLM2's
 * linears at 64 rows, cold: 203 GFLOPS then, 254 now, of a 474 GFLOPS FMA peak (2-core Zen 5 EPYC). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static inline __attribute__((always_inline)) void tile_avx512(const float *x, const float *w, float *y,
                                                               const float *bias, int mr, int nr,
                                                               int64_t N, int64_t K) {
    __m512 acc[4][NR];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < NR; b++) acc[a][b] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[NR];
        for (int b = 0; b < nr; b++) wv[b] = _mm512_loadu_ps(w + b * K + k);
        for (int a = 0; a < mr; a++) {
            __m512 xv = _mm512_loadu_ps(x + a * K + k);
            for (int b = 0; b < nr; b++) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
        }
    }
    /* The tail, masked, apart from the body: masking the body's loads too (one loop) measured 1.4x
     * slower at 16 rows, where the kernel then lost to MKL. */
    if (k < K) {
        __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[NR];
        for (int b = 0; b < nr; b++) wv[b] = _mm512_maskz_loadu_ps(mask, w + b * K + k);
        for (int a = 0; a < mr; a++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + a * K + k);
            for (int b = 0; b < nr; b++) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
        }
    }
    /* the 16 accumulators reduced together, transposed: ~2 instructions an output, where a horizontal
     * sum each took ~8 (a quarter of the FMAs of a 576-long row) */
    __m512 flat[4 * NR];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < NR; b++) flat[a * NR + b] = acc[a][b];
    __m512 r = reduce16_avx512(flat);
    if (nr == NR) { /* lane 4a+b is (row a, w row b): one masked store a row, the pointer offset back by 4a */
        if (bias) r = _mm512_add_ps(r, _mm512_broadcast_f32x4(_mm_loadu_ps(bias)));
        for (int a = 0; a < mr; a++) _mm512_mask_storeu_ps(y + a * N - 4 * a, (__mmask16)(0xFu << (4 * a)), r);
        return;
    }
    float dots[4 * NR];
    _mm512_storeu_ps(dots, r);
    for (int a = 0; a < mr; a++)
        for (int b = 0; b < nr; b++) y[a * N + b] = dots[a * NR + b] + (bias ? bias[b] : 0.0f);
}

/* tile_avx512 with mr and nr as constants in every branch. */
#define TILE_NR_AVX512(mr)                                                                         \
    switch (nr) {                                                                                  \
    case 4: tile_avx512(x, w, y, bias, mr, 4, N, K); break;                                        \
    case 3: tile_avx512(x, w, y, bias, mr, 3, N, K); break;                                        \
    case 2: tile_avx512(x, w, y, bias, mr, 2, N, K); break;                                        \
    default: tile_avx512(x, w, y, bias, mr, 1, N, K); break;                                       \
    }
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static void tile_mn_avx512(const float *x, const float *w, float *y, const float *bias, int64_t mr,
                           int64_t nr, int64_t N, int64_t K) {
    switch (mr) {
    case 4: TILE_NR_AVX512(4); break;
    case 3: TILE_NR_AVX512(3); break;
    case 2: TILE_NR_AVX512(2); break;
    default: TILE_NR_AVX512(1); break;
    }
}

/* One x row: w streamed row by row (one stream per thread), four accumulators along k. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static inline float row_dot_avx512(const float *x, const float *r, int64_t K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(r + k), _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(r + k + 16), _mm512_loadu_ps(x + k + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(r + k + 32), _mm512_loadu_ps(x + k + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(r + k + 48), _mm512_loadu_ps(x + k + 48), a3);
    }
    for (; k < K; k += 16) {
        __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1u);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, r + k), _mm512_maskz_loadu_ps(mask, x + k), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
void linear_f32_avx512(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int num_threads) {
    if (M > ROW_BLOCK) { /* x a block of rows at a time, so that it stays in L2 while w streams past */
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK)
            linear_f32_avx512(x + m0 * K, w, bias, y + m0 * N, M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK, N, K,
                              num_threads);
        return;
    }
    if (M == 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n = 0; n < N; n++) y[n] = row_dot_avx512(x, w + n * K, K) + (bias ? bias[n] : 0.0f);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
        int64_t nr = N - n0 < NR ? N - n0 : NR;
        struct prefetcher pf = prefetch_ahead(w, n0, NR, N, K * sizeof(float), (M + 3) / 4);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            prefetch_share(&pf);
            tile_mn_avx512(x + m0 * K, w + n0 * K, y + m0 * N + n0, bias ? bias + n0 : 0, M - m0 < 4 ? M - m0 : 4,
                           nr, N, K);
        }
    }
}

__attribute__((target("avx2,fma")))
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One w row against mr (1 or 2) x rows, streamed: four accumulators along k for each row (vectors of
 * 8 in turn), their sum, the tail, then the bias. */
__attribute__((target("avx2,fma")))
static inline __attribute__((always_inline)) void row_dot_avx2(const float *x, int mr, const float *r,
                                                                int64_t K, float b, float *y, int64_t N) {
    __m256 a[2][4];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
        for (int j = 0; j < 4; j++) {
            __m256 wv = _mm256_loadu_ps(r + k + 8 * j);
            for (int i = 0; i < mr; i++) a[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * K + k + 8 * j), a[i][j]);
        }
    for (; k + 8 <= K; k += 8) {
        __m256 wv = _mm256_loadu_ps(r + k);
        for (int i = 0; i < mr; i++) a[i][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * K + k), a[i][0]);
    }
    for (int i = 0; i < mr; i++) {
        float s = hsum256(_mm256_add_ps(_mm256_add_ps(a[i][0], a[i][1]), _mm256_add_ps(a[i][2], a[i][3])));
        for (int64_t t = k; t < K; t++) s += x[i * K + t] * r[t];
        y[i * N] = s + b;
    }
}

/* TM x rows by TN w rows, one accumulator an output: 12 accumulators, 3 w vectors and an x vector of
 * AVX2's 16 registers. mr and nr are constants at every call (the caller's switch), so the loops
 * unroll and the accumulators stay in registers; with bounds known only at run time they spilled
 * (the tile read 7 GB/s at 16 rows where this reads 11). */
#define TM 4
#define TN 3
__attribute__((target("avx2,fma")))
static inline __attribute__((always_inline)) void tile_avx2(const float *x, const float *w, float *y,
                                                             const float *bias, int mr, int nr, int64_t N,
                                                             int64_t K) {
    __m256 acc[TM][TN];
    for (int a = 0; a < TM; a++)
        for (int b = 0; b < TN; b++) acc[a][b] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[TN];
        for (int b = 0; b < nr; b++) wv[b] = _mm256_loadu_ps(w + b * K + k);
        for (int a = 0; a < mr; a++) {
            __m256 xv = _mm256_loadu_ps(x + a * K + k);
            for (int b = 0; b < nr; b++) acc[a][b] = _mm256_fmadd_ps(xv, wv[b], acc[a][b]);
        }
    }
    for (int a = 0; a < mr; a++)
        for (int b = 0; b < nr; b++) {
            float s = hsum256(acc[a][b]);
            for (int64_t t = k; t < K; t++) s += x[a * K + t] * w[b * K + t];
            y[a * N + b] = s + (bias ? bias[b] : 0.0f);
        }
}

/* Up to ROWS_STREAMED rows, w is streamed a row at a time (one stream per thread, as the AVX-512
 * M = 1 path; 2 rows of x a pass): at batch 1 it read SmolLM2's layers at ~30 GB/s on a 2-core EPYC
 * (37 GB/s read bandwidth) where 4-row tiles read 24. Past it the steps are compute-bound and the
 * TM x TN tile wins (16 rows: 37 ms where streaming took 45, MKL 55, for SmolLM2's 30 layers). */
#define ROWS_STREAMED 4

/* mr x rows (a constant) by the nr (1..TN) w rows at n0, with nr a constant in each branch. */
__attribute__((target("avx2,fma")))
static inline __attribute__((always_inline)) void tile_nr_avx2(const float *x, const float *w, float *y,
                                                                const float *bias, int mr, int64_t nr,
                                                                int64_t N, int64_t K) {
    switch (nr) {
    case 3: tile_avx2(x, w, y, bias, mr, 3, N, K); break;
    case 2: tile_avx2(x, w, y, bias, mr, 2, N, K); break;
    default: tile_avx2(x, w, y, bias, mr, 1, N, K); break;
    }
}

__attribute__((target("avx2,fma")))
static void rows_of_x_avx2(const float *x, const float *w, float *y, const float *bias, int64_t M,
                           int64_t n0, int64_t nr, int64_t N, int64_t K) {
    const float *wn = w + n0 * K, *bn = bias ? bias + n0 : 0;
    struct prefetcher pf = prefetch_ahead(w, n0, TN, N, K * sizeof(float), (M + TM - 1) / TM);
    int64_t m0 = 0;
    for (; m0 + TM <= M; m0 += TM) {
        prefetch_share(&pf);
        tile_nr_avx2(x + m0 * K, wn, y + m0 * N + n0, bn, TM, nr, N, K);
    }
    for (; m0 < M; m0++) {
        prefetch_share(&pf);
        tile_nr_avx2(x + m0 * K, wn, y + m0 * N + n0, bn, 1, nr, N, K);
    }
}

__attribute__((target("avx2,fma")))
void linear_f32_avx2(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                     int64_t K, int num_threads) {
    if (M <= ROWS_STREAMED) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *r = w + n * K, b = bias ? bias[n] : 0.0f;
            int64_t m = 0;
            for (; m + 2 <= M; m += 2) row_dot_avx2(x + m * K, 2, r, K, b, y + m * N + n, N);
            if (m < M) row_dot_avx2(x + m * K, 1, r, K, b, y + m * N + n, N);
        }
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += TN)
        rows_of_x_avx2(x, w, y, bias, M, n0, N - n0 < TN ? N - n0 : TN, N, K);
}
