/* decode_f32.c's fused decoder layer for a bfloat16 model on a CPU with AVX512-BF16: weights, norms,
 * biases, cos/sin and the KV cache in bf16; activations and the residual stream in float32 through
 * the layer (torch's bf16 path rounds after every op; this rounds where bf16 is stored: the K/V
 * written, and each linear's input). Linears are linear_bf16.c's tiles with a float32 output.
 * Built with the avx512_bf16 flags (build.py).
 */
#include <stdint.h>

#include "linear_bf16.c"

#if !defined(__AVX512BF16__)
#error "build with the avx512_bf16 flags (kernels/cpu/build.py)"
#endif

#define W uint16_t
#define LOADW(v) from_bf16(v)
#define STOREW(f) to_bf16(f)
#define VLOADW(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define DECODE(name) decode_bf16_##name

static inline void rows_to_bf16(uint16_t *dst, const float *src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
}

#define LINEAR(x, w, b, y, M, N, K, nt) \
    (rows_to_bf16(scratch, x, (M) * (K)), linear_bf16_f32out_avx512_bf16(scratch, w, b, y, M, N, K, nt))

#include "decode_layer.h"
