/* decode_f32.c's fused decoder layer for block-quantized linears (GGUF Q8_0 / Q4_0 / Q4_1): norms,
 * biases, cos/sin, activations and the KV cache in float32, each linear qlinear.c's (x quantized to
 * int8 per block of 32, integer block sums, as llama.cpp computes). Built with the avx512_vnni or the
 * avx2 flags (build.py); a linear's weight is a QWeight: its kind and the packed arrays' addresses.
 */
#include <stdint.h>

#include "qlinear.c"

typedef struct {
    int64_t kind; /* 0 bytes (Q8_0; q8_c with c), 1 Q4 (Q4_0 and Q4_1: c holds their offset term) */
    int64_t bits; /* x's blocks: 8 or 16 (qlinear.c) */
    const uint8_t *qs;
    const float *d, *c;
} QWeight;

#define W float
#define WLIN QWeight
#define LOADW(v) (v)
#define STOREW(f) (f)
#define VLOADW(p) VLOADF(p)
#ifdef DECODE_Q_PREFIX /* decode_q_kv16.c */
#define DECODE(name) DECODE_Q_PREFIX(name)
#else
#define DECODE(name) decode_q_##name
#endif
/* scratch: at least K + 16 floats a row (decode_layer.h's work_floats): x's blocks and their scales */
#define LINEAR(x, w, b, y, M, N, K, nt) \
    QNAME(qlinear_f32)((w)->kind, (w)->bits, x, M, K, scratch, (w)->qs, (w)->d, (w)->c, b, y, N, nt)

#include "decode_layer.h"
