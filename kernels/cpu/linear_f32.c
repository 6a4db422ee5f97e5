/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32, over w packed in panels of PANEL rows.
 *
 *     packed[p][k][j] = w[p * PANEL + j][k]      (kernels/cpu/linear.py: pack_weight; rows past N zero)
 *
 * A panel is PANEL outputs wide and K deep, contiguous: a k step of the tile below reads PANEL
 * consecutive floats of it and broadcasts one float of each x row (a GEMM micro-kernel's layout), so
 * the accumulators are whole output vectors: no horizontal sums, and every output is the plain
 * sequential sum over k (one FMA a k, from 0, then + bias) whatever the tile, the row count or the
 * ISA: a row's result does not depend on its batch, and AVX2 and AVX-512 agree bit for bit.
 *
 *     AVX-512: MR_512 (8) x rows by the 48 outputs of a panel, 24 zmm accumulators
 *     AVX2:    MR_256 (4) x rows by 24 outputs (a panel in two halves, k in blocks), 12 ymm accumulators;
 *              fewer rows: one row by the whole panel, 6 accumulators
 *
 * One OpenMP region over panels (libgomp is the one torch loaded, same soname: torch's thread pool),
 * each thread a contiguous share of them (thread_panels), then the rest of the others' shares from their
 * backs (over_panels). While a panel's tiles run, the next panel is
 * prefetched into L2 a share per tile (the hardware prefetcher alone left the first tile of each panel
 * waiting on memory: 16 rows 0.91 -> 0.86 of the row-major kernel's time, 8 rows 0.97 -> 0.91), but
 * not for one row, a single stream the hardware follows (0.92 without, 1.14 with; medians of 30
 * alternations); a thread's last panel prefetches its first of the call after (`_then`: the fused
 * layer's next linear; the next block of rows): 32-row decode steps 0.976 / 0.979 on AVX2 (1.000 on
 * AVX-512), 200-token prefill 0.981. SmolLM2's 120 layer linears, 424 MB, cold, best of 5 (2-core
 * Zen 5 EPYC, 474 GFLOPS FMA peak): AVX-512 at 32 rows 15.3 ms (445 GFLOPS) where the 4 x 4 tile over row-major w took 23.2, at
 * 128 rows 55 ms (493) where it took 67; AVX2 (237 peak) level with its 4 x 3 tile (~220 from 64
 * rows) and ahead of MKL's sgemm (116-172). One function per ISA (target attributes): the build
 * needs no -m flags, one .so serves every CPU, the caller picks by the CPU probe.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>

#define PANEL 48     /* outputs a panel: 3 zmm, 6 ymm; SmolLM2's 192, 576, 960, 1536, 3072, 49152 divide */
#define MR_512 8     /* x rows an AVX-512 tile: 8 x 3 accumulators, 3 w vectors, a broadcast of 32 zmm */
#define MR_256 4     /* x rows an AVX2 tile: 4 x 3 accumulators, 3 w vectors, a broadcast of 16 ymm */
#define ROW_BLOCK 256 /* at most this many x rows a pass over w: the panel is reused from L2 by every group
                      * of them. 128 cut a mixed step's 146 rows into 128 + 18, two reads of every weight:
                      * SmolLM2's 120 linears cold at 146 rows 106 -> 95 ms with one pass of 146 (2-core
                      * Intel Xeon, AVX-512); 200-400 rows level */
#define K_CHUNK 16   /* k steps between prefetch bursts (a burst in the k loop itself kept the
                      * accumulators in memory: GCC stored them every step) */
#define K_BLOCK_256 96 /* k steps an AVX2 pass over a panel: 96 x 192 bytes (18 KB) stay in a 32 KB L1 while
                        * every group of rows reads them, both halves of each panel row (panel_avx2) */

int64_t linear_f32_panel(void) { return PANEL; }
/* The fused decode layer (decode_f32.c) slices a larger step into calls of at most this many rows. */
int64_t linear_f32_row_block(void) { return ROW_BLOCK; }

/* out[t, :] = row ids[t] of the packed weight of N rows (a tied model's embedding read from its logits
 * matrix): K floats PANEL apart. Returns -1, or the first t whose id is outside [0, N) (nothing read
 * for it). Through torch's indexing this took ~0.4 ms a decode step. */
int64_t linear_f32_gather_rows(const float *packed, int64_t N, const int64_t *ids, int64_t T, int64_t K,
                               float *out) {
    for (int64_t t = 0; t < T; t++) {
        if (ids[t] < 0 || ids[t] >= N) return t;
        const float *src = packed + (ids[t] / PANEL) * K * PANEL + ids[t] % PANEL;
        for (int64_t k = 0; k < K; k++) out[t * K + k] = src[k * PANEL];
    }
    return -1;
}

/* The next panel's lines, a share a tile: the tiles of one panel fetch it all between them (none for
 * next_panel 0). */
struct panel_prefetch {
    const char *at, *end;
    int64_t per_chunk; /* lines a K_CHUNK of k steps */
};

static inline struct panel_prefetch panel_prefetch(const float *next_panel, int64_t next_K, int64_t K, int64_t tile,
                                                   int64_t num_tiles) {
    if (!next_panel) return (struct panel_prefetch){0, 0, 0}; /* nothing to fetch: no bursts */
    int64_t lines = (next_K * PANEL * (int64_t)sizeof(float) + 63) / 64, share = (lines + num_tiles - 1) / num_tiles;
    const char *base = (const char *)next_panel;
    int64_t chunks = (K + K_CHUNK - 1) / K_CHUNK; /* this tile's bursts */
    struct panel_prefetch pf = {base + tile * share * 64, base + (tile + 1) * share * 64,
                                (share + chunks - 1) / chunks};
    return pf;
}

static inline void prefetch_burst(struct panel_prefetch *pf) {
    for (int64_t i = 0; i < pf->per_chunk && pf->at < pf->end; i++, pf->at += 64) _mm_prefetch(pf->at, _MM_HINT_T1);
}

/* The weight of the call that follows this one (a fused layer's next linear; the same weight for the
 * next block of rows), or packed 0: a thread's last panel prefetches its first panel of that call, which
 * would otherwise start cold (at 32 rows a linear's first panels waited on memory: the time a row
 * 15-27% over 128 rows' with the weights cold, level with them hot). */
struct then_weight {
    const float *packed;
    int64_t N, K;
};

/* Panels holding N outputs (linear.py's num_panels). */
static inline int64_t panels_of(int64_t N) { return (N + PANEL - 1) / PANEL; }

/* A thread's panels of num_panels, [first, end): contiguous, as even as they go (so a thread's first
 * panel of the call that follows is known before that call starts). */
static inline void thread_panels(int64_t num_panels, int thread, int threads, int64_t *first, int64_t *end) {
    int64_t q = num_panels / threads, r = num_panels % threads;
    *first = thread * q + (thread < r ? thread : r);
    *end = *first + q + (thread < r);
}

/* The panel a thread prefetches while it computes panel p of [.., end): p + 1, or its first of `then`
 * (its K in *next_K); 0 for one row (a single stream the hardware prefetcher follows). */
static inline const float *next_panel(const float *packed, int64_t p, int64_t end, int64_t M, int64_t K,
                                      struct then_weight then, int thread, int threads, int64_t *next_K) {
    if (M <= 1) return 0;
    if (p + 1 < end) {
        *next_K = K;
        return packed + (p + 1) * K * PANEL;
    }
    if (!then.packed) return 0;
    int64_t first, stop;
    thread_panels(panels_of(then.N), thread, threads, &first, &stop);
    if (first >= stop) return 0;
    *next_K = then.K;
    return then.packed + first * then.K * PANEL;
}

/* mr (<= MR_512, a constant at every call: tile_m_avx512's switch) rows by the panel's 48 outputs,
 * of which ncols are stored. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static inline __attribute__((always_inline)) void tile_avx512(const float *x, const float *panel, float *y,
                                                               const float *bias, int mr, int64_t N, int64_t K,
                                                               int64_t ncols, struct panel_prefetch pf) {
    __m512 acc[MR_512][3];
    for (int a = 0; a < MR_512; a++)
        for (int j = 0; j < 3; j++) acc[a][j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
        prefetch_burst(&pf);
        int64_t k1 = k0 + K_CHUNK < K ? k0 + K_CHUNK : K;
        for (int64_t k = k0; k < k1; k++) {
            const float *w = panel + k * PANEL;
            __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
            for (int a = 0; a < mr; a++) {
                __m512 xa = _mm512_set1_ps(x[a * K + k]);
                acc[a][0] = _mm512_fmadd_ps(xa, w0, acc[a][0]);
                acc[a][1] = _mm512_fmadd_ps(xa, w1, acc[a][1]);
                acc[a][2] = _mm512_fmadd_ps(xa, w2, acc[a][2]);
            }
        }
    }
    for (int j = 0; j < 3; j++) {
        int64_t left = ncols - 16 * j;
        if (left <= 0) break;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
        for (int a = 0; a < mr; a++) _mm512_mask_storeu_ps(y + a * N + 16 * j, mask, _mm512_add_ps(acc[a][j], b));
    }
}

#define TILE_512(m) case m: tile_avx512(x, panel, y, bias, m, N, K, ncols, pf); break;
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static void tile_m_avx512(const float *x, const float *panel, float *y, const float *bias, int64_t mr, int64_t N,
                          int64_t K, int64_t ncols, struct panel_prefetch pf) {
    switch (mr) {
        TILE_512(8) TILE_512(7) TILE_512(6) TILE_512(5) TILE_512(4) TILE_512(3) TILE_512(2)
    default: tile_avx512(x, panel, y, bias, 1, N, K, ncols, pf); break;
    }
}

/* One ISA's work on panel p (at panel) for M <= ROW_BLOCK rows of x, its tiles prefetching `next`
 * (next_K deep; 0: nothing) a share each. */
typedef void (*panel_fn)(const float *x, const float *panel, const float *bias, float *y, int64_t M, int64_t N,
                         int64_t K, int64_t p, const float *next, int64_t next_K);

/* A thread's share of a call's panels, [front, back) in one word (front in the low half) so that each
 * panel is taken once: its owner takes from the front, a thread done with its own share from the back. */
typedef _Atomic uint64_t panel_share;

static inline int take_front(panel_share *share, int64_t *p) {
    uint64_t v = atomic_load_explicit(share, memory_order_relaxed);
    while ((uint32_t)v < (uint32_t)(v >> 32))
        if (atomic_compare_exchange_weak_explicit(share, &v, v + 1, memory_order_relaxed, memory_order_relaxed)) {
            *p = (uint32_t)v;
            return 1;
        }
    return 0;
}

static inline int take_back(panel_share *share, int64_t *p) {
    uint64_t v = atomic_load_explicit(share, memory_order_relaxed);
    while ((uint32_t)v < (uint32_t)(v >> 32))
        if (atomic_compare_exchange_weak_explicit(share, &v, v - ((uint64_t)1 << 32), memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *p = (uint32_t)(v >> 32) - 1;
            return 1;
        }
    return 0;
}

/* Every panel for M <= ROW_BLOCK rows: one OpenMP region, each thread its share (thread_panels, whose
 * next panels it prefetches), then what is left of the others' shares, from their backs. A panel's
 * outputs are the same bits whichever thread computes them. With the split alone a thread that the
 * machine paused (the gateway or a client on the same two cores) held the other at the region's end:
 * SmolLM2's 120 linears cold on a 2-core Zen 3 EPYC (AVX2), alternated in one process, 32 rows 73.5 ->
 * 71.0 ms and 256 rows 540 -> 501 quiet, 85.5 -> 77.2 and 538 -> 477 beside a process busy 1 ms in 5. */
static void over_panels(panel_fn fn, const float *x, const float *packed, const float *bias, float *y, int64_t M,
                        int64_t N, int64_t K, int num_threads, struct then_weight then) {
    const int64_t num_panels = panels_of(N);
    panel_share shares[num_threads > 0 ? num_threads : 1];
    for (int t = 0; t < num_threads; t++) atomic_init(&shares[t], 0); /* empty until its owner starts */
#pragma omp parallel num_threads(num_threads)
    {
        const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
        int64_t first, end, p;
        thread_panels(num_panels, thread, threads, &first, &end);
        atomic_store_explicit(&shares[thread], (uint64_t)first | ((uint64_t)end << 32), memory_order_relaxed);
        while (take_front(&shares[thread], &p)) {
            int64_t next_K = K;
            const float *next = next_panel(packed, p, end, M, K, then, thread, threads, &next_K);
            fn(x, packed + p * K * PANEL, bias, y, M, N, K, p, next, next_K);
        }
        for (int other = 1; other < threads; other++)
            while (take_back(&shares[(thread + other) % threads], &p))
                fn(x, packed + p * K * PANEL, bias, y, M, N, K, p, 0, K);
    }
}

/* M rows in as few passes over w as blocks of at most ROW_BLOCK rows allow, the rows shared evenly
 * between the passes (whole MR_512 tiles but the last): each pass reads all of w from memory again. */
static void over_row_blocks(panel_fn fn, const float *x, const float *packed, const float *bias, float *y,
                            int64_t M, int64_t N, int64_t K, int num_threads, struct then_weight then) {
    const int64_t passes = (M + ROW_BLOCK - 1) / ROW_BLOCK, even = (M + passes - 1) / passes;
    const int64_t rows = (even + MR_512 - 1) / MR_512 * MR_512;
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const struct then_weight after = m0 + rows < M ? (struct then_weight){packed, N, K} : then;
        over_panels(fn, x + m0 * K, packed, bias, y + m0 * N, M - m0 < rows ? M - m0 : rows, N, K,
                    num_threads, after);
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static void panel_avx512(const float *x, const float *panel, const float *bias, float *y, int64_t M, int64_t N,
                         int64_t K, int64_t p, const float *next, int64_t next_K) {
    const int64_t num_tiles = (M + MR_512 - 1) / MR_512, n0 = p * PANEL, ncols = N - n0 < PANEL ? N - n0 : PANEL;
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t m0 = t * MR_512;
        tile_m_avx512(x + m0 * K, panel, y + m0 * N + n0, bias ? bias + n0 : 0, M - m0 < MR_512 ? M - m0 : MR_512,
                      N, K, ncols, panel_prefetch(next, next_K, K, t, num_tiles));
    }
}

/* AVX2: MR_256 rows (x0..x3) by the 24 outputs at panel, K steps of k, into out: the sums so far are
 * in out unless `first` (a panel's k runs in blocks, panel_avx2; the rows past the last whole group go
 * a row at a time, row_avx2). Named accumulators, not an array: GCC -O3 kept an array of them in
 * memory as well (a store an FMA, half the speed). 4 x 24 rather than 6 x 16: a panel in two passes,
 * not three, and 32 rows in whole groups; SmolLM2's linears at 32 rows 8-11% less time, at 128 2-3%. */
__attribute__((target("avx2,fma")))
static void tile_avx2(const float *x0, const float *x1, const float *x2, const float *x3, const float *panel,
                      int64_t K, float out[MR_256][24], int first, struct panel_prefetch pf) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00, a20 = a00,
           a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    if (!first) {
#define IN(r) a##r##0 = _mm256_loadu_ps(out[r]), a##r##1 = _mm256_loadu_ps(out[r] + 8), a##r##2 = _mm256_loadu_ps(out[r] + 16);
        IN(0) IN(1) IN(2) IN(3)
#undef IN
    }
    for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
        prefetch_burst(&pf);
        int64_t k1 = k0 + K_CHUNK < K ? k0 + K_CHUNK : K;
        for (int64_t k = k0; k < k1; k++) {
            __m256 w0 = _mm256_loadu_ps(panel + k * PANEL), w1 = _mm256_loadu_ps(panel + k * PANEL + 8),
                   w2 = _mm256_loadu_ps(panel + k * PANEL + 16), b;
#define ROW(r)                                                                                                      \
    b = _mm256_broadcast_ss(x##r + k);                                                                              \
    a##r##0 = _mm256_fmadd_ps(b, w0, a##r##0);                                                                      \
    a##r##1 = _mm256_fmadd_ps(b, w1, a##r##1);                                                                      \
    a##r##2 = _mm256_fmadd_ps(b, w2, a##r##2);
            ROW(0) ROW(1) ROW(2) ROW(3)
#undef ROW
        }
    }
#define OUT(r) _mm256_storeu_ps(out[r], a##r##0), _mm256_storeu_ps(out[r] + 8, a##r##1), _mm256_storeu_ps(out[r] + 16, a##r##2);
    OUT(0) OUT(1) OUT(2) OUT(3)
#undef OUT
}

/* One x row by a whole panel (6 accumulators, w read as the FMAs' memory operands). */
__attribute__((target("avx2,fma")))
static void row_avx2(const float *x, const float *panel, int64_t K, float out[PANEL], struct panel_prefetch pf) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
        prefetch_burst(&pf);
        int64_t k1 = k0 + K_CHUNK < K ? k0 + K_CHUNK : K;
        for (int64_t k = k0; k < k1; k++) {
            const float *w = panel + k * PANEL;
            __m256 b = _mm256_broadcast_ss(x + k);
            a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(w), a0);
            a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + 8), a1);
            a2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + 16), a2);
            a3 = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + 24), a3);
            a4 = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + 32), a4);
            a5 = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + 40), a5);
        }
    }
    _mm256_storeu_ps(out, a0), _mm256_storeu_ps(out + 8, a1), _mm256_storeu_ps(out + 16, a2);
    _mm256_storeu_ps(out + 24, a3), _mm256_storeu_ps(out + 32, a4), _mm256_storeu_ps(out + 40, a5);
}

/* sums (+ bias) into y: ncols of each of mr rows, rows out_stride floats apart in sums */
__attribute__((target("avx2,fma")))
static void store_rows_avx2(const float *sums, int64_t out_stride, float *y, int64_t N, const float *bias,
                            int64_t mr, int64_t ncols) {
    for (int64_t r = 0; r < mr; r++) {
        const float *s = sums + r * out_stride;
        float *yr = y + r * N;
        int64_t j = 0;
        for (; j + 8 <= ncols; j += 8) {
            __m256 v = _mm256_loadu_ps(s + j);
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
            _mm256_storeu_ps(yr + j, v);
        }
        for (; j < ncols; j++) yr[j] = s[j] + (bias ? bias[j] : 0.0f);
    }
}

/* The groups of MR_256 rows run K_BLOCK_256 steps of k at a time, each block both halves of the panel
 * (its rows read whole, from L1), the sums kept in sums between blocks: the same FMAs in the same order
 * as one pass over all of k, so the same bits. Over all of k, a half at a time, each tile streamed its
 * 55 KB (K 576) of strided half rows from L2. On a 2-core Zen 3 EPYC (AVX2 only, 88 GFLOPS FMA peak a
 * core), alternating the two in one process: SmolLM2's 120 layer linears, cold, two threads, 32 rows
 * 88.1 -> 81.0 ms (median of 21), 256 rows level (528 / 524); one linear hot on one thread 67-77 -> 75-87
 * GFLOPS at 32-256 rows. Groups outer or halves outer in a block: level. Blocks of 192 steps (36 KB), or a
 * half panel at a time over all of k in blocks, gained nothing. */
__attribute__((target("avx2,fma")))
static void panel_avx2(const float *x, const float *panel, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int64_t p, const float *next, int64_t next_K) {
    const int64_t groups = M / MR_256, singles = M % MR_256, halves = 2;
    const int64_t blocks = (K + K_BLOCK_256 - 1) / K_BLOCK_256;
    const int64_t num_tiles = halves * groups * blocks + singles; /* the prefetch's shares */
    const int64_t n0 = p * PANEL, ncols = N - n0 < PANEL ? N - n0 : PANEL;
    const float *b = bias ? bias + n0 : 0;
    int64_t tile = 0;
    float sums[ROW_BLOCK / MR_256][2][MR_256][24], row[PANEL];
    for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK_256) {
        const int64_t steps = K - k0 < K_BLOCK_256 ? K - k0 : K_BLOCK_256;
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + g * MR_256 * K + k0;
            for (int64_t c = 0; c < halves && 24 * c < ncols; c++, tile++) {
                struct panel_prefetch pf = panel_prefetch(next, next_K, steps, tile, num_tiles);
                tile_avx2(xg, xg + K, xg + 2 * K, xg + 3 * K, panel + k0 * PANEL + 24 * c, steps, sums[g][c],
                          k0 == 0, pf);
            }
        }
    }
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = 0; c < halves && 24 * c < ncols; c++) {
            const int64_t width = ncols - 24 * c < 24 ? ncols - 24 * c : 24;
            store_rows_avx2(&sums[g][c][0][0], 24, y + g * MR_256 * N + n0 + 24 * c, N, b ? b + 24 * c : 0, MR_256,
                            width);
        }
    for (int64_t m = groups * MR_256; m < M; m++, tile++) {
        struct panel_prefetch pf = panel_prefetch(next, next_K, K, tile, num_tiles);
        row_avx2(x + m * K, panel, K, row, pf);
        store_rows_avx2(row, PANEL, y + m * N + n0, N, b, 1, ncols);
    }
}

void linear_f32_avx512(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int num_threads) {
    over_row_blocks(panel_avx512, x, packed, bias, y, M, N, K, num_threads, (struct then_weight){0, 0, 0});
}

void linear_f32_avx2(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N,
                     int64_t K, int num_threads) {
    over_row_blocks(panel_avx2, x, packed, bias, y, M, N, K, num_threads, (struct then_weight){0, 0, 0});
}

/* As linear_f32_<isa>, then prefetching as the call after it begins: then_packed [then_N, then_K]
 * (the fused layer's next linear). */
void linear_f32_avx512_then(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int num_threads, const float *then_packed, int64_t then_N, int64_t then_K) {
    over_row_blocks(panel_avx512, x, packed, bias, y, M, N, K, num_threads,
                    (struct then_weight){then_packed, then_N, then_K});
}

void linear_f32_avx2_then(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N,
                          int64_t K, int num_threads, const float *then_packed, int64_t then_N, int64_t then_K) {
    over_row_blocks(panel_avx2, x, packed, bias, y, M, N, K, num_threads,
                    (struct then_weight){then_packed, then_N, then_K});
}
