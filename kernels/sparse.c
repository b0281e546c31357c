/* CPU backend of top-k selection (docs/design.md section 4, hvdcompress/codecs/sparse.py),
 * loaded through ctypes (hvdcompress/backends/cpu.py). The kept set is fixed by the codec,
 * not by the algorithm: with t the k-th largest |a| (exact), every |a_i| > t is kept, and
 * the |a_i| == t are kept in index order until there are k. The CUDA backend selects the
 * same set with torch.topk on the device (hvdcompress/backends/cuda.py, topk_select).
 *
 * Magnitudes are compared as the bits of |a| (a finite float's abs bits order like its
 * magnitude), so selection is integer work:
 *
 *   hvdc_topk_kth_bits   the k-th largest of m masked 32-bit words, by a radix select
 *                        of three histogram passes (11, 11, 10 bits; the caller's hist);
 *   hvdc_topk_collect    ascending indices of the |a_i| >= a bound (a candidate superset)
 *                        and their bits, or -1 when more than `cap` qualify;
 *   hvdc_topk_keep       the final ascending indices, from all of a or from candidates.
 *
 * The backend first bounds t from below with the k-th largest of a strided sample, keeps
 * the elements at or above the bound (about 2 k of them, one pass over a), and selects
 * among those; when the bound fails (too few or too many candidates) it selects over all
 * of a. Either way t is the same exact value, so the bytes do not depend on the path.
 * Pure functions over caller-owned buffers; no allocation, no global state.
 */
#include <stdint.h>
#include <string.h>

#define TOPK_BINS 2048 /* 11-bit digits */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TOPK_VECTOR __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define TOPK_VECTOR
#endif

/* The k-th largest (1 <= k <= m) of w_i = v[i * stride] & mask, i < m: a radix select on
 * digits of 11, 11 and 10 bits from the top. Each pass counts the digit of the words
 * whose higher digits match the prefix found so far and keeps the digit whose bin holds
 * the k-th largest. hist: TOPK_BINS words of scratch (small: cheap to clear for a small m). */
uint32_t hvdc_topk_kth_bits(const uint32_t *v, int64_t m, int64_t stride, uint32_t mask,
                            int64_t k, uint32_t *hist) {
    static const int shift[3] = {21, 10, 0};
    static const uint32_t width[3] = {0x7ffu, 0x7ffu, 0x3ffu};
    uint32_t prefix = 0, prefix_mask = 0;
    int64_t rank = k; /* the rank-th largest among the words matching the prefix */
    for (int p = 0; p < 3; p++) {
        memset(hist, 0, TOPK_BINS * sizeof *hist);
        for (int64_t i = 0; i < m; i++) {
            const uint32_t w = v[i * stride] & mask;
            if ((w & prefix_mask) == prefix) hist[(w >> shift[p]) & width[p]]++;
        }
        int64_t d = (int64_t)width[p], above = 0;
        for (; d > 0 && above + hist[d] < rank; d--) above += hist[d];
        rank -= above;
        prefix |= (uint32_t)d << shift[p];
        prefix_mask |= width[p] << shift[p];
    }
    return prefix;
}

/* Ascending indices i of a[0..n) with abs bits >= bound into idx and the bits into bits,
 * at most cap of them (both hold cap + 1: the branch-free loop stores one past the count
 * before it checks). Returns the count, or -1 when more than cap qualify. Blocks of 16
 * whose largest word is below the bound (most of them) are skipped after one vectorised
 * max. */
TOPK_VECTOR int64_t hvdc_topk_collect(const float *a, int64_t n, uint32_t bound, int64_t *idx,
                                      uint32_t *bits, int64_t cap) {
    const uint32_t *v = (const uint32_t *)(const void *)a;
    int64_t c = 0;
    for (int64_t lo = 0; lo < n; lo += 16) {
        const int64_t len = n - lo < 16 ? n - lo : 16;
        uint32_t top = 0;
        for (int64_t i = 0; i < len; i++) {
            const uint32_t b = v[lo + i] & 0x7fffffffu;
            top = b > top ? b : top;
        }
        if (top < bound) continue;
        for (int64_t i = lo; i < lo + len; i++) {
            const uint32_t b = v[i] & 0x7fffffffu;
            idx[c] = i;
            bits[c] = b;
            c += b >= bound;
            if (c > cap) return -1;
        }
    }
    return c;
}

/* The kept set under threshold bits t = the k-th largest w_j = v[j] & mask, j < m: the
 * ascending positions with w_j > t, then (in the same ascending pass) the first
 * k - #{w_j > t} with w_j == t; written as index[j] (or j when index is NULL) into out.
 * Returns the count written (k). */
int64_t hvdc_topk_keep(const uint32_t *v, int64_t m, uint32_t mask, const int64_t *index,
                       uint32_t t, int64_t k, int64_t *out) {
    int64_t above = 0;
    for (int64_t j = 0; j < m; j++) above += (v[j] & mask) > t;
    int64_t need = k - above, c = 0;
    for (int64_t j = 0; j < m; j++) {
        const uint32_t w = v[j] & mask;
        if (w > t || (w == t && need > 0)) {
            need -= w == t;
            out[c++] = index ? index[j] : j;
        }
    }
    return c;
}
