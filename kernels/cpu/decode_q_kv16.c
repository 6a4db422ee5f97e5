/* decode_q.c's fused layer (block-quantized linears, float32 norms and activations) over a bfloat16 KV
 * cache (kv16.h): attention, bandwidth-bound at many rows, reads half the bytes. Built with the
 * avx512_vnni or the avx2 flags, as decode_q.c. */
#include "kv16.h"
#define DECODE_Q_PREFIX(name) decode_q_kv16_##name
#include "decode_q.c"
