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
 * Scores: where the compiler targets AVX-512 BF16 (``-march=native`` on such a CPU), a
 * token's K row meets the query as bfloat16 pairs (vdpbf16ps: exact products, float32
 * sums), 16 tokens' partial sums reduced together (``sum_lanes16``), the scale applied to
 * the sums; elsewhere K is widened to float32 and dotted with the pre-scaled query (``QUERY``). On
 * such a CPU the weighted sum of V keeps up to four query heads' accumulators in
 * registers across a block's tokens, each V row widened once for them. The same math
 * within float32 rounding; the two together about 1.7-2x the widened kernel at contexts
 * of a few hundred tokens (docs/benchmarks.md, ``benchmarks/decode_kernel_builds.py``).
 *
 * Per row: an online softmax over the blocks (running max and sum per head, the
 * accumulator rescaled once per block), as flash attention does, its exponentials by a
 * polynomial the compiler vectorizes (a scalar expf per score was a quarter of the time);
 * a sliding window starts the row at len - window. Rows are independent: split over ``threads`` OpenMP threads
 * where more than one is asked for. D is 64 or 128 (compile-time loops the compiler
 * vectorizes); anything else returns -1 and the caller takes the torch path.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define DPBF16 1
#endif
#define MAX_HEADS 64
#define MAX_BLOCK 64

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

/* The scores of tokens j0..j1 (at most 16) of one block for every query head: bfloat16
 * pairs multiplied exactly and summed in float32 (vdpbf16ps), each head's 16 partial sums
 * reduced together; the query is not pre-rounded, the scale applies to the sums. */
#define SCORES16(D) { \
    __m512 part[16]; \
    for (int64_t kvh = 0; kvh < kv_heads; kvh++) \
        for (int64_t g = 0; g < group; g++) { \
            const int64_t h = kvh * group + g; \
            for (int64_t j = 0; j < 16; j++) { \
                __m512 acc = _mm512_setzero_ps(); \
                if (jc + j < j1) { \
                    const uint16_t *kp = k_cache + (base + jc + j) * row_stride + kvh * D; \
                    for (int c = 0; c < D / 32; c++) \
                        acc = _mm512_dpbf16_ps(acc, qb[h][c], (__m512bh)_mm512_loadu_si512(kp + 32 * c)); \
                } \
                part[j] = acc; \
            } \
            _mm512_storeu_ps(&s[h][jc], _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(scale))); \
        } \
}
#endif

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

#ifdef DPBF16
/* The query as the scores read it: bfloat16 pairs here, float32 pre-scaled below. */
#define QUERY(D) __m512bh qb[MAX_HEADS][D / 32]; \
    for (int64_t h = 0; h < heads; h++) \
        for (int c = 0; c < D / 32; c++) qb[h][c] = (__m512bh)_mm512_loadu_si512(q + h * D + 32 * c);
#define BLOCK_SCORES(D) \
    for (int64_t jc = j0; jc < j1; jc += 16) SCORES16(D)
/* acc += p * V over tokens j0..j1 of a block: the accumulators of up to PV_TILE query
 * heads of one kv head held in registers across the block's tokens, each V row widened
 * once for all of them (stores only at the block's end). */
#define PV_TILE(D) ((D) == 64 ? 4 : 2)
#define BLOCK_VALUES(D) \
    for (int64_t kvh = 0; kvh < kv_heads; kvh++) \
        for (int64_t g0 = 0; g0 < group; g0 += PV_TILE(D)) { \
            const int64_t tile = group - g0 < PV_TILE(D) ? group - g0 : PV_TILE(D); \
            const int64_t h0 = kvh * group + g0; \
            __m512 a[PV_TILE(D)][D / 16]; \
            for (int t = 0; t < PV_TILE(D); t++) \
                for (int c = 0; c < D / 16; c++) \
                    a[t][c] = t < tile ? _mm512_loadu_ps(&acc[h0 + t][16 * c]) : _mm512_setzero_ps(); \
            for (int64_t j = j0; j < j1; j++) { \
                const uint16_t *vp = v_cache + (base + j) * row_stride + kvh * D; \
                __m512 vf[D / 16]; \
                for (int c = 0; c < D / 16; c++) \
                    vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32( \
                        _mm256_loadu_si256((const __m256i *)(vp + 16 * c))), 16)); \
                for (int t = 0; t < PV_TILE(D); t++) \
                    if (t < tile) { \
                        const __m512 p = _mm512_set1_ps(s[h0 + t][j]); \
                        for (int c = 0; c < D / 16; c++) a[t][c] = _mm512_fmadd_ps(p, vf[c], a[t][c]); \
                    } \
            } \
            for (int t = 0; t < tile; t++) \
                for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(&acc[h0 + t][16 * c], a[t][c]); \
        }
#else
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
#endif

#define ROW(NAME, D) \
static void NAME(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table, \
                 int64_t len, int64_t start, int64_t heads, int64_t kv_heads, int64_t block_size, float scale, \
                 uint16_t *out) { \
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

int paged_decode(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                 const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t rows, int64_t heads,
                 int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window, uint16_t *out,
                 int threads) {
    if (heads % kv_heads || heads > MAX_HEADS || (dim != 64 && dim != 128) || block_size > MAX_BLOCK) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t len = lens[row];
        const int64_t start = window > 0 && len > window ? len - window : 0;
        (dim == 64 ? row_64 : row_128)(q + row * q_row_stride, k_cache, v_cache, tables + row * table_stride, len,
                                       start, heads, kv_heads, block_size, scale, out + row * heads * dim);
    }
    return 0;
}
