/* CPU backend of the sign codecs, signSGD and EF-signSGD (docs/baselines.md), loaded
 * through ctypes (hvdcompress/backends/cpu/); the CUDA twin is sign.cu next to this file,
 * byte for byte the same. Body: bit i = (a_i < 0), packed LSB first (a -0.0 is sent as +);
 * decoding gives bit ? -scale : +scale, scale 1 for signSGD.
 *
 *   hvdc_sign_encode      one pass: bits of x and whether x holds a NaN or an Inf;
 *   hvdc_efsign_sums      EF-signSGD pass 1: sums of |g + e| over chunks, in double,
 *                         each chunk strictly left to right (hvdc_prim_chunk_sums' order),
 *                         and whether g + e holds a NaN or an Inf (nothing written then);
 *   hvdc_efsign_encode    EF-signSGD pass 2: bits of a = g + e and e <- a - (+-scale);
 *   hvdc_sign_decode      checks the padding bits, then writes or adds +-scale;
 *   hvdc_sign_encode_segments  hvdc_sign_encode of a bucket's tensors in one call.
 *
 * Ranges: the encoders may be called on a part of a tensor that starts at a multiple of
 * 8 elements (the caller's threads), writing the part's bytes; every byte depends only on
 * its own 8 elements, so the bytes do not depend on how the tensor is split.
 *
 * Memory traffic per element: signSGD encode reads 4 B, writes 1/8 B; EF-signSGD reads
 * 8 B (pass 1), then reads 8 B, writes 4 B + 1/8 B (pass 2); decode reads 1/8 B and
 * writes 4 B (reads and writes 4 B more with accumulate).
 * Pure functions over caller-owned buffers; built with -ffp-contract=off and without
 * fast-math (C_FLAGS in hvdcompress/_native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* kernels/primitives.c */
void hvdc_prim_add_rows(const double *rows, int64_t stride, const int64_t *n, int64_t lanes,
                        double *s);

#define SIGN_ERR_PADDING -4 /* a padding bit after the last value is set (PRIM_ERR_PADDING) */
#define SIGN_NONFINITE_BITS 0x7f800000u /* abs bits at or above: Inf or NaN */
#define SIGN_LANES 4   /* EF-signSGD chunks summed side by side (independent chains) */
#define SIGN_ROW 1024  /* elements of a chunk staged as doubles at a time (8 KB) */
_Static_assert(SIGN_LANES == 4, "hvdc_prim_add_rows sums at most four rows");

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SIGN_VECTOR __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define SIGN_VECTOR
#endif

static inline uint32_t sign_abs_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7fffffffu;
}

/* Eight lanes of a byte (GCC vector types: every target_clones clone, the baseline one
 * included, compiles from this source). */
typedef float sign_f32x8 __attribute__((vector_size(32)));
typedef uint32_t sign_u32x8 __attribute__((vector_size(32)));
typedef uint32_t sign_u32x4 __attribute__((vector_size(16)));
static const sign_u32x8 SIGN_LANE_BIT = {1, 2, 4, 8, 16, 32, 64, 128};

/* The byte whose bit k is set where lane k of *minus (a comparison mask) is true. */
static inline __attribute__((always_inline)) uint8_t sign_mask_byte(const sign_u32x8 *minus) {
    const sign_u32x8 bits = *minus & SIGN_LANE_BIT;
    sign_u32x4 half[2];
    memcpy(half, &bits, sizeof half);
    sign_u32x4 q = half[0] | half[1];
    q |= __builtin_shuffle(q, (sign_u32x4){2, 3, 0, 1});
    q |= __builtin_shuffle(q, (sign_u32x4){1, 0, 3, 2});
    return (uint8_t)q[0];
}

/* The byte of elements x[0..k), k <= 8: bit j = x[j] < 0. */
static inline uint8_t sign_byte(const float *x, int k) {
    uint32_t b = 0;
    for (int j = 0; j < k; j++) b |= (uint32_t)(x[j] < 0.0f) << j;
    return (uint8_t)b;
}

/* out[0..ceil(n / 8)) = the sign bits of x[0..n). Returns 1 when x holds a NaN or an Inf
 * (the bytes are then meaningless), else 0. Eight lanes a byte: the lane-wise max of the
 * abs bits, and the byte of the x < 0 mask. */
SIGN_VECTOR int hvdc_sign_encode(const float *restrict x, int64_t n, uint8_t *restrict out) {
    sign_u32x8 worst = {0};
    const int64_t full = n / 8;
    for (int64_t j = 0; j < full; j++) {
        sign_f32x8 v;
        memcpy(&v, x + 8 * j, sizeof v);
        sign_u32x8 a;
        memcpy(&a, &v, sizeof a);
        a &= 0x7fffffffu;
        const sign_u32x8 up = a > worst;
        worst = (a & up) | (worst & ~up);
        const sign_u32x8 minus = (sign_u32x8)(v < 0.0f);
        out[j] = sign_mask_byte(&minus);
    }
    uint32_t top = 0;
    for (int l = 0; l < 8; l++) top = worst[l] > top ? worst[l] : top;
    for (int64_t i = 8 * full; i < n; i++) {
        uint32_t a = sign_abs_bits(x[i]);
        top = a > top ? a : top;
    }
    if (n % 8) out[full] = sign_byte(x + 8 * full, (int)(n % 8));
    return top >= SIGN_NONFINITE_BITS;
}

/* d[i] = |g_i + e_i| in double (the float32 sum, then |.|), i < n; returns the max abs
 * bits of the sums (>= SIGN_NONFINITE_BITS: a NaN or an Inf). Vectorised. */
SIGN_VECTOR static uint32_t sign_abs_sums(const float *g, const float *e, int64_t n, double *d) {
    uint32_t worst = 0;
    for (int64_t i = 0; i < n; i++) {
        const float a = g[i] + e[i];
        const uint32_t b = sign_abs_bits(a);
        worst = b > worst ? b : worst;
        d[i] = fabs((double)a);
    }
    return worst;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SIGN_X86_PATHS 1
static int sign_use_avx2;

__attribute__((constructor)) static void sign_init_x86_paths(void) {
    __builtin_cpu_init();
    sign_use_avx2 = __builtin_cpu_supports("avx2");
}

/* The sums of |g_i + e_i| of four whole chunks (chunk elements each, a multiple of 4) with
 * the chunks in vector lanes: a = g + e (float32) for four elements of the four chunks,
 * the 4 x 4 block transposed so that one vector holds element i of the four chunks,
 * widened to double, |.|, added to its chunk's lane in element order. Each lane is one
 * chunk's chain of additions in the scalar order (the same sum), and nothing is staged.
 * Four chunks, eight sequential streams (eight chunks ran slower: sixteen streams).
 * Returns the max abs bits of the a. */
__attribute__((target("avx2"))) static uint32_t sign_abs_sums4_avx2(const float *g,
                                                                   const float *e,
                                                                   int64_t chunk,
                                                                   double *sums) {
    const __m256d magnitude = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffll));
    const __m128i abs_bits = _mm_set1_epi32(0x7fffffff);
    __m256d acc = _mm256_setzero_pd();
    __m128i worst = _mm_setzero_si128();
    for (int64_t i = 0; i < chunk; i += 4) {
        __m128 a[4];
        for (int l = 0; l < 4; l++) {
            a[l] = _mm_add_ps(_mm_loadu_ps(g + l * chunk + i), _mm_loadu_ps(e + l * chunk + i));
            worst = _mm_max_epu32(worst, _mm_and_si128(_mm_castps_si128(a[l]), abs_bits));
        }
        _MM_TRANSPOSE4_PS(a[0], a[1], a[2], a[3]);
        for (int k = 0; k < 4; k++)
            acc = _mm256_add_pd(acc, _mm256_and_pd(_mm256_cvtps_pd(a[k]), magnitude));
    }
    _mm256_storeu_pd(sums, acc);
    uint32_t w[4];
    _mm_storeu_si128((__m128i *)w, worst);
    uint32_t top = 0;
    for (int k = 0; k < 4; k++) top = w[k] > top ? w[k] : top;
    return top;
}
#endif

/* sums[c] = sum over i in chunk c of |g_i + e_i| (float32 sum, then |.| in double), in
 * double, left to right. Eight whole chunks at a time in vector lanes where the CPU has
 * AVX2 (sign_abs_sums8_avx2); else, and for the rest, SIGN_LANES chunks at a time: one
 * vectorised pass writes their |a| as doubles into rows of a block (padded, so that the
 * rows do not alias in L1), then the rows are summed side by side, SIGN_LANES independent
 * chains of additions, each chunk in its own order. Returns 1 when some g_i + e_i is a
 * NaN or an Inf (sums then meaningless), else 0. */
int hvdc_efsign_sums(const float *g, const float *e, int64_t n, int64_t chunk, double *sums) {
    double rows[SIGN_LANES][SIGN_ROW + 8]; /* 33 KB of stack */
    const int64_t chunks = (n + chunk - 1) / chunk;
    for (int64_t c = 0, lanes; c < chunks; c += lanes) {
#ifdef SIGN_X86_PATHS
        if (sign_use_avx2 && chunk % 4 == 0 && c + 4 <= chunks && (c + 4) * chunk <= n) {
            const int64_t at = c * chunk;
            if (sign_abs_sums4_avx2(g + at, e + at, chunk, sums + c) >= SIGN_NONFINITE_BITS)
                return 1;
            lanes = 4;
            continue;
        }
#endif
        lanes = chunks - c < SIGN_LANES ? chunks - c : SIGN_LANES;
        double s[SIGN_LANES] = {0.0};
        /* the chunks' parts of at most SIGN_ROW elements, each chunk in order */
        for (int64_t part = 0; part < chunk; part += SIGN_ROW) {
            int64_t len[SIGN_LANES];
            for (int64_t l = 0; l < lanes; l++) {
                const int64_t lo = (c + l) * chunk + part;
                const int64_t end = (c + l + 1) * chunk < n ? (c + l + 1) * chunk : n;
                const int64_t hi = lo + SIGN_ROW < end ? lo + SIGN_ROW : end;
                len[l] = hi > lo ? hi - lo : 0;
                if (sign_abs_sums(g + lo, e + lo, len[l], rows[l]) >= SIGN_NONFINITE_BITS)
                    return 1;
            }
            hvdc_prim_add_rows(&rows[0][0], SIGN_ROW + 8, len, lanes, s);
        }
        for (int64_t l = 0; l < lanes; l++) sums[c + l] = s[l];
    }
    return 0;
}

/* Elements lo .. lo + k - 1 (k <= 8) of hvdc_efsign_encode, one at a time: its byte. */
static uint8_t sign_efsign_byte(const float *g, float *e, float scale, int k) {
    uint32_t b = 0;
    for (int t = 0; t < k; t++) {
        const float a = g[t] + e[t];
        const int minus = a < 0.0f;
        b |= (uint32_t)minus << t;
        e[t] = a - (minus ? -scale : scale);
    }
    return (uint8_t)b;
}

/* a = g + e; out = sign bits of a; e <- a - (a < 0 ? -scale : scale) (one float32
 * subtraction). The caller checked that a is finite (hvdc_efsign_sums). Eight lanes a
 * byte: the comparison mask a < 0 flips scale's sign bit (IEEE negation) and gives the
 * byte (sign_mask_byte). */
SIGN_VECTOR void hvdc_efsign_encode(const float *restrict g, float *restrict e, float scale,
                                    int64_t n, uint8_t *restrict out) {
    uint32_t s;
    memcpy(&s, &scale, sizeof s);
    const sign_u32x8 sv = (sign_u32x8){0} + s;
    const int64_t full = n / 8;
    for (int64_t j = 0; j < full; j++) {
        sign_f32x8 a, r;
        memcpy(&a, g + 8 * j, sizeof a);
        memcpy(&r, e + 8 * j, sizeof r);
        a = a + r;
        const sign_u32x8 minus = (sign_u32x8)(a < 0.0f);
        const sign_u32x8 step_bits = sv ^ (minus & 0x80000000u);
        memcpy(&r, &step_bits, sizeof r);
        r = a - r;
        memcpy(e + 8 * j, &r, sizeof r);
        out[j] = sign_mask_byte(&minus);
    }
    if (n % 8) out[full] = sign_efsign_byte(g + 8 * full, e + 8 * full, scale, (int)(n % 8));
}

/* out[i] = (bit i ? -scale : scale), or out[i] += that with accumulate, for i < n from
 * body[0..ceil(n / 8)) (the caller checked the length). -scale is scale with its sign bit
 * flipped (IEEE negation), so each value is scale's bits XOR (bit << 31): one byte gives
 * eight lanes by a variable shift, branch-free. Returns 0, or SIGN_ERR_PADDING with out
 * untouched when a padding bit after element n - 1 is set. */
SIGN_VECTOR int64_t hvdc_sign_decode(const uint8_t *restrict body, int64_t n, float scale,
                                     float *restrict out, int accumulate) {
    if ((n & 7) && (body[n / 8] >> (n & 7))) return SIGN_ERR_PADDING;
    uint32_t s;
    memcpy(&s, &scale, sizeof s);
    const sign_u32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const sign_u32x8 sv = (sign_u32x8){0} + s;
    const int64_t full = n / 8;
    for (int64_t j = 0; j < full; j++) {
        const sign_u32x8 bits = sv ^ ((((sign_u32x8){0} + (uint32_t)body[j]) >> lane & 1u) << 31);
        if (accumulate) {
            sign_f32x8 v, o;
            memcpy(&v, &bits, sizeof v);
            memcpy(&o, out + 8 * j, sizeof o);
            o = o + v;
            memcpy(out + 8 * j, &o, sizeof o);
        } else {
            memcpy(out + 8 * j, &bits, sizeof bits);
        }
    }
    for (int64_t i = 8 * full; i < n; i++) {
        const uint32_t b = s ^ ((uint32_t)(body[i >> 3] >> (i & 7)) << 31);
        float v;
        memcpy(&v, &b, sizeof v);
        out[i] = accumulate ? out[i] + v : v;
    }
    return 0;
}

/* hvdc_sign_encode of `count` tensors in one call (a bucket): tensor p has ns[p] floats at
 * address xs[p] and its ceil(ns[p] / 8) body bytes go to address outs[p]; nonfinite[p] is
 * hvdc_sign_encode's result. */
void hvdc_sign_encode_segments(int64_t count, const uint64_t *xs, const int64_t *ns,
                               const uint64_t *outs, int32_t *nonfinite) {
    for (int64_t p = 0; p < count; p++)
        nonfinite[p] = hvdc_sign_encode((const float *)(uintptr_t)xs[p], ns[p],
                                        (uint8_t *)(uintptr_t)outs[p]);
}

/* hvdc_sign_decode (accumulating) of `count` bodies in one call: body p is at body +
 * starts[p] (the caller checked it has ceil(ns[p] / 8) bytes), ns[p] values of magnitude
 * scales[p] (1 for signSGD), added into the floats at address outs[p]. Returns -1 - p for
 * the first body p with a padding bit set (bodies before it are added, its output is
 * untouched), else 0. */
int64_t hvdc_sign_decode_segments(int64_t count, const uint8_t *body, const int64_t *starts,
                                  const int64_t *ns, const float *scales, const uint64_t *outs) {
    for (int64_t p = 0; p < count; p++)
        if (hvdc_sign_decode(body + starts[p], ns[p], scales[p], (float *)(uintptr_t)outs[p], 1) < 0)
            return -1 - p;
    return 0;
}

/* hvdc_efsign_sums of `count` tensors in one call (a bucket): tensor p has ns[p] floats at
 * address gs[p], its residual at es[p]; its chunk sums go to sums + sum_starts[p];
 * nonfinite[p] is hvdc_efsign_sums's result. */
void hvdc_efsign_sums_segments(int64_t count, const uint64_t *gs, const uint64_t *es,
                               const int64_t *ns, int64_t chunk, double *sums,
                               const int64_t *sum_starts, int32_t *nonfinite) {
    for (int64_t p = 0; p < count; p++)
        nonfinite[p] = hvdc_efsign_sums((const float *)(uintptr_t)gs[p],
                                        (const float *)(uintptr_t)es[p], ns[p], chunk,
                                        sums + sum_starts[p]);
}

/* hvdc_efsign_encode of `count` tensors in one call: tensor p (ns[p] floats at gs[p],
 * residual at es[p], scale scales[p]) into the ceil(ns[p] / 8) bytes at outs[p]; a tensor
 * with skip[p] set (non-finite: no body, residual untouched) is left alone. */
void hvdc_efsign_encode_segments(int64_t count, const uint64_t *gs, const uint64_t *es,
                                 const int64_t *ns, const float *scales, const int32_t *skip,
                                 const uint64_t *outs) {
    for (int64_t p = 0; p < count; p++)
        if (!skip[p])
            hvdc_efsign_encode((const float *)(uintptr_t)gs[p], (float *)(uintptr_t)es[p],
                               scales[p], ns[p], (uint8_t *)(uintptr_t)outs[p]);
}
