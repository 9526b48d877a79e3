/* Linear layers over oneDNN's packed bfloat16 weights, read in place
 * (pdserve/engine/native/__init__.py builds and loads it; prepack.linear calls it for
 * every projection whose packed layout it checked).
 *
 * out[m, n] = sum_k x[m, k] w[n, k], bfloat16 in and out, float32 sums. ``w`` is the
 * buffer of ``torch.ops.mkldnn._reorder_linear_weight``: on a CPU with AVX-512 BF16 (no
 * AMX) oneDNN packs a [N, K] weight as blocks of 64 output columns, each [K/2][64][2]:
 * for a pair of k, the 64 columns' two weights side by side, which is the operand
 * vdpbf16ps takes. ``prepack.gemm_layout_matches`` checks that every weight this kernel
 * reads lies exactly so (the packed bytes against the plain weight permuted), since
 * oneDNN picks its layout per CPU and shape; a weight packed otherwise stays with oneDNN.
 *
 * Why: with a few rows (decode steps) a linear layer is a matrix-vector product bound by
 * memory; oneDNN's kernel reads the weights at 9-16 GB/s on one core of the CPU this was
 * written on, this one at 19-24 (a k-pair of a 64-column block is four 64-byte loads,
 * each row of x broadcast as one 32-bit pair into four vdpbf16ps; no horizontal sums).
 * Rows are taken four at a time (16 accumulators); a block's weights (64 x K x 2 bytes,
 * 72 KB at K = 576) stay in L2 for the next four. With hundreds of rows (prefill) both
 * are bound by the FMAs and this one is 3-12% ahead (oneDNN's call costs more). The sums
 * run over k in order, as oneDNN's do: the outputs were bit for bit oneDNN's on SmolLM2's
 * shapes at 1 and 2 rows, all but one in 12,000 at 4.
 *
 * Built without AVX-512 BF16 (another CPU), ``packed_gemm_available`` returns 0 and the
 * engine keeps oneDNN.
 */
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define GEMM_DPBF16 1
#endif

#define COLS 64       /* output columns per packed block */
#define ROW_CHUNK 64  /* rows of one task: threads share the work by (rows, block) */

int packed_gemm_available(void) {
#ifdef GEMM_DPBF16
    return 1;
#else
    return 0;
#endif
}

#ifdef GEMM_DPBF16
/* Rows [0, rows) (rows <= 4) of x against one 64-column block. */
static inline void block_rows(const uint16_t *x, int64_t x_stride, int64_t rows, const uint16_t *wb,
                              int64_t k_pairs, uint16_t *out, int64_t out_stride) {
    __m512 acc[4][4];
    for (int m = 0; m < 4; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
    if (rows == 1) {
        const int32_t *x0 = (const int32_t *)x;
        for (int64_t kp = 0; kp < k_pairs; kp++) {
            const __m512i *w = (const __m512i *)(wb + kp * 2 * COLS);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(x0[kp]);
            acc[0][0] = _mm512_dpbf16_ps(acc[0][0], xb, (__m512bh)_mm512_load_si512(w));
            acc[0][1] = _mm512_dpbf16_ps(acc[0][1], xb, (__m512bh)_mm512_load_si512(w + 1));
            acc[0][2] = _mm512_dpbf16_ps(acc[0][2], xb, (__m512bh)_mm512_load_si512(w + 2));
            acc[0][3] = _mm512_dpbf16_ps(acc[0][3], xb, (__m512bh)_mm512_load_si512(w + 3));
        }
    } else {
        for (int64_t kp = 0; kp < k_pairs; kp++) {
            const __m512i *w = (const __m512i *)(wb + kp * 2 * COLS);
            __m512bh w0 = (__m512bh)_mm512_load_si512(w), w1 = (__m512bh)_mm512_load_si512(w + 1);
            __m512bh w2 = (__m512bh)_mm512_load_si512(w + 2), w3 = (__m512bh)_mm512_load_si512(w + 3);
            for (int m = 0; m < 4 && m < rows; m++) {
                __m512bh xb = (__m512bh)_mm512_set1_epi32(((const int32_t *)(x + m * x_stride))[kp]);
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
                acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xb, w2);
                acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xb, w3);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(out + m * out_stride + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
}
#endif

/* x [rows, k] (row stride x_stride, elements), w the packed [n, k] weight (64-byte
 * aligned), out [rows, n] (row stride out_stride). 0 on success; -1 where this build or
 * these sizes cannot (the caller then takes oneDNN). */
int packed_gemm(const uint16_t *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                uint16_t *out, int64_t out_stride, int threads) {
#ifdef GEMM_DPBF16
    if (n % COLS || k % 2 || x_stride % 2 || ((uintptr_t)w & 63) || ((uintptr_t)x & 3)) return -1;
    int64_t blocks = n / COLS, chunks = (rows + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for collapse(2) num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t end = (c + 1) * ROW_CHUNK < rows ? (c + 1) * ROW_CHUNK : rows;
            for (int64_t m0 = c * ROW_CHUNK; m0 < end; m0 += 4)
                block_rows(x + m0 * x_stride, x_stride, end - m0 < 4 ? end - m0 : 4, w + b * COLS * k, k / 2,
                           out + m0 * out_stride + b * COLS, out_stride);
        }
    return 0;
#else
    (void)x; (void)x_stride; (void)rows; (void)w; (void)n; (void)k; (void)out; (void)out_stride; (void)threads;
    return -1;
#endif
}
