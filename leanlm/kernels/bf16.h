/* bfloat16 <-> float32 scalars shared by the native kernels (each .c file includes this header; the
 * kernel cache key hashes the headers next to a source too, see build.py). */
#ifndef LEANLM_BF16_H
#define LEANLM_BF16_H

#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even (what torch does for float -> bfloat16); NaN stays a quiet NaN. */
ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
