/* The weight tile PF_TILES tiles ahead (rows n0 + PF_TILES * tile_rows ...), fetched into L2 a share
 * before each group of x rows, so that its memory read overlaps the tiles' arithmetic. Without it the
 * tiles waited on each new w tile: SmolLM2's 120 float32 linears at 32 rows took 38 ms with AVX-512,
 * 24 with it (2-core Zen 5 EPYC; distances of 1-4 tiles and L1 or L2 measured alike, 1 with outliers).
 * Used by linear_f32.c and linear_bf16.c.
 */
#ifndef TIERSERVE_PREFETCH_H
#define TIERSERVE_PREFETCH_H
#include <immintrin.h>
#include <stdint.h>

#define PF_TILES 2
struct prefetcher {
    const char *next;
    int64_t num_lines, fetched, num_groups, group;
};

/* w: rows of row_bytes each; the tile at row n0 is tile_rows rows; x comes in num_groups groups. */
static inline struct prefetcher prefetch_ahead(const void *w, int64_t n0, int64_t tile_rows, int64_t N,
                                               int64_t row_bytes, int64_t num_groups) {
    struct prefetcher pf = {0, 0, 0, num_groups, 0};
    int64_t ahead = n0 + tile_rows * PF_TILES;
    if (ahead < N) {
        int64_t rows = N - ahead < tile_rows ? N - ahead : tile_rows;
        pf.next = (const char *)w + ahead * row_bytes;
        pf.num_lines = (rows * row_bytes + 63) / 64;
    }
    return pf;
}

static inline void prefetch_share(struct prefetcher *pf) {
    pf->group++;
    for (int64_t upto = pf->num_lines * pf->group / pf->num_groups; pf->fetched < upto; pf->fetched++)
        _mm_prefetch(pf->next + pf->fetched * 64, _MM_HINT_T1);
}
#endif
