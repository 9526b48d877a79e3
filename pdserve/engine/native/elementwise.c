/* Elementwise parts of a bfloat16 step, one pass each (pdserve/engine/native/__init__.py
 * builds and loads them; model.py calls them on eager steps, the compiled
 * prefill fuses its own).
 *
 * Torch runs one op per term of the formula, each over the whole tensor and each paying
 * a dispatch of a few microseconds: an RMSNorm is eight (widen, square, mean, add, rsqrt,
 * multiply, round, weight), the half rotation seven. On a decode step of a few rows the
 * dispatches are the cost: a SmolLM2 step at batch 1 spent 2-3 of its 16-19 ms in them.
 * (SiLU times up is not here: torch's two vectorized ops beat a plain C loop of it.)
 *
 * Each function follows the torch code it replaces operation by operation, in float32,
 * rounding to bfloat16 where torch does. ``rotate_half`` gives torch's bits (its products
 * not contracted into FMAs: a*b + c*d rounds as torch's separate multiplies and add do);
 * ``rms_norm`` sums the squares in another order (its outputs within one bfloat16 rounding
 * of torch's).
 * Rows split over ``threads`` OpenMP threads when there are enough of them to pay.
 */
#include <math.h>
#include <stdint.h>
#include "bf16.h"

#define PARALLEL_MIN 65536 /* elements of work below which one thread does it */

/* out[r] = w * bf16(x[r] / sqrt(mean(x[r]^2) + eps)) for ``rows`` rows of ``n`` (row r of x
 * at r * x_stride, of out at r * n): model.RMSNorm.forward. */
int rms_norm(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t n, const uint16_t *w, float eps,
             uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * n;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) {
            const float v = bf16_to_f32(xr[i]);
            squares += v * v;
        }
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * inv)));
    }
    return 0;
}

/* out[r, h] = x[r, h] * cos[r] + rotate(x[r, h]) * sin[r], rotate(a | b) = (-b | a), for
 * ``heads`` heads of ``dim`` per row (row r of x at r * x_stride, heads side by side; out
 * contiguous); cos and sin float32 [rows, dim]: rope.rotate. */
#ifndef __clang__
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
int rotate_half(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t dim, const float *cos,
                const float *sin, uint16_t *out, int threads) {
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
    const int64_t half = dim / 2;
    if (dim % 2) return -1;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * heads * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + r * x_stride + h * dim;
            uint16_t *o = out + (r * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_to_f32(xh[i]), b = bf16_to_f32(xh[i + half]);
                const float lo = a * c[i] + -b * s[i], hi = b * c[i + half] + a * s[i + half];
                o[i] = f32_to_bf16(lo);
                o[i + half] = f32_to_bf16(hi);
            }
        }
    }
    return 0;
}
#ifndef __clang__
#pragma GCC pop_options
#endif
