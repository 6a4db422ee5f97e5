/* A KV cache of bfloat16 bits under a float32 layer (decode_f32_kv16.c, decode_q_kv16.c): K/V are
 * rounded to bf16 where they are stored and widened where attention reads them, half the bytes of a
 * float32 cache. Plain integer shifts: any AVX2 or AVX-512 CPU, no AVX512-BF16 needed. The rounding is
 * torch's (bf16.h), so the torch path's cache holds the same bits.
 * Include before the layer's source (decode_q.c, decode_f32.c): decode_layer.h takes WKV from here, and
 * VLOADKV expands there, after immintrin.h.
 */
#include "bf16.h"

#define WKV uint16_t
#define LOADKV(v) from_bf16(v)
#define STOREKV(f) to_bf16(f)
#if defined(__AVX512F__)
#define VLOADKV(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define VLOADKV(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
