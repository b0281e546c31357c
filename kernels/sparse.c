/* CPU backend of top-k selection and random-k (docs/baselines.md,
 * hvdcompress/codecs/sparse.py), loaded through ctypes (hvdcompress/backends/cpu/).
 * Top-k's kept set is fixed by the codec, not by the algorithm: with t the k-th largest
 * |a| (exact), every |a_i| > t is kept, and the |a_i| == t are kept in index order until
 * there are k. The CUDA backend selects the same set: a bucket's top-k, top-k + sign and
 * DGC tensors by the same radix select in kernels/sparse.cu (with its bucket decode), a
 * single tensor with torch.topk (hvdcompress/backends/cuda/, topk_select).
 *
 * Magnitudes are compared as the bits of |a| (a finite float's abs bits order like its
 * magnitude), so selection is integer work:
 *
 *   hvdc_topk_kth_bits   the k-th largest of m masked 32-bit words, by a radix select
 *                        of three histogram passes (11, 11, 10 bits; the caller's hist);
 *   hvdc_topk_collect    ascending indices of the |a_i| >= a bound (a candidate superset)
 *                        and their bits, or -1 when more than `cap` qualify;
 *   hvdc_topk_keep       the final ascending indices, from all of a or from candidates;
 *   hvdc_topk_encode_segments  a bucket's top-k with error feedback, one call;
 *   hvdc_topk_decode_segments  a bucket's top-k bodies checked and added, one call;
 *   hvdc_randomk_encode / _decode  random-k: kept values from one pass of hashed
 *                        counters (no mask, no uniforms in float), and their scatter
 *                        (a bucket: _encode_segments, _ef_encode_segments with error
 *                        feedback, _decode_segments);
 *   hvdc_gspar_round / _draw  GSpar: one round of the scale iteration (saturated count
 *                        and ordered chunk sums), and the draw of the kept entries.
 *
 * The backend first bounds t from below with the k-th largest of a strided sample (tensors
 * of 16384 elements or more: every max(16, n / 65536)-th element), keeps
 * the elements at or above the bound (about 2 k of them, one pass over a), and selects
 * among those; when the bound fails (too few or too many candidates) it selects over all
 * of a. Either way t is the same exact value, so the bytes do not depend on the path.
 * Pure functions over caller-owned buffers; no allocation, no global state.
 */
#include <float.h>
#include <math.h>
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

/* Errors of hvdc_topk_decode_segments, in the order hvdcompress/codecs/sparse.py checks. */
#define TOPK_ERR_RANGE -1     /* the first index is negative or the last is >= n */
#define TOPK_ERR_ORDER -2     /* indices are not strictly increasing */
#define TOPK_ERR_NONFINITE -3 /* a kept value is NaN or Inf */

static inline int64_t topk_index(const uint8_t *at, int wide, int64_t i) {
    if (wide) {
        int64_t v;
        memcpy(&v, at + 8 * i, 8);
        return v;
    }
    int32_t v;
    memcpy(&v, at + 4 * i, 4);
    return v;
}

/* One top-k body (k float32 values, then k indices: int32, or int64 when wide), checked
 * as a whole before out is touched; then out[index] += value. Returns 0 or TOPK_ERR_*. */
static int64_t topk_decode_add(const uint8_t *body, int64_t k, int64_t n, int wide, float *out) {
    if (k == 0) return 0;
    const uint8_t *idx = body + 4 * k;
    if (topk_index(idx, wide, 0) < 0 || topk_index(idx, wide, k - 1) >= n) return TOPK_ERR_RANGE;
    for (int64_t i = 1; i < k; i++)
        if (topk_index(idx, wide, i) <= topk_index(idx, wide, i - 1)) return TOPK_ERR_ORDER;
    for (int64_t i = 0; i < k; i++) {
        uint32_t bits;
        memcpy(&bits, body + 4 * i, 4);
        if ((bits & 0x7fffffffu) >= 0x7f800000u) return TOPK_ERR_NONFINITE;
    }
    for (int64_t i = 0; i < k; i++) {
        float v;
        memcpy(&v, body + 4 * i, 4);
        out[topk_index(idx, wide, i)] += v;
    }
    return 0;
}

/* The top-k decode (accumulating) of `count` bodies in one call: body p at body +
 * starts[p] (the caller checked its length: ks[p] values and indices) of a tensor of
 * ns[p] elements, indices int64 when wide[p], added into the floats at address outs[p].
 * Returns -1 - p for the first body p that does not decode (bodies before it added, its
 * output untouched) with its TOPK_ERR_* in *code, else 0. */
int64_t hvdc_topk_decode_segments(int64_t count, const uint8_t *body, const int64_t *starts,
                                  const int64_t *ks, const int64_t *ns, const int32_t *wide,
                                  const uint64_t *outs, int64_t *code) {
    for (int64_t p = 0; p < count; p++) {
        int64_t rc = topk_decode_add(body + starts[p], ks[p], ns[p], wide[p],
                                     (float *)(uintptr_t)outs[p]);
        if (rc < 0) {
            *code = rc;
            return -1 - p;
        }
    }
    return 0;
}

/* --- a bucket's top-k encode (TopK.encode of each tensor, one call) --------------------- */

#define TOPK_SAMPLE 65536     /* elements of the strided sample (backends/cpu/ TOPK_SAMPLE) */
#define TOPK_MIN_SAMPLED 16384 /* tensors from this size on are sampled (TOPK_MIN_SAMPLED) */
#define TOPK_MIN_STRIDE 16     /* every 16th element at least (TOPK_MIN_STRIDE) */
#define TOPK_ABS 0x7fffffffu
#define TOPK_ALL 0xffffffffu

uint32_t hvdc_threelc_absmax_bits(const float *g, const float *e, int64_t n); /* threelc.c */

/* backends/cpu/ topk_select, step for step (0 < k < n, a finite): the ascending indices
 * of the k largest |a| into out. cand_idx / cand_bits hold 4 k + 4097 entries. */
static void topk_select_into(const float *a, int64_t n, int64_t k, uint32_t *hist,
                             int64_t *cand_idx, uint32_t *cand_bits, int64_t *out) {
    const uint32_t *v = (const uint32_t *)(const void *)a;
    if (n >= TOPK_MIN_SAMPLED && 8 * k <= n) {
        const int64_t stride =
            n / TOPK_SAMPLE > TOPK_MIN_STRIDE ? n / TOPK_SAMPLE : TOPK_MIN_STRIDE;
        const int64_t m = (n - 1) / stride + 1;
        int64_t j = (int64_t)ceil((double)m * 2.0 * (double)k / (double)n) + 64;
        j = j < m ? j : m;
        const uint32_t bound = hvdc_topk_kth_bits(v, m, stride, TOPK_ABS, j, hist);
        const int64_t count = hvdc_topk_collect(a, n, bound, cand_idx, cand_bits, 4 * k + 4096);
        if (count >= k) {
            const uint32_t t = hvdc_topk_kth_bits(cand_bits, count, 1, TOPK_ALL, k, hist);
            hvdc_topk_keep(cand_bits, count, TOPK_ALL, cand_idx, t, k, out);
            return;
        }
    }
    const uint32_t t = hvdc_topk_kth_bits(v, n, 1, TOPK_ABS, k, hist);
    hvdc_topk_keep(v, n, TOPK_ABS, NULL, t, k, out);
}

int hvdc_dgc_update(const float *g, float *u, float *v, int64_t n, float momentum,
                    int zero_momentum); /* below */

/* Top-k with error feedback of `count` tensors in one call. Tensor p: ns[p] floats g at
 * address gs[p], its residual e at es[p], ks[p] values kept (0 <= k <= n). When some
 * g + e is not finite: nonfinite[p] = 1, e untouched, nothing written. Else a = g + e
 * (float32, into e), the kept set (the k largest |a|, ties by lowest index; all of a when
 * k == n), and the body at out + out_starts[p]: the k values a[i], then the k indices
 * (int32, or int64 when wide[p]), ascending; then a[i] = 0 for each kept i (e = a minus
 * what was sent). DGC (us not NULL: tensor p's velocity u at us[p]): a is instead the
 * momentum-corrected v = e of hvdc_dgc_update (u <- m u + g, v <- v + u; non-finite:
 * both untouched), and u[i] = 0 too for each kept i (momentum factor masking). Scratch:
 * hist (TOPK_BINS words), sel (max k int64), cand_idx and cand_bits (4 max k + 4097
 * entries each). */
void hvdc_topk_encode_segments(int64_t count, const uint64_t *gs, const uint64_t *es,
                               const uint64_t *us, float momentum, const int64_t *ns,
                               const int64_t *ks, const int32_t *wide, uint8_t *out,
                               const int64_t *out_starts, int32_t *nonfinite, uint32_t *hist,
                               int64_t *sel, int64_t *cand_idx, uint32_t *cand_bits) {
    for (int64_t p = 0; p < count; p++) {
        const float *g = (const float *)(uintptr_t)gs[p];
        float *e = (float *)(uintptr_t)es[p];
        float *u = us ? (float *)(uintptr_t)us[p] : NULL;
        const int64_t n = ns[p], k = ks[p];
        if (u) {
            nonfinite[p] = hvdc_dgc_update(g, u, e, n, momentum, momentum == 0.0f);
            if (nonfinite[p]) continue;
        } else {
            nonfinite[p] = hvdc_threelc_absmax_bits(g, e, n) >= 0x7f800000u;
            if (nonfinite[p]) continue;
            for (int64_t i = 0; i < n; i++) e[i] = e[i] + g[i];
        }
        if (k == 0) continue;
        if (k == n)
            for (int64_t i = 0; i < n; i++) sel[i] = i;
        else
            topk_select_into(e, n, k, hist, cand_idx, cand_bits, sel);
        uint8_t *body = out + out_starts[p], *idx = body + 4 * k;
        for (int64_t i = 0; i < k; i++) {
            memcpy(body + 4 * i, e + sel[i], 4);
            if (wide[p]) {
                memcpy(idx + 8 * i, &sel[i], 8);
            } else {
                const int32_t i32 = (int32_t)sel[i];
                memcpy(idx + 4 * i, &i32, 4);
            }
        }
        for (int64_t i = 0; i < k; i++) e[sel[i]] = 0.0f;
        if (u)
            for (int64_t i = 0; i < k; i++) u[sel[i]] = 0.0f;
    }
}

/* --- a bucket's top-k + sign (TopKSign, codecs/sparse.py topk_sign_*), one call a pass --- */

void hvdc_prim_chunk_sums(const float *x, int64_t n, int64_t chunk, int square,
                          double *out); /* primitives.c */

#define TOPKQ_CHUNK 1024          /* primitives.abs_sum's chunk */
#define TOPKQ_ERR_MAGNITUDE -4    /* the shared magnitude is not finite and >= 0 */
#define TOPKQ_ERR_PADDING -5      /* a sign bit after the last kept value is set */

/* First pass of top-k + sign with error feedback for `count` tensors (TopKSign.encode up
 * to the magnitude). Tensor p: ns[p] floats g at gs[p], residual e at es[p], ks[p] kept
 * (0 <= k <= n). nonfinite[p] = 1 when some g + e is not finite (e untouched); else
 * a = g + e into e, the kept set into sel + starts[p] (ascending), the kept values
 * a[i] into kept + starts[p], and their order-fixed chunk sums of |a[i]| (TOPKQ_CHUNK
 * values a chunk, left to right, in double) into sums + sum_starts[p]. Scratch as for
 * hvdc_topk_encode_segments. */
void hvdc_topkq_select_segments(int64_t count, const uint64_t *gs, const uint64_t *es,
                                const int64_t *ns, const int64_t *ks, int32_t *nonfinite,
                                int64_t *sel, float *kept, const int64_t *starts, double *sums,
                                const int64_t *sum_starts, uint32_t *hist, int64_t *cand_idx,
                                uint32_t *cand_bits) {
    for (int64_t p = 0; p < count; p++) {
        const float *g = (const float *)(uintptr_t)gs[p];
        float *e = (float *)(uintptr_t)es[p];
        const int64_t n = ns[p], k = ks[p];
        int64_t *s = sel + starts[p];
        float *v = kept + starts[p];
        nonfinite[p] = hvdc_threelc_absmax_bits(g, e, n) >= 0x7f800000u;
        if (nonfinite[p]) continue;
        for (int64_t i = 0; i < n; i++) e[i] = e[i] + g[i];
        if (k == 0) continue;
        if (k == n)
            for (int64_t i = 0; i < n; i++) s[i] = i;
        else
            topk_select_into(e, n, k, hist, cand_idx, cand_bits, s);
        for (int64_t i = 0; i < k; i++) v[i] = e[s[i]];
        hvdc_prim_chunk_sums(v, k, TOPKQ_CHUNK, 0, sums + sum_starts[p]);
    }
}

/* Second pass: for each tensor p not skipped, with the magnitude ms[p] (float32 of the
 * correctly rounded mean of |kept|, from the caller), its body at out + out_starts[p]:
 * m, the k indices (int32, or int64 when wide[p]), the sign bits of the kept values (bit
 * 1 for a value < 0, LSB first); then e[i] -= (a[i] < 0 ? -m : m) for each kept i. */
void hvdc_topkq_write_segments(int64_t count, const uint64_t *es, const int64_t *ks,
                               const int32_t *skip, const float *ms, const int64_t *sel,
                               const float *kept, const int64_t *starts, const int32_t *wide,
                               uint8_t *out, const int64_t *out_starts) {
    for (int64_t p = 0; p < count; p++) {
        if (skip[p]) continue;
        float *e = (float *)(uintptr_t)es[p];
        const int64_t k = ks[p], *s = sel + starts[p];
        const float *v = kept + starts[p], m = ms[p];
        uint8_t *body = out + out_starts[p];
        memcpy(body, &m, 4);
        uint8_t *idx = body + 4, *signs = idx + (wide[p] ? 8 : 4) * k;
        for (int64_t i = 0; i < k; i++) {
            if (wide[p]) {
                memcpy(idx + 8 * i, &s[i], 8);
            } else {
                const int32_t i32 = (int32_t)s[i];
                memcpy(idx + 4 * i, &i32, 4);
            }
        }
        memset(signs, 0, (size_t)((k + 7) / 8));
        for (int64_t i = 0; i < k; i++) {
            const int minus = v[i] < 0.0f;
            signs[i >> 3] |= (uint8_t)(minus << (i & 7));
            e[s[i]] = e[s[i]] - (minus ? -m : m);
        }
    }
}

/* The top-k + sign decode (accumulating) of `count` bodies in one call: body p at body +
 * starts[p] (the caller checked its length: 4 + k index bytes + ceil(k / 8)) of ks[p]
 * kept values of ns[p], indices int64 when wide[p], added into the floats at outs[p].
 * Checks in codecs/sparse.py's order: the magnitude, the indices, the sign padding.
 * Returns -1 - p for the first body p that does not decode (the ones before it added,
 * its output untouched) with TOPK_ERR_* / TOPKQ_ERR_* in *code, else 0. */
int64_t hvdc_topkq_decode_segments(int64_t count, const uint8_t *body, const int64_t *starts,
                                   const int64_t *ks, const int64_t *ns, const int32_t *wide,
                                   const uint64_t *outs, int64_t *code) {
    for (int64_t p = 0; p < count; p++) {
        const uint8_t *b = body + starts[p], *idx = b + 4;
        const int64_t k = ks[p], n = ns[p];
        const uint8_t *signs = idx + (wide[p] ? 8 : 4) * k;
        uint32_t mbits;
        memcpy(&mbits, b, 4);
        int64_t rc = 0;
        if (mbits >= 0x7f800000u) /* NaN, Inf, or a sign bit set: -0.0 and negatives */
            rc = (mbits == 0x80000000u) ? 0 : TOPKQ_ERR_MAGNITUDE;
        if (rc == 0 && k > 0) {
            if (topk_index(idx, wide[p], 0) < 0 || topk_index(idx, wide[p], k - 1) >= n)
                rc = TOPK_ERR_RANGE;
            for (int64_t i = 1; rc == 0 && i < k; i++)
                if (topk_index(idx, wide[p], i) <= topk_index(idx, wide[p], i - 1))
                    rc = TOPK_ERR_ORDER;
            if (rc == 0 && (k & 7) && (signs[k >> 3] >> (k & 7)))
                rc = TOPKQ_ERR_PADDING;
        }
        if (rc < 0) {
            *code = rc;
            return -1 - p;
        }
        float m, *o = (float *)(uintptr_t)outs[p];
        memcpy(&m, b, 4);
        for (int64_t i = 0; i < k; i++) {
            const int minus = (signs[i >> 3] >> (i & 7)) & 1;
            o[topk_index(idx, wide[p], i)] += minus ? -m : m;
        }
    }
    return 0;
}

/* --- random-k (hvdcompress/codecs/sparse.py): element i is kept iff u_i < T 2^-24, that is
 * iff its 24-bit hash r_i < T (hvdc_prim_hash24, the integers of the uniforms). One pass of
 * hashes a chunk at a time, in L1; the kept values travel in index order. ----------------- */

void hvdc_prim_hash24(uint64_t key, int64_t offset, int64_t n, uint32_t *r); /* primitives.c */

#define RANDOMK_CHUNK 512
#define RANDOMK_ERR_VALUE -1 /* a kept value is not finite */

/* The kept values of a[0..n) in index order at values[0..min(k, cap)) with k, the kept
 * count, returned (k > cap: the caller's estimate was short; it calls again with room),
 * and, when residual is not NULL, residual[i] = kept ? 0 : a[i] (error feedback: a -
 * decode with the values unscaled; the same on a second call). values needs room for
 * cap + 1 floats: every element is written at the next slot (slot cap once full), which
 * advances only when the element is kept (no branch). */
int64_t hvdc_randomk_encode(const float *a, int64_t n, uint64_t key, uint32_t threshold,
                            float *values, float *residual, int64_t cap) {
    uint32_t r[RANDOMK_CHUNK];
    int64_t k = 0;
    for (int64_t lo = 0; lo < n; lo += RANDOMK_CHUNK) {
        const int64_t len = n - lo < RANDOMK_CHUNK ? n - lo : RANDOMK_CHUNK;
        hvdc_prim_hash24(key, lo, len, r);
        const float *x = a + lo;
        for (int64_t i = 0; i < len; i++) {
            values[k < cap ? k : cap] = x[i];
            k += r[i] < threshold;
        }
        if (residual)
            for (int64_t i = 0; i < len; i++) residual[lo + i] = r[i] < threshold ? 0.0f : x[i];
    }
    return k;
}

/* Random-k's decode of `count` little-endian float32 values at body (any byte offset;
 * count = -1: the body is not whole values) into out[0..n): regenerates the kept indices
 * (at most count of them into idx, the caller's scratch) and counts them all. Returns the
 * kept count, with out untouched, when it is not count (the caller reports the mismatch);
 * RANDOMK_ERR_VALUE, out untouched, when a value is not finite; else writes out = 0 and
 * out[idx[j]] = value_j * scale, or adds value_j * scale (one product, one sum), and
 * returns count. */
int64_t hvdc_randomk_decode(const uint8_t *body, int64_t count, int64_t n, uint64_t key,
                            uint32_t threshold, float scale, float *out, int accumulate,
                            int64_t *idx) {
    uint32_t r[RANDOMK_CHUNK];
    int64_t k = 0;
    for (int64_t lo = 0; lo < n; lo += RANDOMK_CHUNK) {
        const int64_t len = n - lo < RANDOMK_CHUNK ? n - lo : RANDOMK_CHUNK;
        hvdc_prim_hash24(key, lo, len, r);
        for (int64_t i = 0; i < len; i++) {
            if (r[i] < threshold) { /* rare at small ratios: predicted */
                if (k < count) idx[k] = lo + i;
                k++;
            }
        }
    }
    if (k != count) return k;
    for (int64_t j = 0; j < count; j++) {
        uint32_t bits;
        memcpy(&bits, body + 4 * j, sizeof bits);
        if ((bits & 0x7fffffffu) >= 0x7f800000u) return RANDOMK_ERR_VALUE;
    }
    if (!accumulate) memset(out, 0, (size_t)n * sizeof(float));
    for (int64_t j = 0; j < count; j++) {
        float v;
        memcpy(&v, body + 4 * j, sizeof v);
        v = v * scale;
        out[idx[j]] = accumulate ? out[idx[j]] + v : v;
    }
    return count;
}

/* --- GSpar (hvdcompress/codecs/sparse.py): p_i = min(1, c |a_i|) with sum p_i = T ---------- */

#define GSPAR_LANES 4 /* chunks summed side by side (independent chains of additions) */

/* One round of GSpar's scale iteration at the float32 scale c: returns how many |a_i| c
 * >= 1 (one float32 product, the saturated entries), and sums[ch] = the sum in double,
 * left to right, of the other |a_i| of chunk ch (chunk elements; the last may be short).
 * A saturated entry adds nothing (the codec's sum adds +0.0 for it: the same double).
 * GSPAR_LANES chunks at a time, their chains of additions side by side. c = 0 saturates
 * nothing (the first round's plain sums). */
int64_t hvdc_gspar_round(const float *a, int64_t n, float c, int64_t chunk, double *sums) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    int64_t count = 0;
    int64_t ch = 0;
    for (; ch + GSPAR_LANES <= chunks && (ch + GSPAR_LANES) * chunk <= n; ch += GSPAR_LANES) {
        double s[GSPAR_LANES] = {0.0};
        const float *x = a + ch * chunk;
        for (int64_t i = 0; i < chunk; i++) {
            for (int l = 0; l < GSPAR_LANES; l++) {
                const float m = fabsf(x[l * chunk + i]);
                const int sat = m * c >= 1.0f;
                count += sat;
                s[l] += sat ? 0.0 : (double)m;
            }
        }
        for (int l = 0; l < GSPAR_LANES; l++) sums[ch + l] = s[l];
    }
    for (; ch < chunks; ch++) {
        const int64_t lo = ch * chunk, hi = lo + chunk < n ? lo + chunk : n;
        double s = 0.0;
        for (int64_t i = lo; i < hi; i++) {
            const float m = fabsf(a[i]);
            const int sat = m * c >= 1.0f;
            count += sat;
            s += sat ? 0.0 : (double)m;
        }
        sums[ch] = s;
    }
    return count;
}

/* GSpar's draw at the float32 scale c (all_nonzero: c is infinite, every non-zero entry
 * kept): p_i = min(|a_i| c, 1) (p_i = [a_i != 0] when all_nonzero), entry i kept iff
 * u_i < p_i (u_i the counter-based uniform of key); the kept entries' values (a_i / p_i,
 * or a_i when not scaled) at values[0..min(k, cap)) and indices at idx[..], ascending;
 * returns k, the kept count (k > cap: the caller calls again with room for k). p and the
 * draw run as a vector loop over a chunk, then the kept entries (a few at small budgets)
 * are gathered. */
int64_t hvdc_gspar_draw(const float *a, int64_t n, float c, int all_nonzero, uint64_t key,
                        int scaled, float *values, int64_t *idx, int64_t cap) {
    uint32_t r[RANDOMK_CHUNK];
    float p[RANDOMK_CHUNK];
    uint8_t keep[RANDOMK_CHUNK];
    int64_t k = 0;
    for (int64_t lo = 0; lo < n; lo += RANDOMK_CHUNK) {
        const int64_t len = n - lo < RANDOMK_CHUNK ? n - lo : RANDOMK_CHUNK;
        hvdc_prim_hash24(key, lo, len, r);
        const float *x = a + lo;
        for (int64_t i = 0; i < len; i++) { /* vectorised: p and the draw */
            const float m = fabsf(x[i]);
            float q = all_nonzero ? (float)(m > 0.0f) : m * c;
            q = q > 1.0f ? 1.0f : q;
            p[i] = q;
            keep[i] = (float)(int32_t)r[i] * 0x1p-24f < q;
        }
        for (int64_t i = 0; i < len; i++) { /* the kept few: a division each when scaled */
            if (keep[i]) {
                if (k < cap) {
                    values[k] = scaled ? x[i] / p[i] : x[i];
                    idx[k] = lo + i;
                }
                k++;
            }
        }
    }
    return k;
}

/* --- DGC (hvdcompress/compressors/dgc.py): momentum correction in place ------------------ */

/* u' = m u + g (u' = g when zero_momentum: g itself, not 0 u + g, which would turn -0.0
 * into +0.0) and v' = v + u', each one float32 operation. Returns 1, u and v untouched,
 * when some v' is a NaN or an Inf (a checking pass reads everything first); else writes
 * u <- u', v <- v' and returns 0. Two passes instead of the temporaries of the torch form. */
TOPK_VECTOR int hvdc_dgc_update(const float *g, float *u, float *v, int64_t n, float momentum,
                                int zero_momentum) {
    uint32_t worst = 0;
    for (int64_t i = 0; i < n; i++) {
        const float un = zero_momentum ? g[i] : u[i] * momentum + g[i];
        const float vn = v[i] + un;
        uint32_t bits;
        memcpy(&bits, &vn, sizeof bits);
        bits &= 0x7fffffffu;
        worst = bits > worst ? bits : worst;
    }
    if (worst >= 0x7f800000u) return 1;
    for (int64_t i = 0; i < n; i++) {
        const float un = zero_momentum ? g[i] : u[i] * momentum + g[i];
        u[i] = un;
        v[i] = v[i] + un;
    }
    return 0;
}

/* --- a bucket's random-k (RandomK.encode_bucket / decode_segments), one call each ------- */

/* hvdc_randomk_encode (no error feedback) of `count` tensors: tensor p has ns[p] floats at
 * address as[p] and the stream keys[p]; nonfinite[p] = 1 when it holds a NaN or an Inf
 * (nothing written); else its kept values go to out + out_starts[p] (room for caps[p] + 1
 * floats, 4-byte aligned) and ks[p] is the kept count (> caps[p]: the caller encodes that
 * tensor again with room). */
void hvdc_randomk_encode_segments(int64_t count, const uint64_t *as, const int64_t *ns,
                                  const uint64_t *keys, uint32_t threshold, uint8_t *out,
                                  const int64_t *out_starts, const int64_t *caps, int64_t *ks,
                                  int32_t *nonfinite) {
    for (int64_t p = 0; p < count; p++) {
        const float *a = (const float *)(uintptr_t)as[p];
        nonfinite[p] = hvdc_threelc_absmax_bits(a, NULL, ns[p]) >= 0x7f800000u;
        ks[p] = nonfinite[p] ? 0
                             : hvdc_randomk_encode(a, ns[p], keys[p], threshold,
                                                   (float *)(void *)(out + out_starts[p]), NULL,
                                                   caps[p]);
    }
}

/* hvdc_randomk_encode with error feedback of `count` tensors: tensor p has ns[p] floats g at
 * address gs[p], its residual e at es[p] and the stream keys[p]. nonfinite[p] = 1 when some
 * g + e is a NaN or an Inf (e untouched, nothing written). Else e <- a = g + e (float32),
 * the kept values of a go to out + out_starts[p] (room for caps[p] + 1 floats, 4-byte
 * aligned) with their indices in idx (room for the largest cap + 1), ks[p] is the kept
 * count, and the kept entries of e are zeroed (e = a - decode, the values unscaled); when
 * ks[p] > caps[p] the room was short: e holds a, and the caller encodes it again with room
 * (residual a itself). The kept set and values are hvdc_randomk_encode's. */
void hvdc_randomk_ef_encode_segments(int64_t count, const uint64_t *gs, const uint64_t *es,
                                     const int64_t *ns, const uint64_t *keys, uint32_t threshold,
                                     uint8_t *out, const int64_t *out_starts, const int64_t *caps,
                                     int64_t *ks, int32_t *nonfinite, int64_t *idx) {
    uint32_t r[RANDOMK_CHUNK];
    for (int64_t p = 0; p < count; p++) {
        const float *g = (const float *)(uintptr_t)gs[p];
        float *e = (float *)(uintptr_t)es[p];
        const int64_t n = ns[p], cap = caps[p];
        nonfinite[p] = hvdc_threelc_absmax_bits(g, e, n) >= 0x7f800000u;
        ks[p] = 0;
        if (nonfinite[p]) continue;
        float *values = (float *)(void *)(out + out_starts[p]);
        int64_t k = 0;
        for (int64_t lo = 0; lo < n; lo += RANDOMK_CHUNK) {
            const int64_t len = n - lo < RANDOMK_CHUNK ? n - lo : RANDOMK_CHUNK;
            hvdc_prim_hash24(keys[p], lo, len, r);
            float *a = e + lo;
            for (int64_t i = 0; i < len; i++) a[i] = a[i] + g[lo + i];
            for (int64_t i = 0; i < len; i++) { /* every element at the next slot (no branch) */
                const int64_t slot = k < cap ? k : cap;
                values[slot] = a[i];
                idx[slot] = lo + i;
                k += r[i] < threshold;
            }
        }
        ks[p] = k;
        if (k <= cap)
            for (int64_t j = 0; j < k; j++) e[idx[j]] = 0.0f;
    }
}

/* hvdc_randomk_decode (accumulating) of `count` bodies: body p is lens[p] bytes at
 * body + starts[p], ns[p] values, stream keys[p], added times scale into the floats at
 * outs[p]. Returns 0; or -1 - p for the first body p that does not decode (the ones before
 * it added, its output untouched) with *code = RANDOMK_ERR_VALUE or the regenerated kept
 * count (>= 0) when the body does not hold that many values. idx: scratch for the most
 * min(lens[p] / 4, ns[p]) indices. */
int64_t hvdc_randomk_decode_segments(int64_t count, const uint8_t *body, const int64_t *starts,
                                     const int64_t *lens, const int64_t *ns,
                                     const uint64_t *keys, uint32_t threshold, float scale,
                                     const uint64_t *outs, int64_t *idx, int64_t *code) {
    for (int64_t p = 0; p < count; p++) {
        const int64_t values = lens[p] % 4 == 0 ? lens[p] / 4 : -1;
        const int64_t got = hvdc_randomk_decode(body + starts[p], values, ns[p], keys[p],
                                                threshold, scale,
                                                (float *)(uintptr_t)outs[p], 1, idx);
        if (got != values) { /* a count mismatch (got >= 0) or RANDOMK_ERR_VALUE */
            *code = got;
            return -1 - p;
        }
    }
    return 0;
}

/* --- a bucket's GSpar encode (GSpar.encode_bucket), one call --------------------------- */

#define GSPAR_PARTIALS 64 /* non-negative doubles: at most ~40 partials (2098 / 53) */

/* The correctly rounded sum of x[0..m) (m >= 0, every x finite and >= 0): Python's
 * math.fsum (Shewchuk's exact partials, then the round-half-even correction of CPython's
 * mathmodule.c), which the codec's abs_sum is. Returns -1.0 if the partials would not fit
 * (never for finite non-negative input; the caller then takes the Python path). */
static double gspar_fsum(const double *x, int64_t m) {
    double partials[GSPAR_PARTIALS];
    int np = 0;
    for (int64_t j = 0; j < m; j++) {
        double v = x[j];
        int i = 0;
        for (int k = 0; k < np; k++) {
            double y = partials[k];
            if (fabs(v) < fabs(y)) {
                const double t = v;
                v = y;
                y = t;
            }
            const double hi = v + y, lo = y - (hi - v);
            if (lo != 0.0) partials[i++] = lo;
            v = hi;
        }
        if (i >= GSPAR_PARTIALS) return -1.0;
        partials[i] = v;
        np = i + 1;
    }
    double hi = 0.0, lo = 0.0;
    int k = np;
    if (k > 0) {
        hi = partials[--k];
        while (k > 0) {
            const double v = hi, y = partials[--k];
            hi = v + y;
            lo = y - (hi - v);
            if (lo != 0.0) break;
        }
        if (k > 0 && ((lo < 0.0 && partials[k - 1] < 0.0) || (lo > 0.0 && partials[k - 1] > 0.0))) {
            const double y = lo * 2.0, v = hi + y;
            if (y == v - hi) hi = v;
        }
    }
    return hi;
}

/* GSpar's encode of `count` tensors: tensor p has ns[p] floats at as[p], the stream keys[p]
 * and the budget budgets[p] (ratio n). Error feedback (es not NULL: tensor p's residual e
 * at es[p]): the tensor encoded is a = g + e, formed in e once it is known finite, its
 * values travel unscaled (scaled 0), and e = a with the kept entries zeroed afterwards
 * (a tensor left to the caller keeps e = a). nonfinite[p] = 1 when the tensor encoded
 * holds a NaN or an Inf (nothing written, e untouched). Else c comes from the scale
 * iteration of codecs/sparse.py's gspar_scale (the same rounds: hvdc_gspar_round with
 * chunk-element sums and their gspar_fsum), the draw (hvdc_gspar_draw, into the scratch
 * values and idx of room caps[p]) keeps ks[p] entries, and the body goes to
 * out + out_starts[p]: the ks[p] values, then their indices (int32, or int64 when
 * wide[p]). ks[p] > caps[p]: more kept than the room, nothing written, the caller encodes
 * that tensor again alone; ks[p] = -1: the sum of the rest came out 0 or did not fit, the
 * caller's path too (which then raises as it does). sums: scratch of the most
 * ceil(n / chunk) doubles. */
void hvdc_gspar_encode_segments(int64_t count, const uint64_t *as, const uint64_t *es,
                                int scaled, const int64_t *ns, const uint64_t *keys,
                                const double *budgets, int64_t chunk, const int64_t *caps,
                                const int32_t *wide, uint8_t *out, const int64_t *out_starts,
                                int64_t *ks, int32_t *nonfinite, float *values, int64_t *idx,
                                double *sums) {
    for (int64_t p = 0; p < count; p++) {
        const float *g = (const float *)(uintptr_t)as[p];
        float *e = es ? (float *)(uintptr_t)es[p] : NULL;
        const int64_t n = ns[p], chunks = (n + chunk - 1) / chunk;
        const double budget = budgets[p];
        nonfinite[p] = hvdc_threelc_absmax_bits(g, e, n) >= 0x7f800000u;
        ks[p] = 0;
        if (nonfinite[p]) continue;
        if (e)
            for (int64_t i = 0; i < n; i++) e[i] = e[i] + g[i];
        const float *a = e ? e : g;
        int64_t nonzero = 0;
        for (int64_t i = 0; i < n; i++) nonzero += a[i] != 0.0f;
        const int all = budget >= (double)nonzero;
        float c32 = 0.0f;
        if (!all) {
            int64_t saturated = hvdc_gspar_round(a, n, 0.0f, chunk, sums); /* c = 0: none */
            for (int64_t round = 1; round <= nonzero + 1; round++) {
                const double rest = gspar_fsum(sums, chunks);
                if (!(rest > 0.0)) {
                    ks[p] = -1;
                    break;
                }
                /* at most FLT_MAX (as codecs/sparse.py's gspar_scale): a double past it
                 * has no float (the conversion would be undefined) */
                c32 = (float)fmin((budget - (double)saturated) / rest, (double)FLT_MAX);
                const int64_t now = hvdc_gspar_round(a, n, c32, chunk, sums);
                if (now == saturated) break;
                saturated = now;
            }
            if (ks[p] < 0) continue;
        }
        const int64_t k = hvdc_gspar_draw(a, n, c32, all, keys[p], scaled, values, idx, caps[p]);
        ks[p] = k;
        if (k > caps[p] || k == 0) continue; /* k == 0: an empty body, out may be NULL */
        uint8_t *body = out + out_starts[p];
        memcpy(body, values, (size_t)k * sizeof(float));
        uint8_t *at = body + 4 * k;
        for (int64_t i = 0; i < k; i++) {
            if (wide[p]) {
                memcpy(at + 8 * i, &idx[i], 8);
            } else {
                const int32_t i32 = (int32_t)idx[i];
                memcpy(at + 4 * i, &i32, 4);
            }
        }
        if (e)
            for (int64_t i = 0; i < k; i++) e[idx[i]] = 0.0f;
    }
}
