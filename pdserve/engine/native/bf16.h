/* bfloat16 and float32, and an exponential the compiler vectorizes: shared by the
 * native kernels (pdserve/engine/native/__init__.py builds them). */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u); return (uint16_t)(u >> 16);
}

/* e^x for x <= 0 (scores less their running max), in float32 to about 2 ulp: 2^n times a
 * polynomial on the remainder (Cody-Waite reduction by ln 2), written so the compiler
 * vectorizes the loop that calls it (expf is a scalar call per score). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
