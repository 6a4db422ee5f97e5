/* A KV cache of bfloat16 bits under a float32 layer (decode_f32_kv16.c, decode_q_kv16.c): K/V are
 * rounded to bf16 where they are stored and widened where attention reads them, half the bytes of a
 * float32 cache. Plain integer shifts: any AVX2 or AVX-512 CPU, no AVX512-BF16 needed. The rounding is
 * torch's (round to nearest even, NaN kept quiet), so the torch path's cache holds the same bits.
 * Include after the linear kernel's source (VLOADF, VL's vector width, come from decode_layer.h).
 */
#include <stdint.h>
#include <string.h>

static inline float kv16_load(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t kv16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu);
    return nan ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#define WKV uint16_t
#define LOADKV(v) kv16_load(v)
#define STOREKV(f) kv16_store(f)
#if defined(__AVX512F__)
#define VLOADKV(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define VLOADKV(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
