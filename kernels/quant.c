/* CPU backend of the stochastic quantisers QSGD and TernGrad (docs/baselines.md),
 * loaded through ctypes (hvdcompress/backends/cpu/); the CUDA twin is quant.cu next to
 * this file, byte for byte the same. The formulas, one IEEE float32 operation each, are
 * those of hvdcompress/codecs/quant.py's module docstring:
 *
 *   hvdc_qsgd_encode     one pass over x, a group of buckets at a time: the buckets' sums
 *                        of x^2 (double, left to right), norm = float32(sqrt(sum)), then
 *                        r = (|x| / norm) * s + u, l = min(floor(r), s), code = 2 l + sign,
 *                        bit-packed LSB first (bits = 1 + ceil(log2(s + 1)), from the caller);
 *   hvdc_qsgd_decode     validates norms, padding and codes, then writes or adds
 *                        +-((l / s) * norm) (as l * (1 / s) * norm in vector lanes when
 *                        that rounds to l / s at every level, else from a table);
 *   hvdc_terngrad_quartic  q = (u < |x| / M) ? sign(x) : 0 as 3LC quartic bytes (the
 *                        caller zero-run encodes them with hvdc_threelc_zre_encode);
 *   hvdc_dqsg_quantize / _dequantize, hvdc_ndqsg_coset / _side_decode  DQSG and NDQSG
 *                        (codecs/dqsg.py, ndqsg.py); hvdc_digits_encode_segments /
 *                        _decode_segments  a bucket of DQSG with s = 1 or of NDQSG's nested
 *                        code in one call (its side information formed in the decode pass).
 *
 * u is the counter-based uniform of hvdc_prim_uniform (kernels/primitives.c) for the
 * element's index in the whole tensor: the encoders take `offset`, the index of x[0], so a
 * tensor may be split into parts (the caller's threads) without changing a byte. A QSGD
 * part starts at a multiple of the bucket size whose bit offset is a whole byte.
 *
 * Codes are packed and unpacked by hvdc_prim_bitpack / hvdc_prim_bitunpack (primitives.c:
 * sixteen codes a step with SSSE3).
 *
 * Memory traffic per element: QSGD encode reads 4 B (twice, the second time from L2) and
 * writes bits / 8 B; decode reads bits / 8 B twice and writes 4 B (8 B with accumulate);
 * TernGrad reads 4 B and writes 1/5 B. Pure functions over caller-owned buffers; built
 * with -ffp-contract=off and without fast-math (C_FLAGS in hvdcompress/_native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* kernels/primitives.c */
void hvdc_prim_add_rows(const double *rows, int64_t stride, const int64_t *n, int64_t lanes,
                        double *s);

#define QUANT_ERR_PADDING -4 /* a padding bit after the last value is set (PRIM_ERR_PADDING) */
#define QUANT_ERR_NORM -5    /* a norm is negative or not finite */
#define QUANT_ERR_CODE -6    /* a level above s, or a zero level with the sign bit */
#define QUANT_ERR_LEVELS -7  /* s outside 1..127, or bits outside 1..8 (the caller's error) */
#define QUANT_MAX_LEVELS 127 /* codes 2 l + sign fit a byte (codecs/quant.py MAX_LEVELS) */
#define QUANT_BLOCK 1024     /* elements per block of uniforms and codes (in L1) */
#define QUANT_SPAN 65536     /* elements of whole buckets whose norms are formed together */
#define QUANT_SPAN_BUCKETS QUANT_SPAN
#define QUANT_LANES 4        /* bucket sums run side by side (independent chains) */
#define QUANT_ROW 1024       /* elements of a bucket staged as doubles at a time (8 KB) */
_Static_assert(QUANT_LANES == 4, "hvdc_prim_add_rows sums at most four rows");
#define QUANT_TERN_BLOCK 1020 /* TernGrad elements per block: whole quartic groups */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QUANT_VECTOR __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define QUANT_VECTOR
#endif

void hvdc_prim_uniform(uint64_t key, int64_t offset, int64_t n, float *out); /* primitives.c */
void hvdc_prim_bitpack(const uint8_t *codes, int64_t n, int bits, uint8_t *out);
int64_t hvdc_prim_bitunpack(const uint8_t *in, int64_t nbytes, int64_t n, int bits,
                            uint8_t *codes);

static inline uint32_t quant_abs_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7fffffffu;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define QUANT_X86_PATHS 1
static int quant_use_avx2;

__attribute__((constructor)) static void quant_init_x86_paths(void) {
    __builtin_cpu_init();
    quant_use_avx2 = __builtin_cpu_supports("avx2");
}
#endif

/* d[i] = x_i^2 in double, i < n (vectorised). */
QUANT_VECTOR static void quant_squares(const float *x, int64_t n, double *d) {
    for (int64_t i = 0; i < n; i++) {
        const double v = (double)x[i];
        d[i] = v * v;
    }
}

#ifdef QUANT_X86_PATHS

/* The sums of x^2 of eight whole buckets at x (bucket elements each) with the buckets in
 * vector lanes: four elements of four buckets are loaded and transposed, so that one
 * vector holds element i of four buckets; each is widened to double, squared (exact: 48
 * bits) and added to its bucket's lane, in element order. Each lane is one bucket's chain
 * of additions in the scalar order, the same sum; eight chains in two vectors cover the
 * addition's latency, and no squares are staged. The last bucket % 4 elements follow,
 * lane by lane. */
__attribute__((target("avx2"))) static void quant_square_sums8_avx2(const float *x,
                                                                    int64_t bucket,
                                                                    double *sums) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd(); /* buckets 0-3, 4-7 */
    const int64_t body = bucket & ~(int64_t)3;
    for (int64_t i = 0; i < body; i += 4) {
        __m128 a0 = _mm_loadu_ps(x + i), a1 = _mm_loadu_ps(x + bucket + i),
               a2 = _mm_loadu_ps(x + 2 * bucket + i), a3 = _mm_loadu_ps(x + 3 * bucket + i);
        __m128 b0 = _mm_loadu_ps(x + 4 * bucket + i), b1 = _mm_loadu_ps(x + 5 * bucket + i),
               b2 = _mm_loadu_ps(x + 6 * bucket + i), b3 = _mm_loadu_ps(x + 7 * bucket + i);
        _MM_TRANSPOSE4_PS(a0, a1, a2, a3);
        _MM_TRANSPOSE4_PS(b0, b1, b2, b3);
        const __m128 a[4] = {a0, a1, a2, a3}, b[4] = {b0, b1, b2, b3};
        for (int k = 0; k < 4; k++) {
            const __m256d da = _mm256_cvtps_pd(a[k]), db = _mm256_cvtps_pd(b[k]);
            lo = _mm256_add_pd(lo, _mm256_mul_pd(da, da));
            hi = _mm256_add_pd(hi, _mm256_mul_pd(db, db));
        }
    }
    _mm256_storeu_pd(sums, lo);
    _mm256_storeu_pd(sums + 4, hi);
    for (int l = 0; l < 8; l++) {
        for (int64_t i = body; i < bucket; i++) {
            const double v = (double)x[l * bucket + i];
            sums[l] += v * v;
        }
    }
}
#endif

/* Sum of x^2 in double, left to right, of each of `count` consecutive buckets of `bucket`
 * elements starting at x (the last may end early, at x[len]). Eight whole buckets at a
 * time in vector lanes where the CPU has AVX2 (quant_square_sums8_avx2); else, and for
 * the rest, QUANT_LANES buckets at a time: their squares are staged as doubles in rows of
 * a block (padded, so that the rows do not alias in L1) by a vectorised pass, then the
 * rows are summed side by side, QUANT_LANES independent chains of additions, each bucket
 * in its own order. */
static void quant_square_sums(const float *x, int64_t len, int64_t bucket, int64_t count,
                              double *sums) {
    double rows[QUANT_LANES][QUANT_ROW + 8]; /* 33 KB of stack */
    for (int64_t b = 0, lanes; b < count; b += lanes) {
#ifdef QUANT_X86_PATHS
        if (quant_use_avx2 && bucket >= 8 && b + 8 <= count && (b + 8) * bucket <= len) {
            quant_square_sums8_avx2(x + b * bucket, bucket, sums + b);
            lanes = 8;
            continue;
        }
#endif
        lanes = count - b < QUANT_LANES ? count - b : QUANT_LANES;
        double s[QUANT_LANES] = {0.0};
        for (int64_t part = 0; part < bucket; part += QUANT_ROW) {
            int64_t n[QUANT_LANES];
            for (int64_t l = 0; l < lanes; l++) {
                const int64_t lo = (b + l) * bucket + part;
                const int64_t end = (b + l + 1) * bucket < len ? (b + l + 1) * bucket : len;
                const int64_t hi = lo + QUANT_ROW < end ? lo + QUANT_ROW : end;
                n[l] = hi > lo ? hi - lo : 0;
                quant_squares(x + lo, n[l], rows[l]);
            }
            hvdc_prim_add_rows(&rows[0][0], QUANT_ROW + 8, n, lanes, s);
        }
        for (int64_t l = 0; l < lanes; l++) sums[b + l] = s[l];
    }
}

/* codes[i] = 2 l + sign of x[0..len) under one bucket's norm (safe: the norm, or 1 where
 * it is 0), with uniforms u. */
QUANT_VECTOR static void quant_qsgd_codes(const float *x, const float *u, int64_t len,
                                          float safe, int levels, uint8_t *codes) {
    const float levels_f = (float)levels;
    for (int64_t i = 0; i < len; i++) {
        const float r = (fabsf(x[i]) / safe) * levels_f + u[i];
        /* r >= 0: truncation is floor; compared as a float first (no int overflow) */
        const int l = r < levels_f ? (int)r : levels;
        codes[i] = (uint8_t)(2 * l + (x[i] < 0.0f && l > 0));
    }
}

/* QSGD body parts for x[0..n) (elements offset .. offset + n - 1 of the tensor; offset a
 * multiple of bucket): norms[0..ceil(n / bucket)) and the packed codes at packed[0]
 * (offset * bits a multiple of 8). One pass: a span of whole buckets (about
 * QUANT_SPAN elements, in L2) gets its norms, then its codes a block at a time; codes wait
 * in `codes` until eight of them fill `bits` whole bytes. Returns 1, with the outputs
 * meaningless, when x holds a NaN or an Inf or a norm overflows float32; else 0. */
int hvdc_qsgd_encode(const float *x, int64_t n, int levels, int bits, int64_t bucket,
                     uint64_t key, int64_t offset, float *norms, uint8_t *packed) {
    float u[QUANT_BLOCK];
    uint8_t codes[QUANT_BLOCK + 8];
    double sums[QUANT_SPAN_BUCKETS];
    const int64_t nb = (n + bucket - 1) / bucket;
    const int64_t span = bucket >= QUANT_SPAN ? 1 : QUANT_SPAN / bucket; /* buckets */
    int64_t pending = 0; /* codes waiting in codes[0..pending), < 8 */
    uint8_t *dst = packed;
    for (int64_t b0 = 0; b0 < nb; b0 += span) {
        const int64_t count = nb - b0 < span ? nb - b0 : span;
        const int64_t lo = b0 * bucket;
        const int64_t hi = lo + count * bucket < n ? lo + count * bucket : n;
        /* the next span, asked into L2 a block's worth of lines per block of codes: its
         * memory traffic overlaps this span's uniforms, which bound the codes' time */
        const char *ahead = (const char *)(x + hi);
        const char *ahead_end = (const char *)(x + (hi + (hi - lo) < n ? hi + (hi - lo) : n));
        quant_square_sums(x + lo, hi - lo, bucket, count, sums);
        for (int64_t b = 0; b < count; b++) {
            const float norm = (float)sqrt(sums[b]);
            if (quant_abs_bits(norm) >= 0x7f800000u) return 1; /* NaN / Inf input, overflow */
            norms[b0 + b] = norm;
        }
        for (int64_t b = 0; b < count; b++) {
            const float safe = norms[b0 + b] > 0.0f ? norms[b0 + b] : 1.0f;
            const int64_t start = lo + b * bucket;
            const int64_t end = start + bucket < n ? start + bucket : n;
            for (int64_t p = start; p < end;) {
                const int64_t room = QUANT_BLOCK - pending;
                const int64_t len = end - p < room ? end - p : room;
                for (int64_t k = 0; k < len * 4 / 64 && ahead < ahead_end; k++, ahead += 64)
                    __builtin_prefetch(ahead, 0, 2);
                hvdc_prim_uniform(key, offset + p, len, u);
                quant_qsgd_codes(x + p, u, len, safe, levels, codes + pending);
                const int64_t total = pending + len, groups = total / 8;
                hvdc_prim_bitpack(codes, 8 * groups, bits, dst);
                dst += groups * bits;
                pending = total - 8 * groups;
                memmove(codes, codes + 8 * groups, (size_t)pending);
                p += len;
            }
        }
    }
    /* the last, short group: ceil(pending bits / 8) bytes, padding zero */
    if (pending) hvdc_prim_bitpack(codes, pending, bits, dst);
    return 0;
}

/* Reads the little-endian float32 at p (the body may sit at any byte offset). */
static inline float quant_load_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}

/* The codes of elements [lo, lo + len) (lo a multiple of 8) of a packed stream of n codes
 * whose length and padding the caller checked, into codes[0..len): ceil(len bits / 8)
 * bytes from byte lo bits / 8, the stream's last bytes when lo + len == n. */
static inline void quant_codes_at(const uint8_t *packed, int64_t lo, int64_t len, int bits,
                                  uint8_t *codes) {
    hvdc_prim_bitunpack(packed + lo / 8 * bits, (len * bits + 7) / 8, len, bits, codes);
}

/* o[i] (+)= +-(((c >> 1) * inv) * norm) for the codes c[0..cnt), sign bit c & 1: the
 * table's values when (float)l * inv is l / s for every level l (the caller checked),
 * computed in vector lanes instead of one table load per element. */
QUANT_VECTOR static void quant_qsgd_values(const uint8_t *c, int64_t cnt, float inv, float norm,
                                           float *o, int accumulate) {
    if (accumulate) {
        for (int64_t i = 0; i < cnt; i++) {
            const float mag = ((float)(c[i] >> 1) * inv) * norm;
            uint32_t u;
            memcpy(&u, &mag, sizeof u);
            u ^= (uint32_t)(c[i] & 1) << 31;
            float v;
            memcpy(&v, &u, sizeof v);
            o[i] = o[i] + v;
        }
    } else {
        for (int64_t i = 0; i < cnt; i++) {
            const float mag = ((float)(c[i] >> 1) * inv) * norm;
            uint32_t u;
            memcpy(&u, &mag, sizeof u);
            u ^= (uint32_t)(c[i] & 1) << 31;
            memcpy(o + i, &u, sizeof u);
        }
    }
}

/* Decodes a QSGD body: norms (4 nb bytes, nb = ceil(n / bucket)) then ceil(n bits / 8)
 * bytes of codes (the caller checked the body length). Validates everything first and
 * returns QUANT_ERR_LEVELS / QUANT_ERR_NORM / QUANT_ERR_PADDING / QUANT_ERR_CODE with out
 * untouched; else writes (or adds) -((l / s) * norm) or (l / s) * norm and returns 0. */
QUANT_VECTOR int64_t hvdc_qsgd_decode(const uint8_t *body, int64_t n, int levels, int bits,
                                      int64_t bucket, float *out, int accumulate) {
    /* the code checks and the value table below hold codes of one byte */
    if (levels < 1 || levels > QUANT_MAX_LEVELS || bits < 1 || bits > 8 || bucket < 1)
        return QUANT_ERR_LEVELS;
    const int64_t nb = (n + bucket - 1) / bucket;
    for (int64_t b = 0; b < nb; b++) {
        const float norm = quant_load_f32(body + 4 * b);
        if (!(norm >= 0.0f) || quant_abs_bits(norm) >= 0x7f800000u) return QUANT_ERR_NORM;
    }
    const uint8_t *packed = body + 4 * nb;
    const int64_t used = n * bits, nbytes = (used + 7) / 8;
    if ((used & 7) && (packed[nbytes - 1] >> (used & 7))) return QUANT_ERR_PADDING;
    /* a bad code c is not 2 l + sign with l <= s (c > 2 s + 1), or is a signed zero level
     * (c == 1): byte compares, vectorised */
    const uint8_t top = (uint8_t)(2 * levels + 1);
    uint8_t codes[QUANT_BLOCK];
    for (int64_t lo = 0; lo < n; lo += QUANT_BLOCK) {
        const int64_t len = n - lo < QUANT_BLOCK ? n - lo : QUANT_BLOCK;
        quant_codes_at(packed, lo, len, bits, codes);
        uint8_t any = 0;
        for (int64_t i = 0; i < len; i++) any |= (uint8_t)((codes[i] > top) | (codes[i] == 1));
        if (any) return QUANT_ERR_CODE;
    }
    /* ratio[l] = l / s, once; per bucket stretch, value[c] = the decoded bits of every valid
     * code c (the same two float32 operations as element by element), then one lookup per
     * element instead of a division */
    const float levels_f = (float)levels;
    float ratio[128];
    for (int l = 0; l <= levels; l++) ratio[l] = (float)l / levels_f;
    /* l * (1 / s) rounds to l / s for every level (always for a power of two s, and for
     * most others): then no table, each value from two vector products */
    const float inv = 1.0f / levels_f;
    int by_product = 1;
    for (int l = 0; l <= levels; l++) by_product &= (float)l * inv == ratio[l];
    const int ncodes = 2 * levels + 2;
    for (int64_t lo = 0; lo < n; lo += QUANT_BLOCK) {
        const int64_t len = n - lo < QUANT_BLOCK ? n - lo : QUANT_BLOCK;
        quant_codes_at(packed, lo, len, bits, codes);
        for (int64_t p = lo; p < lo + len;) { /* one bucket's stretch of this block */
            const int64_t b = p / bucket;
            const int64_t end = (b + 1) * bucket < lo + len ? (b + 1) * bucket : lo + len;
            const float norm = quant_load_f32(body + 4 * b);
            if (by_product) {
                quant_qsgd_values(codes + (p - lo), end - p, inv, norm, out + p, accumulate);
                p = end;
                continue;
            }
            /* (l / s) * norm, then the sign bit flipped for code & 1: IEEE negation */
            float value[256];
            for (int c = 0; c < ncodes; c++) {
                const float mag = ratio[c >> 1] * norm;
                uint32_t u;
                memcpy(&u, &mag, sizeof u);
                u ^= (uint32_t)(c & 1) << 31;
                memcpy(value + c, &u, sizeof u);
            }
            const uint8_t *c = codes + (p - lo);
            float *o = out + p;
            const int64_t cnt = end - p;
            if (accumulate) {
                for (int64_t i = 0; i < cnt; i++) o[i] = o[i] + value[c[i]];
            } else {
                for (int64_t i = 0; i < cnt; i++) o[i] = value[c[i]];
            }
            p = end;
        }
    }
    return 0;
}

/* TernGrad's quartic bytes: digit d_i = q_i + 1 with q_i = (u_i < |x_i| / M) ? sign(x_i) : 0
 * (0 for every i when M == 0), five digits a byte (81 d0 + 27 d1 + 9 d2 + 3 d3 + d4, the
 * last group padded with d = 1), for x[0..n), elements offset .. of the tensor (offset a
 * multiple of 5). quartic must hold ceil(n / 5) bytes. M: max|x| of the whole tensor,
 * finite (the caller checked). */
QUANT_VECTOR void hvdc_terngrad_quartic(const float *x, int64_t n, float M, uint64_t key,
                                        int64_t offset, uint8_t *quartic) {
    float u[QUANT_TERN_BLOCK];
    uint8_t d[QUANT_TERN_BLOCK + 8];
    for (int64_t base = 0; base < n; base += QUANT_TERN_BLOCK) {
        const int64_t len = n - base < QUANT_TERN_BLOCK ? n - base : QUANT_TERN_BLOCK;
        if (M == 0.0f) {
            memset(d, 1, (size_t)len);
        } else {
            hvdc_prim_uniform(key, offset + base, len, u);
            const float *xb = x + base;
            for (int64_t i = 0; i < len; i++) {
                const uint8_t keep = u[i] < fabsf(xb[i]) / M;
                const uint8_t minus = xb[i] < 0.0f;
                d[i] = (uint8_t)(1 + keep - 2 * (keep & minus));
            }
        }
        memset(d + len, 1, 8); /* padding digits of the last group, and pack5's slack */
        for (int64_t g = 0; 5 * g < len; g++) {
            /* 81 d0 + 27 d1 + 9 d2 + 3 d3 + d4 as one product (threelc.c's pack5) */
            uint64_t w;
            memcpy(&w, d + 5 * g, sizeof w);
            quartic[base / 5 + g] = (uint8_t)((w * 0x511B090301ull) >> 32);
        }
    }
}

/* DQSG's quantiser (hvdcompress/codecs/dqsg.py): per bucket delta = max|w| / s (one
 * float32 division; the max is exact), then t = w / safe + (v - 1/2) with safe = delta or
 * 1 where delta == 0 and v the element's uniform, q = clamp(rint(t), -s, s) (round half to
 * even). Writes deltas[0..ceil(n / bucket)) and out[i] = q + code_offset as a byte (0: the
 * int8 q; s: the codes 0..2 s that DQSG bit-packs). w[0..n) are elements offset .. of the
 * tensor (offset a multiple of bucket). Returns 1 when w holds a NaN or an Inf (outputs
 * then meaningless), else 0. */
QUANT_VECTOR int hvdc_dqsg_quantize(const float *w, int64_t n, int levels, int64_t bucket,
                                    uint64_t key, int64_t offset, int code_offset,
                                    float *deltas, uint8_t *out) {
    float u[QUANT_BLOCK];
    const float levels_f = (float)levels;
    const float magic = 12582912.0f; /* 1.5 * 2^23: (t + magic) - magic = rint(t), |t| <= 2^22 */
    const int64_t nb = (n + bucket - 1) / bucket;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t lo = b * bucket, hi = lo + bucket < n ? lo + bucket : n;
        uint32_t worst = 0;
        for (int64_t i = lo; i < hi; i++) {
            const uint32_t a = quant_abs_bits(w[i]);
            worst = a > worst ? a : worst;
        }
        if (worst >= 0x7f800000u) return 1;
        float m;
        memcpy(&m, &worst, sizeof m);
        const float delta = m / levels_f;
        deltas[b] = delta;
        const float safe = delta > 0.0f ? delta : 1.0f;
        for (int64_t p = lo; p < hi; p += QUANT_BLOCK) {
            const int64_t len = hi - p < QUANT_BLOCK ? hi - p : QUANT_BLOCK;
            hvdc_prim_uniform(key, offset + p, len, u);
            for (int64_t i = 0; i < len; i++) {
                /* |t| <= s (1 + 2^-23) + 1/2 with delta > 0, |w| + 1/2 tiny otherwise */
                const float t = w[p + i] / safe + (u[i] - 0.5f);
                float q = (t + magic) - magic;
                q = q > levels_f ? levels_f : q < -levels_f ? -levels_f : q;
                out[p + i] = (uint8_t)((int)q + code_offset);
            }
        }
    }
    return 0;
}

/* DQSG's reconstruction: out[i] = delta_b * (q_i - (v_i - 1/2)) (one float32 subtraction,
 * one product), or out[i] += that, for the int8 q[0..n) in [-s, s] and the little-endian
 * float32 deltas (any byte offset) the caller validated. Elements offset .. of the tensor
 * (offset a multiple of bucket). */
QUANT_VECTOR void hvdc_dqsg_dequantize(const int8_t *q, int64_t n, const uint8_t *deltas,
                                       int64_t bucket, uint64_t key, int64_t offset, float *out,
                                       int accumulate) {
    float u[QUANT_BLOCK];
    const int64_t nb = (n + bucket - 1) / bucket;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t lo = b * bucket, hi = lo + bucket < n ? lo + bucket : n;
        const float delta = quant_load_f32(deltas + 4 * b);
        for (int64_t p = lo; p < hi; p += QUANT_BLOCK) {
            const int64_t len = hi - p < QUANT_BLOCK ? hi - p : QUANT_BLOCK;
            hvdc_prim_uniform(key, offset + p, len, u);
            float *o = out + p;
            const int8_t *qp = q + p;
            if (accumulate) {
                for (int64_t i = 0; i < len; i++)
                    o[i] = o[i] + delta * ((float)qp[i] - (u[i] - 0.5f));
            } else {
                for (int64_t i = 0; i < len; i++) o[i] = delta * ((float)qp[i] - (u[i] - 0.5f));
            }
        }
    }
}

/* NDQSG's coset of the fine index (hvdcompress/codecs/ndqsg.py): m = k - rho rint(k / rho)
 * (one float32 division, round half to even, one product, one difference), for k in
 * k[0..n) (int8), written as m + code_offset (0: the int8 m; rho // 2: the codes NDQSG
 * bit-packs). m depends on k alone: a table of the 256 int8 values, one load an element. */
void hvdc_ndqsg_coset(const int8_t *k, int64_t n, int rho, int code_offset, uint8_t *out) {
    uint8_t table[256];
    const float rho_f = (float)rho;
    for (int v = -128; v < 128; v++) {
        const float kf = (float)v;
        const float m = kf - rho_f * rintf(kf / rho_f);
        table[(uint8_t)v] = (uint8_t)((int)m + code_offset);
    }
    for (int64_t i = 0; i < n; i++) out[i] = table[(uint8_t)k[i]];
}

/* NDQSG's side-information decoder for the cosets m[0..n) (int8) of a nested body, the
 * validated float32 deltas (any byte offset) and the side information y: per element, with
 * u = v - 1/2 the dither, safe = delta or 1 where delta == 0,
 *   r = safe (m - u) - y,  j = rint(r / (safe rho)),  k = m - rho j  (0 where delta == 0),
 *   w = delta (k - u)
 * (each one float32 operation, in the order of codecs/ndqsg.py's side_decode_into),
 * written to out or added to it (out may be NULL: only the count wanted). Returns how many
 * k differ from k_true (the sender's fine indices, int8; NULL: 0), the aliasing count,
 * without materialising k. One pass with the uniforms a block at a time in L1.
 * y NULL: the gather path's side information fl32(out[i] / y_divisor) (the mean of the
 * ranks decoded before, out holding their sum), formed from out before it is added to. */
static inline int64_t ndqsg_side_decode(const int8_t *m, int64_t n, const uint8_t *deltas,
                                        const float *y, float y_divisor, int rho,
                                        int64_t bucket, uint64_t key, float *out,
                                        int accumulate, const int8_t *k_true) {
    float u[QUANT_BLOCK], y_block[QUANT_BLOCK];
    const float rho_f = (float)rho;
    const int64_t nb = (n + bucket - 1) / bucket;
    int64_t aliased = 0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t lo = b * bucket, hi = lo + bucket < n ? lo + bucket : n;
        const float delta = quant_load_f32(deltas + 4 * b);
        const float safe = delta > 0.0f ? delta : 1.0f, coarse = safe * rho_f;
        for (int64_t p = lo; p < hi; p += QUANT_BLOCK) {
            const int64_t len = hi - p < QUANT_BLOCK ? hi - p : QUANT_BLOCK;
            hvdc_prim_uniform(key, p, len, u);
            const float *yp = y ? y + p : y_block;
            if (!y)
                for (int64_t i = 0; i < len; i++) y_block[i] = out[p + i] / y_divisor;
            for (int64_t i = 0; i < len; i++) {
                const float d = u[i] - 0.5f, mf = (float)m[p + i];
                const float r = safe * (mf - d) - yp[i];
                float k = mf - rho_f * rintf(r / coarse);
                k = delta > 0.0f ? k : 0.0f;
                u[i] = k; /* u[i] is read no more: k staged for the count */
                const float w = delta * (k - d);
                if (out) out[p + i] = accumulate ? out[p + i] + w : w;
            }
            if (k_true)
                for (int64_t i = 0; i < len; i++) aliased += (float)k_true[p + i] != u[i];
        }
    }
    return aliased;
}

QUANT_VECTOR int64_t hvdc_ndqsg_side_decode(const int8_t *m, int64_t n, const uint8_t *deltas,
                                            const float *y, int rho, int64_t bucket,
                                            uint64_t key, float *out, int accumulate,
                                            const int8_t *k_true) {
    return ndqsg_side_decode(m, n, deltas, y, 1.0f, rho, bucket, key, out, accumulate, k_true);
}

/* hvdc_qsgd_decode (accumulating) of `count` bodies in one call, every tensor with the
 * same levels, bits and bucket: body p at body + starts[p] (the caller checked its
 * length) of ns[p] values, added into the floats at address outs[p]. Returns -1 - p for
 * the first body p that does not decode (bodies before it added, its output untouched)
 * with its error code in *code, else 0. */
int64_t hvdc_qsgd_decode_segments(int64_t count, const uint8_t *body, const int64_t *starts,
                                  const int64_t *ns, int levels, int bits, int64_t bucket,
                                  const uint64_t *outs, int64_t *code) {
    for (int64_t p = 0; p < count; p++) {
        if (ns[p] == 0) continue;
        int64_t rc = hvdc_qsgd_decode(body + starts[p], ns[p], levels, bits, bucket,
                                      (float *)(uintptr_t)outs[p], 1);
        if (rc < 0) {
            *code = rc;
            return -1 - p;
        }
    }
    return 0;
}

int64_t hvdc_threelc_zre_encode(const uint8_t *in, int64_t m, uint8_t *out);  /* threelc.c */
uint32_t hvdc_threelc_absmax_bits(const float *g, const float *e, int64_t n); /* threelc.c */

/* TernGrad's encode of `count` tensors in one call (a bucket): tensor p has ns[p] floats
 * at address xs[p] and the random stream keys[p]; scales[p] = M = max|x| and its body
 * (the quartic digits of hvdc_terngrad_quartic, zero-run encoded by hvdc_threelc_zre_encode)
 * at out + out_starts[p] (room for ceil(n / 5) + 2 bytes), lens[p] its length; or
 * lens[p] = -1 when x holds a NaN or an Inf (nothing written). quartic: scratch of the
 * largest ceil(n / 5) bytes. */
void hvdc_terngrad_encode_segments(int64_t count, const uint64_t *xs, const int64_t *ns,
                                   const uint64_t *keys, uint8_t *out, const int64_t *out_starts,
                                   uint8_t *quartic, float *scales, int64_t *lens) {
    for (int64_t p = 0; p < count; p++) {
        const float *x = (const float *)(uintptr_t)xs[p];
        const uint32_t bits = hvdc_threelc_absmax_bits(x, NULL, ns[p]);
        if (bits >= 0x7f800000u) {
            scales[p] = 0.0f;
            lens[p] = -1;
            continue;
        }
        float M;
        memcpy(&M, &bits, sizeof M);
        scales[p] = M;
        hvdc_terngrad_quartic(x, ns[p], M, keys[p], 0, quartic);
        lens[p] = hvdc_threelc_zre_encode(quartic, (ns[p] + 4) / 5, out + out_starts[p]);
    }
}

/* --- a bucket's DQSG with s > 1 (codecs/dqsg.py encode / decode_q + decode_into) --------- */


/* Errors of hvdc_dqsg_decode_segments, in codecs/dqsg.py decode_q's order. */
#define DQSG_ERR_DELTAS_LEN -11 /* the body cannot hold the bucket deltas */
#define DQSG_ERR_DELTA -12      /* a delta is negative or not finite */
#define DQSG_ERR_CODES_LEN -13  /* the packed codes are not ceil(n bits / 8) bytes */
#define DQSG_ERR_PADDING -14    /* a padding bit after the last code is set */
#define DQSG_ERR_CODE -15       /* a code above 2 s */

/* DQSG encode (s = levels > 1) of `count` tensors in one call: tensor p, ns[p] floats at
 * xs[p] with the random stream keys[p], gets its body at out + out_starts[p]: the float32
 * deltas of its buckets, then its codes q + s bit-packed (bits each). nonfinite[p] = 1
 * (nothing written) when x holds a NaN or an Inf. Scratch: deltas (the most buckets) and
 * codes (the most elements). */
void hvdc_dqsg_encode_segments(int64_t count, const uint64_t *xs, const int64_t *ns,
                               const uint64_t *keys, int levels, int bits, int64_t bucket,
                               uint8_t *out, const int64_t *out_starts, int32_t *nonfinite,
                               float *deltas, uint8_t *codes) {
    for (int64_t p = 0; p < count; p++) {
        const int64_t n = ns[p], nb = (n + bucket - 1) / bucket;
        nonfinite[p] = hvdc_dqsg_quantize((const float *)(uintptr_t)xs[p], n, levels, bucket,
                                          keys[p], 0, levels, deltas, codes);
        if (nonfinite[p]) continue;
        if (n == 0) continue; /* an empty body: out may be NULL (no memcpy from or to NULL) */
        uint8_t *body = out + out_starts[p];
        memcpy(body, deltas, (size_t)(4 * nb));
        hvdc_prim_bitpack(codes, n, bits, body + 4 * nb);
    }
}

/* DQSG decode (s = levels > 1, accumulating) of `count` bodies in one call: body p is
 * lens[p] bytes at body + starts[p], ns[p] values with the stream keys[p], added into the
 * floats at outs[p]. Checks in decode_q's order: the deltas' length, each delta finite
 * and >= 0, the codes' length, padding bits, codes <= 2 s; then reconstructs. Returns
 * -1 - p for the first body p that does not decode (the ones before it added, its output
 * untouched) with its DQSG_ERR_* in *code, else 0. Scratch: codes (the most elements). */
int64_t hvdc_dqsg_decode_segments(int64_t count, const uint8_t *body, const int64_t *starts,
                                  const int64_t *lens, const int64_t *ns, const uint64_t *keys,
                                  int levels, int bits, int64_t bucket, const uint64_t *outs,
                                  uint8_t *codes, int64_t *code) {
    for (int64_t p = 0; p < count; p++) {
        const uint8_t *b = body + starts[p];
        const int64_t n = ns[p], nb = (n + bucket - 1) / bucket, len = lens[p];
        int64_t rc = 0;
        if (len < 4 * nb) rc = DQSG_ERR_DELTAS_LEN;
        for (int64_t i = 0; rc == 0 && i < nb; i++) {
            const float d = quant_load_f32(b + 4 * i);
            if (!(d >= 0.0f) || quant_abs_bits(d) >= 0x7f800000u) rc = DQSG_ERR_DELTA;
        }
        if (rc == 0) {
            const int64_t got = hvdc_prim_bitunpack(b + 4 * nb, len - 4 * nb, n, bits, codes);
            if (got == QUANT_ERR_PADDING) rc = DQSG_ERR_PADDING;
            else if (got < 0) rc = DQSG_ERR_CODES_LEN;
        }
        uint8_t any = 0;
        for (int64_t i = 0; rc == 0 && i < n; i++) any |= codes[i] > 2 * levels;
        if (rc == 0 && any) rc = DQSG_ERR_CODE;
        if (rc < 0) {
            *code = rc;
            return -1 - p;
        }
        if (n == 0) continue;
        for (int64_t i = 0; i < n; i++) codes[i] = (uint8_t)(int8_t)((int)codes[i] - levels);
        hvdc_dqsg_dequantize((const int8_t *)codes, n, b, bucket, keys[p], 0,
                             (float *)(uintptr_t)outs[p], 1);
    }
    return 0;
}

/* --- a bucket's ternary DQSG (s = 1) and NDQSG nested code (codecs/dqsg.py, ndqsg.py) ---- */

void hvdc_threelc_quartic_encode(const int8_t *q, int64_t n, uint8_t *quartic);   /* threelc.c */
int64_t hvdc_threelc_zre_decoded_len(const uint8_t *in, int64_t len);             /* threelc.c */
int64_t hvdc_threelc_zre_decode(const uint8_t *in, int64_t len, uint8_t *out, int64_t m);
int64_t hvdc_threelc_quartic_decode(const uint8_t *quartic, int64_t n, int8_t *q); /* threelc.c */

/* Errors of the two decoders below (the caller re-runs the per-payload decoder of the body
 * for its message): the deltas do not fit, a delta is negative or not finite, the packed
 * digits do not decode (length, a byte or code out of range, padding). */
#define DIGITS_ERR_DELTAS_LEN -21
#define DIGITS_ERR_DELTA -22
#define DIGITS_ERR_PACKED -23

/* DQSG's quantiser (s = levels) of `count` tensors in one call, then the digits packed:
 * tensor p (ns[p] floats at xs[p], stream keys[p]) gets its int8 fine indices k at
 * ks + k_starts[p] (k_starts all 0: ks is scratch) and its body at out + out_starts[p]:
 * the float32 deltas, then the digits, which are k itself (rho == 0: DQSG with s = 1) or
 * its cosets m = k - rho rint(k / rho) (NDQSG's nested code, rho >= 2). Digits in
 * {-1, 0, 1} (rho <= 3) are quartic encoded (digit + 1) and zero-run encoded; larger
 * cosets are bit-packed as m + rho // 2 in `bits` bits. lens[p] is the body's length, or
 * -1 (nothing written) when x holds a NaN or an Inf. Room: 4 nb + ceil(n / 5) + 2 bytes
 * (zero-run) or 4 nb + ceil(n bits / 8). Scratch: deltas (the most buckets), codes (the
 * most elements), quartic (the most groups). */
void hvdc_digits_encode_segments(int64_t count, const uint64_t *xs, const int64_t *ns,
                                 const uint64_t *keys, int levels, int rho, int bits,
                                 int64_t bucket, int8_t *ks, const int64_t *k_starts,
                                 uint8_t *out, const int64_t *out_starts, int64_t *lens,
                                 float *deltas, uint8_t *codes, uint8_t *quartic) {
    const int ternary = rho <= 3, half = rho / 2;
    for (int64_t p = 0; p < count; p++) {
        const int64_t n = ns[p], nb = (n + bucket - 1) / bucket;
        int8_t *k = ks + k_starts[p];
        if (hvdc_dqsg_quantize((const float *)(uintptr_t)xs[p], n, levels, bucket, keys[p], 0,
                               0, deltas, (uint8_t *)k)) {
            lens[p] = -1;
            continue;
        }
        if (n == 0) { /* an empty body: out may be NULL (no memcpy from or to NULL) */
            lens[p] = 0;
            continue;
        }
        uint8_t *body = out + out_starts[p];
        memcpy(body, deltas, (size_t)(4 * nb));
        const int8_t *digits = k;
        if (rho > 0) {
            hvdc_ndqsg_coset(k, n, rho, ternary ? 0 : half, codes);
            digits = (const int8_t *)codes;
        }
        if (ternary) {
            hvdc_threelc_quartic_encode(digits, n, quartic);
            lens[p] = 4 * nb + hvdc_threelc_zre_encode(quartic, (n + 4) / 5, body + 4 * nb);
        } else {
            hvdc_prim_bitpack(codes, n, bits, body + 4 * nb);
            lens[p] = 4 * nb + (n * bits + 7) / 8;
        }
    }
}

/* Checks one body of n digits as codecs/ndqsg.py decode_m (and dqsg.py decode_q, s = 1)
 * do, in their order, and unpacks the int8 digits into `digits`: 0 or a DIGITS_ERR_*.
 * quartic: scratch of ceil(n / 5) bytes (ternary digits). */
static int64_t digits_unpack(const uint8_t *b, int64_t len, int64_t n, int64_t bucket,
                             int ternary, int bits, int max_code, int code_offset,
                             int8_t *digits, uint8_t *quartic) {
    const int64_t nb = (n + bucket - 1) / bucket;
    if (len < 4 * nb) return DIGITS_ERR_DELTAS_LEN;
    for (int64_t i = 0; i < nb; i++) {
        const float d = quant_load_f32(b + 4 * i);
        if (!(d >= 0.0f) || quant_abs_bits(d) >= 0x7f800000u) return DIGITS_ERR_DELTA;
    }
    const uint8_t *rest = b + 4 * nb;
    const int64_t rest_len = len - 4 * nb, m = (n + 4) / 5;
    if (ternary) {
        if (hvdc_threelc_zre_decoded_len(rest, rest_len) != m) return DIGITS_ERR_PACKED;
        hvdc_threelc_zre_decode(rest, rest_len, quartic, m);
        return hvdc_threelc_quartic_decode(quartic, n, digits) ? DIGITS_ERR_PACKED : 0;
    }
    uint8_t *codes = (uint8_t *)digits;
    if (hvdc_prim_bitunpack(rest, rest_len, n, bits, codes) < 0) return DIGITS_ERR_PACKED;
    uint8_t worst = 0;
    for (int64_t i = 0; i < n; i++) worst = codes[i] > worst ? codes[i] : worst;
    if (worst > max_code) return DIGITS_ERR_PACKED;
    for (int64_t i = 0; i < n; i++) codes[i] = (uint8_t)(int8_t)((int)codes[i] - code_offset);
    return 0;
}

/* The decoders of hvdc_digits_encode_segments' bodies, `count` in one call, accumulating:
 * body p is lens[p] bytes at body + starts[p], ns[p] values with the stream keys[p], added
 * into the floats at outs[p]. rho == 0: DQSG with s = 1 (codecs/dqsg.py decode_q, then
 * delta (q - u)); rho >= 2: NDQSG's nested code (codecs/ndqsg.py decode_m, then
 * side_decode_into with the gather path's side information y = fl32(out / y_divisor), the
 * mean of the y_divisor ranks already summed in out, formed in the same pass), with
 * k_trues[p] the address of the sender's int8 fine indices (this rank's own payload) or 0
 * and aliased[p] how many decoded indices differ from them (0 without). Ternary digits
 * (rho <= 3) are quartic + zero-run coded, larger cosets codes m + rho // 2 of `bits`
 * bits. Returns -1 - p for the first body p that does not decode (the ones before it added,
 * its output untouched) with its DIGITS_ERR_* in *code, else 0. Scratch: digits (the most
 * elements), quartic (the most groups). */
QUANT_VECTOR int64_t hvdc_digits_decode_segments(int64_t count, const uint8_t *body,
                                                 const int64_t *starts, const int64_t *lens,
                                                 const int64_t *ns, const uint64_t *keys,
                                                 int rho, int bits, int64_t bucket,
                                                 float y_divisor, const uint64_t *outs,
                                                 const uint64_t *k_trues, int64_t *aliased,
                                                 int8_t *digits, uint8_t *quartic,
                                                 int64_t *code) {
    const int half = rho / 2;
    for (int64_t p = 0; p < count; p++) {
        const uint8_t *b = body + starts[p];
        const int64_t n = ns[p];
        float *out = (float *)(uintptr_t)outs[p];
        aliased[p] = 0;
        const int64_t rc =
            digits_unpack(b, lens[p], n, bucket, rho <= 3, bits, 2 * half, half, digits, quartic);
        if (rc < 0) {
            *code = rc;
            return -1 - p;
        }
        if (n == 0) continue;
        if (rho == 0)
            hvdc_dqsg_dequantize(digits, n, b, bucket, keys[p], 0, out, 1);
        else
            aliased[p] = ndqsg_side_decode(digits, n, b, NULL, y_divisor, rho, bucket, keys[p],
                                           out, 1, (const int8_t *)(uintptr_t)k_trues[p]);
    }
    return 0;
}
