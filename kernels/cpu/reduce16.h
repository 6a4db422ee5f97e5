/* Sixteen AVX-512 accumulators summed at once: lane j of the result is the sum of a[j]'s 16 lanes, by
 * unpacks and 128-bit shuffles (~2 instructions an output, where a horizontal sum each took ~8).
 * Per accumulator, with x_Li lane i of 128-bit lane L: s_L = (x_L0 + x_L2) + (x_L1 + x_L3), then
 * (s_0 + s_2) + (s_1 + s_3); linear_bf16.c's tree_sum is that tree for one accumulator.
 * Used by linear_f32.c, linear_bf16.c and decode_layer.h (its own target: callable from any AVX-512
 * function, whichever way its file is built).
 */
#ifndef TIERSERVE_REDUCE16_H
#define TIERSERVE_REDUCE16_H
#include <immintrin.h>

__attribute__((target("avx512f"))) static inline __m512 reduce16_avx512(const __m512 a[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]));
        u[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}
#endif
