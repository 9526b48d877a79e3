/* Decode attention over the paged KV cache, read in place (pdserve/engine/native/__init__.py
 * builds and loads it; attention.paged_attention calls it for a step's decode rows).
 *
 * Each decode row's query heads attend to its own context, read block by block where it
 * lies in the cache: no gather into a dense copy, which the torch path makes (and SDPA
 * then reads again). bfloat16 in and out, float32 sums. Layout (attention.py): a layer's
 * cache is [num_slots, kv_heads, D], slot = block * block_size + offset; a row's block
 * table lists its blocks in order, ``lens`` its context (its new token included).
 * Grouped-query: query head h reads kv head h / (heads / kv_heads). A token's K (then V)
 * row for every kv head is one contiguous read.
 *
 * Memory: in the engine the cache is read cold (each layer's weights, streamed between
 * two layers' attention, push it out of the CPU's caches), and a row's blocks lie
 * anywhere in it, so the hardware prefetcher cannot see the next one coming: the kernel
 * asks for the block PREFETCH_AHEAD blocks on (past a row's last block, the next row's
 * first ones) into L2, a few lines before each head's scores rather than all at once (a
 * burst filled the miss queue and stalled). With the changes below, 2.1-2.4x the kernel
 * before them at 8-32 rows over a 30-layer cache, 1.05-1.09x hot (docs/benchmarks.md,
 * ``benchmarks/decode_kernel_builds.py --layers 30``).
 *
 * Where the compiler targets AVX-512 BF16 (``-march=native`` on such a CPU): ``row_dp``.
 * Scores: a token's K row meets the query as bfloat16 pairs (vdpbf16ps: exact products,
 * float32 sums), 16 tokens' partial sums reduced together (``sum_lanes16``), the scale
 * applied to the sums. The softmax takes a chunk's 16 scores as one vector: its running
 * sum kept per lane (added across lanes once, at the end), the accumulators rescaled
 * only where a chunk raised the running max. Values (``VALUES``): a V row read as 32-bit
 * pairs of bfloat16 is two float32 vectors by two integer operations (even dimensions
 * shifted up, odd ones masked), so the accumulators keep even and odd dimensions apart
 * until the output interleaves them back; up to four heads' accumulators stay in
 * registers across a chunk's tokens, each V row converted once for them. Elsewhere
 * (``ROW``): K and V widened to float32 per token, the query pre-scaled, one block at a
 * time. The same math within float32 rounding.
 *
 * Per row: an online softmax over the chunks (running max and sum per head), as flash
 * attention does, its exponentials by a polynomial (a scalar expf per score was a quarter
 * of the time); a sliding window starts the row at len - window. Rows are independent:
 * split over ``threads`` OpenMP threads where more than one is asked for. D is 64 or 128
 * (compile-time loops); anything else returns -1 and the caller takes the torch path.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define DPBF16 1
#endif
#define MAX_HEADS 64
#define MAX_BLOCK 64
#define PREFETCH_AHEAD 2

/* Ask for ``count`` elements of K and of V from ``k`` and ``v`` into L2 (see above). */
static inline void prefetch_block(const uint16_t *k, const uint16_t *v, int64_t count) {
    for (int64_t i = 0; i < count; i += 32) {  /* 32 elements: a 64-byte line */
        __builtin_prefetch(k + i, 0, 1);
        __builtin_prefetch(v + i, 0, 1);
    }
}

#ifdef DPBF16
/* r[j] = the sum of v[j]'s 16 lanes, for j < 16: a tree of lane shuffles and adds, three
 * operations per pair where reducing each vector alone takes eight. */
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y, z, 0x88), _mm512_shuffle_f32x4(y, z, 0xdd));
}

/* exp_nonpositive on 16 lanes. */
static inline __m512 exp512_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, f), f, _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* f32_to_bf16 on 16 lanes, each result in the low half of its 32-bit lane. */
static inline __m512i bf16_bits(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), nan);
}

/* One row's attention, tokens 16 at a time. Scores: a token's K row meets the query as
 * bfloat16 pairs (vdpbf16ps: exact products, float32 sums), 16 tokens' partial sums
 * reduced together (sum_lanes16), the scale applied to the sums. Softmax on the 16
 * scores as one vector (masked to the chunk's tokens). Values: a bfloat16 V row read as
 * 32-bit pairs is two float32 vectors with two integer operations (even dimensions
 * shifted up, odd ones masked), so the accumulators hold even and odd dimensions apart
 * (``acc[h]``: 16 even, 16 odd, per 32 dimensions) until the output interleaves them
 * back; up to ``PV_TILE`` heads of one kv head accumulate in registers across the
 * chunk, each V row converted once for them. */
/* acc[h] = acc[h] * corr[h] + the sum over tokens a..b of pr[h][j] times V row j, for
 * the ``group`` heads from h_first (of one kv head: ``v`` its first V row), up to
 * ``PV_TILE`` heads' accumulators held in registers across the tokens, each V row
 * converted once for them. */
#define PV_TILE(D) ((D) == 64 ? 4 : 2)
#define VALUES(NAME, D) \
static inline __attribute__((always_inline)) void NAME( \
        const uint16_t *v, int64_t row_stride, int a, int b, int64_t h_first, int64_t group, \
        float (*pr)[16], const float *corr, float (*acc)[128]) { \
    for (int64_t h0 = h_first; h0 < h_first + group; h0 += PV_TILE(D)) { \
        const int64_t tile = h_first + group - h0 < PV_TILE(D) ? h_first + group - h0 : PV_TILE(D); \
        __m512 r[PV_TILE(D)][D / 16]; \
        for (int t = 0; t < PV_TILE(D); t++) \
            for (int c = 0; c < D / 16; c++) \
                r[t][c] = t < tile ? _mm512_mul_ps(_mm512_load_ps(&acc[h0 + t][16 * c]), _mm512_set1_ps(corr[h0 + t])) \
                                   : _mm512_setzero_ps(); \
        for (int j = a; j < b; j++) { \
            const uint16_t *vp = v + j * row_stride; \
            __m512 vf[D / 16]; \
            for (int c = 0; c < D / 32; c++) { \
                const __m512i w = _mm512_loadu_si512(vp + 32 * c); \
                vf[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); \
                vf[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u))); \
            } \
            for (int t = 0; t < PV_TILE(D); t++) { \
                const __m512 pj = _mm512_set1_ps(t < tile ? pr[h0 + t][j] : 0.0f); \
                for (int c = 0; c < D / 16; c++) r[t][c] = _mm512_fmadd_ps(pj, vf[c], r[t][c]); \
            } \
        } \
        for (int t = 0; t < tile; t++) \
            for (int c = 0; c < D / 16; c++) _mm512_store_ps(&acc[h0 + t][16 * c], r[t][c]); \
    } \
}
VALUES(values_64, 64)
VALUES(values_128, 128)

static inline __attribute__((always_inline)) void row_dp(
        const int D, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
        int64_t len, int64_t start, int64_t heads, int64_t kv_heads, int64_t block_size, float scale,
        const int64_t *next_table, int64_t next_count, uint16_t *out) {
    const int64_t group = heads / kv_heads, row_stride = kv_heads * D;
    const int NC = D / 32;  /* 512-bit vectors in one kv head's K or V row */
    __m512bh qb[MAX_HEADS][4];
    float acc[MAX_HEADS][128] __attribute__((aligned(64)));
    float pr[MAX_HEADS][16] __attribute__((aligned(64)));
    float m[MAX_HEADS], corr[MAX_HEADS];
    __m512 lv[MAX_HEADS];
    for (int64_t h = 0; h < heads; h++) {
        for (int c = 0; c < NC; c++) qb[h][c] = (__m512bh)_mm512_loadu_si512(q + h * D + 32 * c);
        for (int d = 0; d < D; d++) acc[h][d] = 0.0f;
        m[h] = -INFINITY; lv[h] = _mm512_setzero_ps();
    }
    /* The block being prefetched: its K and V, and how far (elements) the lines asked for
     * reach; a share of them before each head's scores, so that the whole block is asked
     * for within one block's worth of chunks (the rest when the next block starts). */
    const uint16_t *pf_k = NULL, *pf_v = NULL;
    const int64_t pf_n = block_size * row_stride, shares = heads * ((block_size + 15) / 16);
    const int64_t pf_step = (pf_n / 32 + shares - 1) / shares * 32;
    int64_t pf_i = 0;
    for (int64_t b0 = start - start % block_size; b0 < len; b0 += block_size) {
        const int64_t base = table[b0 / block_size] * block_size;
        if (pf_k && pf_i < pf_n) prefetch_block(pf_k + pf_i, pf_v + pf_i, pf_n - pf_i);
        const int64_t ahead = b0 / block_size + PREFETCH_AHEAD, last = (len - 1) / block_size;
        const int64_t next = ahead <= last ? table[ahead] * block_size
            : ahead - last - 1 < next_count ? next_table[ahead - last - 1] * block_size : -1;
        pf_k = next >= 0 ? k_cache + next * row_stride : NULL;
        pf_v = next >= 0 ? v_cache + next * row_stride : NULL;
        pf_i = 0;
        const int64_t jlo = b0 < start ? start - b0 : 0, jhi = len - b0 < block_size ? len - b0 : block_size;
        for (int64_t jc = jlo - jlo % 16; jc < jhi; jc += 16) {
            const int a = (int)(jlo > jc ? jlo - jc : 0), b = (int)(jhi < jc + 16 ? jhi - jc : 16);
            const __mmask16 valid = (__mmask16)(((1u << b) - 1u) & ~((1u << a) - 1u));
            const uint16_t *kb = k_cache + (base + jc) * row_stride, *vb = v_cache + (base + jc) * row_stride;
            for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
                for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
                    if (pf_k && pf_i < pf_n) {
                        prefetch_block(pf_k + pf_i, pf_v + pf_i, pf_n - pf_i < pf_step ? pf_n - pf_i : pf_step);
                        pf_i += pf_step;
                    }
                    __m512 part[16];
                    if (a == 0 && b == 16)  /* a whole chunk: no lane to test */
                        for (int j = 0; j < 16; j++) {
                            __m512 dot = _mm512_setzero_ps();
                            for (int c = 0; c < NC; c++)
                                dot = _mm512_dpbf16_ps(dot, qb[h][c],
                                                       (__m512bh)_mm512_loadu_si512(kb + j * row_stride + kvh * D + 32 * c));
                            part[j] = dot;
                        }
                    else
                        for (int j = 0; j < 16; j++) {
                            __m512 dot = _mm512_setzero_ps();
                            if (j >= a && j < b)
                                for (int c = 0; c < NC; c++)
                                    dot = _mm512_dpbf16_ps(dot, qb[h][c],
                                                           (__m512bh)_mm512_loadu_si512(kb + j * row_stride + kvh * D + 32 * c));
                            part[j] = dot;
                        }
                    const __m512 sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                                           _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(scale)));
                    /* The running max moves on few chunks past the first: rescale only then. */
                    const float cmax = _mm512_reduce_max_ps(sc);
                    corr[h] = 1.0f;
                    if (cmax > m[h]) {
                        corr[h] = exp_nonpositive(m[h] - cmax);
                        m[h] = cmax;
                    }
                    const __m512 p = _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(m[h]))));
                    lv[h] = _mm512_fmadd_ps(lv[h], _mm512_set1_ps(corr[h]), p);  /* the sum, lane by lane */
                    _mm512_store_ps(pr[h], p);
                }
                (D == 64 ? values_64 : values_128)(vb + kvh * D, row_stride, a, b, kvh * group, group, pr, corr, acc);
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const float l = _mm512_reduce_add_ps(lv[h]);
        const __m512 inv = _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
        for (int c = 0; c < NC; c++) {
            const __m512i even = bf16_bits(_mm512_mul_ps(_mm512_load_ps(&acc[h][32 * c]), inv));
            const __m512i odd = bf16_bits(_mm512_mul_ps(_mm512_load_ps(&acc[h][32 * c + 16]), inv));
            _mm512_storeu_si512(out + h * D + 32 * c, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
        }
    }
}

#define ROWS(NAME, D) \
static void NAME(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table, \
                 int64_t len, int64_t start, int64_t heads, int64_t kv_heads, int64_t block_size, float scale, \
                 const int64_t *next_table, int64_t next_count, uint16_t *out) { \
    row_dp(D, q, k_cache, v_cache, table, len, start, heads, kv_heads, block_size, scale, next_table, next_count, out); \
}
ROWS(row_64, 64)
ROWS(row_128, 128)
#else
/* The scores of one token's K row for kv head kvh, for each query head of its group
 * (float32 loops the compiler vectorizes; the query is pre-scaled). */
#define SCORES(D) { \
    float kf[D]; \
    for (int d = 0; d < D; d++) kf[d] = bf16_to_f32(kp[kvh * D + d]); \
    for (int64_t g = 0; g < group; g++) { \
        const int64_t h = kvh * group + g; float dot = 0.0f; \
        _Pragma("omp simd reduction(+ : dot)") \
        for (int d = 0; d < D; d++) dot += qf[h][d] * kf[d]; \
        s[h][j] = dot; \
    } \
}

#define QUERY(D) float qf[MAX_HEADS][D]; \
    for (int64_t h = 0; h < heads; h++) \
        for (int d = 0; d < D; d++) qf[h][d] = bf16_to_f32(q[h * D + d]) * scale;
#define BLOCK_VALUES(D) \
    for (int64_t j = j0; j < j1; j++) { \
        const uint16_t *vp = v_cache + (base + j) * row_stride; \
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) { \
            float vf[D]; \
            for (int d = 0; d < D; d++) vf[d] = bf16_to_f32(vp[kvh * D + d]); \
            for (int64_t g = 0; g < group; g++) { \
                const int64_t h = kvh * group + g; const float p = s[h][j]; \
                _Pragma("omp simd") \
                for (int d = 0; d < D; d++) acc[h][d] += p * vf[d]; \
            } \
        } \
    }
#define BLOCK_SCORES(D) \
    for (int64_t j = j0; j < j1; j++) { \
        const uint16_t *kp = k_cache + (base + j) * row_stride; \
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) \
            SCORES(D) \
    }
#define ROW(NAME, D) \
static void NAME(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table, \
                 int64_t len, int64_t start, int64_t heads, int64_t kv_heads, int64_t block_size, float scale, \
                 const int64_t *next_table, int64_t next_count, uint16_t *out) { \
    const int64_t group = heads / kv_heads; \
    float acc[MAX_HEADS][D], m[MAX_HEADS], l[MAX_HEADS]; \
    float s[MAX_HEADS][MAX_BLOCK + 16]; \
    QUERY(D) \
    for (int64_t h = 0; h < heads; h++) { \
        for (int d = 0; d < D; d++) acc[h][d] = 0.0f; \
        m[h] = -INFINITY; l[h] = 0.0f; \
    } \
    const int64_t row_stride = kv_heads * D; \
    for (int64_t b0 = start - start % block_size; b0 < len; b0 += block_size) { \
        const int64_t base = table[b0 / block_size] * block_size; \
        { const int64_t ahead = b0 / block_size + PREFETCH_AHEAD, last = (len - 1) / block_size; \
          const int64_t next = ahead <= last ? table[ahead] * block_size \
              : ahead - last - 1 < next_count ? next_table[ahead - last - 1] * block_size : -1; \
          if (next >= 0) prefetch_block(k_cache + next * row_stride, v_cache + next * row_stride, block_size * row_stride); } \
        const int64_t j0 = b0 < start ? start - b0 : 0; \
        const int64_t j1 = len - b0 < block_size ? len - b0 : block_size; \
        BLOCK_SCORES(D) \
        for (int64_t h = 0; h < heads; h++) { \
            float mx = m[h]; \
            _Pragma("omp simd reduction(max : mx)") \
            for (int64_t j = j0; j < j1; j++) mx = s[h][j] > mx ? s[h][j] : mx; \
            const float corr = expf(m[h] - mx); \
            l[h] *= corr; \
            for (int d = 0; d < D; d++) acc[h][d] *= corr; \
            m[h] = mx; float sum = 0.0f; \
            _Pragma("omp simd reduction(+ : sum)") \
            for (int64_t j = j0; j < j1; j++) { s[h][j] = exp_nonpositive(s[h][j] - mx); sum += s[h][j]; } \
            l[h] += sum; \
        } \
        BLOCK_VALUES(D) \
    } \
    for (int64_t h = 0; h < heads; h++) { \
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f; \
        for (int d = 0; d < D; d++) out[h * D + d] = f32_to_bf16(acc[h][d] * inv); \
    } \
}
ROW(row_64, 64)
ROW(row_128, 128)
#endif

int paged_decode(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                 const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t rows, int64_t heads,
                 int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window, uint16_t *out,
                 int threads) {
    if (heads % kv_heads || heads > MAX_HEADS || (dim != 64 && dim != 128) || block_size > MAX_BLOCK) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t len = lens[row];
        const int64_t start = window > 0 && len > window ? len - window : 0;
        /* The next row's first blocks, prefetched during this row's last ones. */
        const int64_t *next_table = tables;
        int64_t next_count = 0;
        if (row + 1 < rows) {
            const int64_t nlen = lens[row + 1], nstart = window > 0 && nlen > window ? nlen - window : 0;
            next_table = tables + (row + 1) * table_stride + nstart / block_size;
            next_count = (nlen - 1) / block_size - nstart / block_size + 1;
        }
        (dim == 64 ? row_64 : row_128)(q + row * q_row_stride, k_cache, v_cache, tables + row * table_stride, len,
                                       start, heads, kv_heads, block_size, scale, next_table, next_count, out + row * heads * dim);
    }
    return 0;
}
