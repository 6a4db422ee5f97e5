/* bfloat16 bits <-> float, scalar: widening is a shift; narrowing rounds to nearest even (NaN kept
 * quiet), as torch does, so a value stored here and one stored by torch are the same bits. */
#ifndef TIERSERVE_BF16_H
#define TIERSERVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu);
    return nan ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
#endif
