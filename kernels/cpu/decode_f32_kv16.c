/* decode_f32.c's fused layer (float32 weights and activations) over a bfloat16 KV cache (kv16.h):
 * `kv_cache_dtype = "bfloat16"` on a float32 model. Built with the avx512 or the avx2 flags. */
#include "kv16.h"
#define DECODE_F32_PREFIX(name) decode_f32_kv16_##name
#include "decode_f32.c"
