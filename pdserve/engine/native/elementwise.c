/* The elementwise parts of a bfloat16 step, one pass each (pdserve/engine/native/__init__.py
 * builds and loads them; model.py and rope.py call them on eager steps, the compiled
 * prefill fuses its own).
 *
 * Torch runs one op per term of the formula, each over the whole tensor and each paying
 * a dispatch of a few microseconds: an RMSNorm is eight (widen, square, mean, add, rsqrt,
 * multiply, round, weight), the half rotation seven. On a decode step of a few rows the
 * dispatches are the cost: a SmolLM2 step at batch 1 spent 2-3 of its 16-19 ms in them.
 *
 * Each function follows the torch code it replaces operation by operation, in float32,
 * rounding to bfloat16 where torch does; products are not contracted into FMAs (a*b + c*d
 * rounds as torch's separate multiplies and add do). ``rotate_half`` gives torch's bits;
 * ``rms_norm`` sums the squares in another order (its outputs within one bfloat16 rounding
 * of torch's); ``silu_mul``'s exponential is exp_nonpositive (about 2 ulp in float32).
 * Rows split over ``threads`` OpenMP threads when there are enough of them to pay.
 */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#else
#pragma GCC optimize("fp-contract=off")
#endif
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
int rotate_half(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t dim, const float *cos,
                const float *sin, uint16_t *out, int threads) {
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

/* out[r] = bf16(silu(gate[r])) * up[r] for rows [gate | up] of 2 * inter at ``stride``
 * (out contiguous): silu(x) = x / (1 + e^-x), as x * e^x / (1 + e^x) below zero so the
 * exponential's argument is never positive. model.MLP's F.silu(gate) * up. */
int silu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t inter, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * stride, *u = g + inter;
        uint16_t *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = bf16_to_f32(g[i]);
            const float t = exp_nonpositive(x < 0.0f ? x : -x);
            const float silu = x < 0.0f ? x * t / (1.0f + t) : x / (1.0f + t);
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu)) * bf16_to_f32(u[i]));
        }
    }
    return 0;
}
