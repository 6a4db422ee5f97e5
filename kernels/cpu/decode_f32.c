/* One decoder layer of a decode-only step, whole, in float32: one call per layer instead of ~45 torch
 * ops (a batch-1 CPU step paid ~7 ms of per-op overhead on SmolLM2's 30 layers, the weights 13 ms).
 *
 *   residual += hidden (first layer: residual = hidden)     xn = rms_norm(residual) * ln1
 *   qkv = xn @ w_qkv^T + b           q, k rotated (neox pairs)      k, v stored at the token's slot
 *   attn = softmax(q k^T * scale) v  over the paged cache, read in place (no gather), online softmax
 *   residual += attn @ w_o^T + b     xn = rms_norm(residual) * ln2
 *   hidden = (silu(gate) * up) @ w_down^T + b,   [gate | up] = xn @ w_gate_up^T + b
 *
 * The same arithmetic as the torch path (kernels/rms_norm.py, rotary.py, activation.py,
 * paged_attention.py) up to float32 rounding: sums in another order, an exp of a few ulp.
 * Linears are linear_f32.c's over weights packed in panels (one OpenMP region each); attention runs one
 * (row, head) per task.
 * Cache layout: [2, Hkv, num_blocks, block_size, D] (kernels/paged_attention.py).
 *
 * Built once per ISA, with that ISA's -m flags (build.py: one library each), so that every loop here,
 * the OpenMP task bodies included, vectorises for it; the caller loads the one the CPU probe allows.
 * The body is decode_layer.h (decode_bf16.c is its bfloat16 build); this file names the types.
 */
#include <stdint.h>

#include "linear_f32.c"

#define W float
#define LOADW(v) (v)
#define STOREW(f) (f)
#define VLOADW(p) VLOADF(p)
#ifdef DECODE_F32_PREFIX /* decode_f32_kv16.c */
#define DECODE(name) DECODE_F32_PREFIX(name)
#else
#define DECODE(name) decode_f32_##name
#endif

#if defined(__AVX512F__)
#define LINEAR(x, w, b, y, M, N, K, nt) linear_f32_avx512(x, w, b, y, M, N, K, nt)
#define LINEAR_THEN(x, w, b, y, M, N, K, nt, wn, Nn, Kn) linear_f32_avx512_then(x, w, b, y, M, N, K, nt, wn, Nn, Kn)
#elif defined(__AVX2__)
#define LINEAR(x, w, b, y, M, N, K, nt) linear_f32_avx2(x, w, b, y, M, N, K, nt)
#define LINEAR_THEN(x, w, b, y, M, N, K, nt, wn, Nn, Kn) linear_f32_avx2_then(x, w, b, y, M, N, K, nt, wn, Nn, Kn)
#else
#error "build with -mavx2 -mfma or the AVX-512 flags (kernels/cpu/build.py)"
#endif

#include "decode_layer.h"
