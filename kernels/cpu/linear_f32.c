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

#include "reduce16.h"

#define NR 4 /* w rows per tile */

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static inline void tile_avx512(const float *x, const float *w, float *y, const float *bias, int64_t m0,
                               int64_t mr, int64_t n0, int64_t nr, int64_t N, int64_t K) {
    __m512 acc[4][NR];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < NR; b++) acc[a][b] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[NR];
        for (int b = 0; b < nr; b++) wv[b] = _mm512_loadu_ps(w + (n0 + b) * K + k);
        for (int a = 0; a < mr; a++) {
            __m512 xv = _mm512_loadu_ps(x + (m0 + a) * K + k);
            for (int b = 0; b < nr; b++) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
        }
    }
    /* The tail, masked, apart from the body: masking the body's loads too (one loop) measured 1.4x
     * slower at 16 rows, where the kernel then lost to MKL. */
    if (k < K) {
        __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[NR];
        for (int b = 0; b < nr; b++) wv[b] = _mm512_maskz_loadu_ps(mask, w + (n0 + b) * K + k);
        for (int a = 0; a < mr; a++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + (m0 + a) * K + k);
            for (int b = 0; b < nr; b++) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
        }
    }
    /* the 16 accumulators reduced together, transposed: ~2 instructions an output, where a horizontal
     * sum each took ~8 (a quarter of the FMAs of a 576-long row) */
    __m512 flat[4 * NR];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < NR; b++) flat[a * NR + b] = acc[a][b];
    __m512 r = reduce16_avx512(flat);
    if (nr == NR) { /* lane 4a+b is (m0+a, n0+b): one masked store a row, the pointer offset back by 4a */
        if (bias) r = _mm512_add_ps(r, _mm512_broadcast_f32x4(_mm_loadu_ps(bias + n0)));
        for (int a = 0; a < mr; a++)
            _mm512_mask_storeu_ps(y + (m0 + a) * N + n0 - 4 * a, (__mmask16)(0xFu << (4 * a)), r);
        return;
    }
    float dots[4 * NR];
    _mm512_storeu_ps(dots, r);
    for (int a = 0; a < mr; a++)
        for (int b = 0; b < nr; b++) y[(m0 + a) * N + n0 + b] = dots[a * NR + b] + (bias ? bias[n0 + b] : 0.0f);
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
    if (M == 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n = 0; n < N; n++) y[n] = row_dot_avx512(x, w + n * K, K) + (bias ? bias[n] : 0.0f);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
        int64_t nr = N - n0 < NR ? N - n0 : NR;
        for (int64_t m0 = 0; m0 < M; m0 += 4) tile_avx512(x, w, y, bias, m0, M - m0 < 4 ? M - m0 : 4, n0, nr, N, K);
    }
}

__attribute__((target("avx2,fma")))
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* AVX2 has 16 vector registers: 2 x rows by NR w rows of accumulators (8) leave room for the loads. */
__attribute__((target("avx2,fma")))
static inline void tile_avx2(const float *x, const float *w, float *y, const float *bias, int64_t m0,
                             int64_t mr, int64_t n0, int64_t nr, int64_t N, int64_t K) {
    __m256 acc[2][NR];
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < NR; b++) acc[a][b] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NR];
        for (int b = 0; b < nr; b++) wv[b] = _mm256_loadu_ps(w + (n0 + b) * K + k);
        for (int a = 0; a < mr; a++) {
            __m256 xv = _mm256_loadu_ps(x + (m0 + a) * K + k);
            for (int b = 0; b < nr; b++) acc[a][b] = _mm256_fmadd_ps(xv, wv[b], acc[a][b]);
        }
    }
    for (int a = 0; a < mr; a++)
        for (int b = 0; b < nr; b++) {
            float s = hsum256(acc[a][b]);
            for (int64_t t = k; t < K; t++) s += x[(m0 + a) * K + t] * w[(n0 + b) * K + t];
            y[(m0 + a) * N + n0 + b] = s + (bias ? bias[n0 + b] : 0.0f);
        }
}

__attribute__((target("avx2,fma")))
void linear_f32_avx2(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                     int64_t K, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
        int64_t nr = N - n0 < NR ? N - n0 : NR;
        for (int64_t m0 = 0; m0 < M; m0 += 2) tile_avx2(x, w, y, bias, m0, M - m0 < 2 ? M - m0 : 2, n0, nr, N, K);
    }
}
