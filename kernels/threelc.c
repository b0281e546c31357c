/* CPU backend of the 3LC codec (docs/codecs.md, "3LC"), loaded through ctypes
 * (hvdcompress/backends/cpu); the CUDA twin is threelc.cu next to this file (the payload
 * checksum is frame.c's).
 *
 * Pure functions over caller-owned buffers; no allocation, no global state.
 * Built with -O3 -ffp-contract=off and without fast-math (C_FLAGS in
 * hvdcompress/_native.py), so that every float operation is the single IEEE-rounded
 * operation docs/design.md names: the CUDA kernels in kernels/threelc.cu (using __fadd_rn /
 * __fdiv_rn / rintf) produce the same bytes.
 *
 * Memory traffic per element of float32 input (n elements):
 *   encode: absmax pass reads g, e (8 B); fused pass reads g, e, writes e and
 *           1/5 B of quartic (12.2 B); zero-run pass reads n/5 B.
 *   decode: zero-run pass n/5 B, then 4 B written per element (8 B with accumulate).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define THREELC_ZERO_GROUP 121 /* quartic byte of five zeros: digits (1,1,1,1,1) */
#define THREELC_MAX_QUARTIC 242
#define THREELC_RUN_BASE 241 /* a byte b >= 243 is a run of b - 241 zero groups */
#define THREELC_MAX_RUN 14

/* Errors returned (negative) by the decoders. */
#define THREELC_ERR_LENGTH -1  /* zero-run decoding does not give exactly the expected bytes */
#define THREELC_ERR_BYTE -2    /* a quartic byte above 242 */
#define THREELC_ERR_PADDING -3 /* a padding digit of the last group is not zero (d != 1) */

/* Blocks of whole groups keep the per-element loop vectorisable and the digit
 * scratch in L1. */
#define THREELC_BLOCK_GROUPS 256
#define THREELC_BLOCK (THREELC_BLOCK_GROUPS * 5)

/* AVX-512 and AVX2 versions of the vectorised loops, picked at load time by the CPU
 * (-ffp-contract=off: no FMA contraction in any clone, so the bytes do not change). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define THREELC_VECTOR __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define THREELC_VECTOR
#endif

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* Max over i of the abs bits of (g[i] + e[i]) (e may be NULL). Non-negative
 * floats order like their bit patterns and NaN patterns sort above Inf, so the
 * result is the bits of max|a|, or >= 0x7f800000 iff a holds a NaN or an Inf. */
THREELC_VECTOR uint32_t hvdc_threelc_absmax_bits(const float *g, const float *e, int64_t n) {
    uint32_t m = 0;
    if (e) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t b = f32_bits(g[i] + e[i]) & 0x7fffffffu;
            m = b > m ? b : m;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            uint32_t b = f32_bits(g[i]) & 0x7fffffffu;
            m = b > m ? b : m;
        }
    }
    return m;
}

/* The quartic byte of five digits d[0..4] in {0, 1, 2}: 81 d0 + 27 d1 + 9 d2 + 3 d3 + d4.
 * Loaded as one little-endian word x = d0 | d1 << 8 | ..., the product x * K with
 * K = 81 << 32 | 27 << 24 | 9 << 16 | 3 << 8 | 1 has exactly that sum in byte 4, and
 * bytes 0..3 stay below 256 (at most 2, 8, 26, 80), so nothing carries into it.
 * Reads 8 bytes: d needs 3 readable bytes of slack after the group. */
static inline uint8_t pack5(const int8_t *d) {
    uint64_t x;
    memcpy(&x, d, sizeof x);
    return (uint8_t)((x * 0x511B090301ull) >> 32);
}

/* rint for |x| <= 2^22 in the default round-to-nearest-even mode, without a libm
 * call so that the loop vectorises. |a / S| <= 1 always holds here because
 * S = fl(s * M) >= M for s >= 1. */
static inline float rint_small(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    return (x + magic) - magic;
}

/* Smallest S whose half is exact (S / 2 >= FLT_MIN, the least normal float). */
#define THREELC_HALF_EXACT_MIN 2.3509887e-38f /* 2^-125 */

/* q = rint(fl(a / S)) without the division (docs/codecs.md,
 * "Quantisation with sparsity multiplication"). |a / S| <= 1, so q is
 * +-1 exactly when |fl(a / S)| > 1/2 (1/2 itself rounds to 0, ties to even). With S in
 * [2^k, 2^(k+1)), fl(a / S) > 1/2 iff a / S > 1/2 + 2^-25 (the midpoint above 1/2), i.e.
 * |a| > S (1/2 + 2^-25); that bound lies strictly between S / 2 and the next float above
 * it (S 2^-25 < ulp(S) / 2 = ulp(S / 2)), so for a float a the test is |a| > S / 2, exact
 * when S / 2 is a normal float. The quantiser compares instead of dividing (the vector
 * division cost about 1 ms of the 9.4 ms pass at 1e7 on an AVX2 machine) and takes the
 * division for the tiny scales
 * below THREELC_HALF_EXACT_MIN. Same q, same residual: S * q is -S, +0.0 or +S. */
static inline void quantize_block(const float *g, const float *e_in, float *e_out, float S,
                                  int64_t len, int8_t *d) {
    if (S == 0.0f) {
        for (int64_t i = 0; i < len; i++) {
            float a = e_in ? g[i] + e_in[i] : g[i];
            if (e_out) e_out[i] = a;
            d[i] = 1;
        }
    } else if (S >= THREELC_HALF_EXACT_MIN) {
        /* in integer lanes (non-negative floats order like their bits): keep = |a| > S / 2,
         * S * q = keep ? S with a's sign : +0.0, d = 1 + q */
        const uint32_t half_bits = f32_bits(S * 0.5f), s_bits = f32_bits(S);
        for (int64_t i = 0; i < len; i++) {
            float a = e_in ? g[i] + e_in[i] : g[i];
            uint32_t bits = f32_bits(a), sign = bits >> 31;
            uint32_t keep = (bits & 0x7fffffffu) > half_bits;
            uint32_t sq_bits = (s_bits | (bits & 0x80000000u)) & (0u - keep);
            float Sq;
            memcpy(&Sq, &sq_bits, sizeof Sq);
            if (e_out) e_out[i] = a - Sq;
            d[i] = (int8_t)(1 + keep - 2 * (keep & sign));
        }
    } else {
        for (int64_t i = 0; i < len; i++) {
            float a = e_in ? g[i] + e_in[i] : g[i];
            float q = rint_small(a / S);
            if (e_out) e_out[i] = a - S * q;
            d[i] = (int8_t)((int)q + 1);
        }
    }
}

/* Quantise, update the residual, and emit quartic bytes / int8 digits.
 *   a = g + e_in (e_in may be NULL), q = rint(a / S) (0 when S == 0),
 *   e_out = a - S * q (e_out may be NULL; may alias e_in),
 *   q_out[i] = q (may be NULL), quartic[j] = 81 d0 + 27 d1 + 9 d2 + 3 d3 + d4, d = q + 1,
 *   for j < ceil(n / 5), padded with d = 1 (may be NULL). */
THREELC_VECTOR void hvdc_threelc_quantize(const float *g, const float *e_in, float *e_out, float S,
                                          int64_t n, int8_t *q_out, uint8_t *quartic) {
    int8_t d[THREELC_BLOCK + 8];
    for (int64_t base = 0; base < n; base += THREELC_BLOCK) {
        int64_t len = n - base < THREELC_BLOCK ? n - base : THREELC_BLOCK;
        quantize_block(g + base, e_in ? e_in + base : NULL, e_out ? e_out + base : NULL, S, len,
                       d);
        if (q_out)
            for (int64_t i = 0; i < len; i++) q_out[base + i] = (int8_t)(d[i] - 1);
        if (quartic) {
            for (int64_t k = len; k < (len + 4) / 5 * 5 + 3; k++) d[k] = 1; /* pad + slack */
            for (int64_t j = 0; j < (len + 4) / 5; j++) quartic[base / 5 + j] = pack5(d + 5 * j);
        }
    }
}

/* S = float32(sparsity) * M with M the float of max_bits: one float32 product. */
float hvdc_threelc_scale(uint32_t max_bits, float sparsity) {
    float m;
    memcpy(&m, &max_bits, sizeof m);
    return sparsity * m;
}

/* Quartic encoding of int8 digits q in {-1, 0, 1} (the public building block). */
void hvdc_threelc_quartic_encode(const int8_t *q, int64_t n, uint8_t *quartic) {
    int64_t full = n / 5;
    for (int64_t j = 0; j < full; j++) {
        const int8_t *p = q + 5 * j;
        quartic[j] = (uint8_t)(81 * (p[0] + 1) + 27 * (p[1] + 1) + 9 * (p[2] + 1) +
                               3 * (p[3] + 1) + (p[4] + 1));
    }
    if (n % 5) {
        int d[5] = {1, 1, 1, 1, 1};
        for (int64_t k = 0; k < n % 5; k++) d[k] = q[5 * full + k] + 1;
        quartic[full] = (uint8_t)(81 * d[0] + 27 * d[1] + 9 * d[2] + 3 * d[3] + d[4]);
    }
}

/* Streaming zero-run encoder. Branch-free per byte (short runs of zero groups are
 * common and a branch on each byte mispredicts often): each step writes
 * speculatively at out[o] and out[o + 1] and advances o only by what it commits,
 * so out needs 2 bytes of slack past the input length. The word copy below stays
 * inside the input length: the output never outgrows the input consumed. */
typedef struct {
    uint8_t *out;
    int64_t o;   /* bytes committed */
    int64_t run; /* pending zero groups, 0..13 */
} zre_state;

/* Bit 7 of each byte of the result is set iff that byte of x is the zero group 121. */
static inline uint64_t zero_group_mask(uint64_t x) {
    const uint64_t lo7 = 0x7f7f7f7f7f7f7f7full;
    uint64_t t = x ^ 0x7979797979797979ull; /* 121 -> 0 */
    return ~(((t & lo7) + lo7) | t) & ~lo7;
}

static inline void zre_step(uint8_t *out, int64_t *o_io, int64_t *run_io, uint8_t b) {
    int64_t o = *o_io, run = *run_io;
    int64_t zero = b == THREELC_ZERO_GROUP;
#if defined(__GNUC__)
    /* Hide zero's value from the optimiser: otherwise GCC turns the selects below into
     * branches on it, which mispredict on gradient data. */
    __asm__("" : "+r"(zero));
#endif
    /* a literal ends a pending run: emit its code (121 for a run of one) */
    out[o] = (uint8_t)(run >= 2 ? THREELC_RUN_BASE + run : THREELC_ZERO_GROUP);
    o += (1 - zero) & (run > 0);
    out[o] = b;
    o += 1 - zero;
    run = (run + 1) & -zero;
    /* a run of 14 is complete: emit 255 */
    int64_t full = run == THREELC_MAX_RUN;
    out[o] = THREELC_RUN_BASE + THREELC_MAX_RUN;
    o += full;
    run -= THREELC_MAX_RUN & -full;
    *o_io = o;
    *run_io = run;
}

/* Eight bytes at a time: a word without zero groups is copied, a word of eight zero
 * groups extends the run; mixed words go byte by byte. The portable path (and the
 * reference of the word-table path below). */
static inline void zre_push_bytes(zre_state *st, const uint8_t *in, int64_t m) {
    uint8_t *out = st->out;
    int64_t o = st->o, run = st->run, i = 0;
    for (; i + 8 <= m; i += 8) {
        uint64_t x;
        memcpy(&x, in + i, sizeof x);
        uint64_t z = zero_group_mask(x);
        if (z == 0) {
            if (run > 0) {
                out[o++] = (uint8_t)(run >= 2 ? THREELC_RUN_BASE + run : THREELC_ZERO_GROUP);
                run = 0;
            }
            memcpy(out + o, &x, sizeof x);
            o += 8;
        } else if (z == 0x8080808080808080ull) {
            run += 8;
            if (run >= THREELC_MAX_RUN) {
                out[o++] = THREELC_RUN_BASE + THREELC_MAX_RUN;
                run -= THREELC_MAX_RUN;
            }
        } else {
            for (int k = 0; k < 8; k++) zre_step(out, &o, &run, in[i + k]);
        }
    }
    for (; i < m; i++) zre_step(out, &o, &run, in[i]);
    st->o = o;
    st->run = run;
}

/* The word-table path (x86-64 with SSSE3, picked at load time): a mixed word (zero groups
 * and literals, the common case at s = 1) is encoded by one byte shuffle instead of eight
 * dependent steps. For each 8-bit zero-group mask m of a word (bit k: byte k is 121) that
 * has a literal, zre_rows[m] encodes the word from its first literal to its last: a
 * pshufb control picking the literals (0x80: a code byte goes there) and the codes of the
 * inner runs (at most 6 zero groups, so a single code each) to OR in. The zero groups before
 * the first literal extend the pending run, which is emitted (255 once it reaches 14, then
 * its code) before it; those after the last literal start the next pending run. Same bytes
 * as zre_push_bytes (tests/codecs/test_threelc.py compares the two on random streams). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define THREELC_X86_PATHS 1
#define THREELC_ZRE_CHUNK 256 /* input bytes encoded into the stack stage per step */

typedef struct {
    uint8_t shuffle[16];
    uint8_t codes[16];
} zre_word_row;
static zre_word_row zre_rows[256];
static uint8_t zre_row_len[256];
static int zre_use_words;

/* The code of a pending run of r < 14 zero groups (r = 0: never committed). */
static const uint8_t zre_run_code[14] = {0,   THREELC_ZERO_GROUP, 243, 244, 245, 246, 247,
                                         248, 249,                250, 251, 252, 253, 254};

__attribute__((constructor)) static void threelc_init_x86_paths(void) {
    for (int m = 0; m < 255; m++) { /* m = 255: no literal */
        zre_word_row *row = &zre_rows[m];
        int first = 0, last = 7, o = 0, run = 0;
        while (m >> first & 1) first++;
        while (m >> last & 1) last--;
        memset(row->shuffle, 0x80, sizeof row->shuffle);
        memset(row->codes, 0, sizeof row->codes);
        for (int k = first; k <= last; k++) {
            if (m >> k & 1) {
                run++;
                continue;
            }
            if (run) row->codes[o++] = zre_run_code[run];
            run = 0;
            row->shuffle[o++] = (uint8_t)k;
        }
        zre_row_len[m] = (uint8_t)o;
    }
    __builtin_cpu_init();
    zre_use_words = __builtin_cpu_supports("ssse3");
}

/* Emits the pending run of r <= 21 zero groups that a literal ends: 255 if r >= 14, then
 * the code of the rest (branch-free: speculative writes, commits by count). */
static inline int64_t zre_emit_run(uint8_t *out, int64_t o, int64_t r) {
    int64_t big = r >= THREELC_MAX_RUN;
    out[o] = THREELC_RUN_BASE + THREELC_MAX_RUN;
    o += big;
    r -= THREELC_MAX_RUN & -big;
    out[o] = zre_run_code[r];
    return o + (r > 0);
}

__attribute__((target("ssse3"))) static void zre_push_words(zre_state *st, const uint8_t *in,
                                                            int64_t m) {
    /* a chunk's output: at most its input plus one pending code, plus the 16-byte store */
    uint8_t stage[THREELC_ZRE_CHUNK + 32];
    for (int64_t c = 0; c < m; c += THREELC_ZRE_CHUNK) {
        const int64_t len = m - c < THREELC_ZRE_CHUNK ? m - c : THREELC_ZRE_CHUNK;
        const uint8_t *p = in + c;
        int64_t o = 0, run = st->run, i = 0;
        for (; i + 8 <= len; i += 8) {
            uint64_t x;
            memcpy(&x, p + i, sizeof x);
            /* bit k of mask: byte k is a zero group (bit 7 of each byte gathered to the top) */
            const unsigned mask =
                (unsigned)(((zero_group_mask(x) >> 7) * 0x0102040810204080ull) >> 56);
            if (mask == 0) { /* eight literals */
                o = zre_emit_run(stage, o, run);
                memcpy(stage + o, &x, sizeof x);
                o += 8;
                run = 0;
            } else if (mask == 0xffu) { /* eight zero groups */
                run += 8;
                const int64_t big = run >= THREELC_MAX_RUN;
                stage[o] = THREELC_RUN_BASE + THREELC_MAX_RUN;
                o += big;
                run -= THREELC_MAX_RUN & -big;
            } else {
                o = zre_emit_run(stage, o, run + __builtin_ctz(~mask));
                const zre_word_row *row = &zre_rows[mask];
                const __m128i word = _mm_cvtsi64_si128((long long)x);
                const __m128i enc = _mm_or_si128(
                    _mm_shuffle_epi8(word, _mm_loadu_si128((const __m128i *)row->shuffle)),
                    _mm_loadu_si128((const __m128i *)row->codes));
                _mm_storeu_si128((__m128i *)(stage + o), enc);
                o += zre_row_len[mask];
                run = __builtin_clz(~mask << 24); /* zero groups after the last literal */
            }
        }
        for (; i < len; i++) zre_step(stage, &o, &run, p[i]);
        memcpy(st->out + st->o, stage, (size_t)o);
        st->o += o;
        st->run = run;
    }
}
#endif

static inline void zre_push(zre_state *st, const uint8_t *in, int64_t m) {
#ifdef THREELC_X86_PATHS
    if (zre_use_words) {
        zre_push_words(st, in, m);
        return;
    }
#endif
    zre_push_bytes(st, in, m);
}

static inline int64_t zre_finish(zre_state *st) {
    if (st->run > 0)
        st->out[st->o++] =
            (uint8_t)(st->run >= 2 ? THREELC_RUN_BASE + st->run : THREELC_ZERO_GROUP);
    st->run = 0;
    return st->o;
}

/* Zero-run encoding; out must hold m + 2 bytes (the output is never longer than the
 * input; the 2 bytes are the streaming encoder's slack). Returns the output length. */
int64_t hvdc_threelc_zre_encode(const uint8_t *in, int64_t m, uint8_t *out) {
    zre_state st = {out, 0, 0};
    zre_push(&st, in, m);
    return zre_finish(&st);
}

/* hvdc_threelc_zre_encode through the portable byte-at-a-time path (the tests compare it with
 * the word-table path that hvdc_threelc_zre_encode takes on x86-64). */
int64_t hvdc_threelc_zre_encode_portable(const uint8_t *in, int64_t m, uint8_t *out) {
    zre_state st = {out, 0, 0};
    zre_push_bytes(&st, in, m);
    return zre_finish(&st);
}

/* The compressor's fused path: quantise with error feedback and zero-run encode,
 * one block of THREELC_BLOCK_GROUPS quartic bytes at a time so that the quartic bytes
 * never leave L1. out must hold ceil(n / 5) + 2 bytes. Returns the body length.
 * The caller has checked that S is finite (non-finite input never gets here). */
int64_t hvdc_threelc_encode(const float *g, float *e, float S, int64_t n, uint8_t *out) {
    uint8_t quartic[THREELC_BLOCK_GROUPS];
    zre_state st = {out, 0, 0};
    for (int64_t base = 0; base < n; base += THREELC_BLOCK) {
        int64_t len = n - base < THREELC_BLOCK ? n - base : THREELC_BLOCK;
        hvdc_threelc_quantize(g + base, e ? e + base : NULL, e ? e + base : NULL, S, len, NULL,
                              quartic);
        zre_push(&st, quartic, (len + 4) / 5);
    }
    return zre_finish(&st);
}

/* Length that zero-run decoding of in[0..len) produces (no writes): the sum over the bytes
 * of max(b, 242) - 241 (a literal stands for 1 group, a run byte for b - 241). On x86-64
 * sixteen bytes a step: an unsigned byte max, then a sum of absolute differences against
 * zero adds each eight into a 64-bit lane (SSE2; a scalar loop with a compare ran at
 * 0.4 ns a byte, 0.65 ms of a 1e7-value 3LC decode). */
int64_t hvdc_threelc_zre_decoded_len(const uint8_t *in, int64_t len) {
    int64_t total = 0, i = 0;
#ifdef THREELC_X86_PATHS
    const __m128i floor = _mm_set1_epi8((char)THREELC_MAX_QUARTIC), zero = _mm_setzero_si128();
    __m128i sums = zero;
    for (; i + 16 <= len; i += 16) {
        const __m128i b = _mm_max_epu8(_mm_loadu_si128((const __m128i *)(const void *)(in + i)),
                                       floor);
        sums = _mm_add_epi64(sums, _mm_sad_epu8(b, zero));
    }
    total = _mm_cvtsi128_si64(sums) + _mm_cvtsi128_si64(_mm_unpackhi_epi64(sums, sums)) -
            i * THREELC_RUN_BASE;
#endif
    for (; i < len; i++) total += in[i] > THREELC_MAX_QUARTIC ? in[i] - THREELC_RUN_BASE : 1;
    return total;
}

/* Zero-run decoding into exactly m bytes. Returns m, or THREELC_ERR_LENGTH (and
 * writes nothing past out[m - 1]) when the input does not expand to m bytes. */
int64_t hvdc_threelc_zre_decode(const uint8_t *in, int64_t len, uint8_t *out, int64_t m) {
    int64_t o = 0;
    for (int64_t i = 0; i < len; i++) {
        uint8_t b = in[i];
        if (b > THREELC_MAX_QUARTIC) {
            int64_t r = b - THREELC_RUN_BASE;
            if (o + r > m) return THREELC_ERR_LENGTH;
            memset(out + o, THREELC_ZERO_GROUP, (size_t)r);
            o += r;
        } else {
            if (o >= m) return THREELC_ERR_LENGTH;
            out[o++] = b;
        }
    }
    return o == m ? m : THREELC_ERR_LENGTH;
}

/* Checks that quartic[0..ceil(n/5)) are valid: every byte <= 242 and the padding
 * digits of the last group equal 1. Returns 0 or a negative error. */
static int64_t check_quartic(const uint8_t *quartic, int64_t n) {
    int64_t m = (n + 4) / 5;
    uint8_t worst = 0;
    for (int64_t j = 0; j < m; j++) worst = quartic[j] > worst ? quartic[j] : worst;
    if (worst > THREELC_MAX_QUARTIC) return THREELC_ERR_BYTE;
    if (n % 5) {
        int b = quartic[m - 1];
        static const int pow3[5] = {81, 27, 9, 3, 1};
        for (int k = 4; k >= (int)(n % 5); k--)
            if ((b / pow3[k]) % 3 != 1) return THREELC_ERR_PADDING;
    }
    return 0;
}

/* The five decoded values S * q of each of the 243 quartic bytes: decoding a byte is
 * then one 20-byte copy (or five adds). */
static void scaled_groups(float S, float table[243][5]) {
    const float level[3] = {S * -1.0f, S * 0.0f, S * 1.0f};
    for (int b = 0; b < 243; b++) {
        table[b][0] = level[b / 81];
        table[b][1] = level[b / 27 % 3];
        table[b][2] = level[b / 9 % 3];
        table[b][3] = level[b / 3 % 3];
        table[b][4] = level[b % 3];
    }
}

/* int8 digits of n elements from quartic bytes (public building block). */
int64_t hvdc_threelc_quartic_decode(const uint8_t *quartic, int64_t n, int8_t *q) {
    int64_t err = check_quartic(quartic, n);
    if (err) return err;
    int64_t full = n / 5;
    for (int64_t j = 0; j < full; j++) {
        int b = quartic[j];
        int8_t *p = q + 5 * j;
        p[0] = (int8_t)(b / 81 - 1);
        p[1] = (int8_t)(b / 27 % 3 - 1);
        p[2] = (int8_t)(b / 9 % 3 - 1);
        p[3] = (int8_t)(b / 3 % 3 - 1);
        p[4] = (int8_t)(b % 3 - 1);
    }
    for (int64_t k = 0; k < n % 5; k++) {
        static const int pow3[5] = {81, 27, 9, 3, 1};
        q[5 * full + k] = (int8_t)(quartic[full] / pow3[k] % 3 - 1);
    }
    return 0;
}

/* out[i] = S * q[i] (or out[i] += S * q[i] with accumulate) from quartic bytes.
 * A table of the 243 possible groups, already scaled, turns each byte into one
 * 20-byte copy (or five adds). Returns 0 or a negative error, with out untouched
 * on error. */
int64_t hvdc_threelc_dequantize(const uint8_t *quartic, int64_t n, float S, float *out,
                                int accumulate) {
    int64_t err = check_quartic(quartic, n);
    if (err) return err;
    float table[243][5];
    scaled_groups(S, table);
    int64_t full = n / 5;
    if (accumulate) {
        for (int64_t j = 0; j < full; j++) {
            const float *t = table[quartic[j]];
            float *o = out + 5 * j;
            o[0] += t[0];
            o[1] += t[1];
            o[2] += t[2];
            o[3] += t[3];
            o[4] += t[4];
        }
        for (int64_t k = 0; k < n % 5; k++) out[5 * full + k] += table[quartic[full]][k];
    } else {
        for (int64_t j = 0; j < full; j++) memcpy(out + 5 * j, table[quartic[j]], 5 * sizeof(float));
        for (int64_t k = 0; k < n % 5; k++) out[5 * full + k] = table[quartic[full]][k];
    }
    return 0;
}

/* The accumulating decode of a checked body (its zero-run expansion is exactly
 * ceil(n / 5) groups), straight into out: each body byte adds its 20-byte row of `rows` to
 * the five floats of its first group and advances by the groups it stands for (1, or r for
 * a run). A run shorter than 14 (codes 243..254) has the row five -0.0, and x + -0.0 == x
 * for every float x (+0.0 and -0.0 included), so it leaves the output as it is (section
 * 2.4) without a branch: short runs and literals interleave at random in gradient data,
 * and a branch on each byte mispredicted about every third byte. A full run (255, common
 * only in sparse payloads, where it comes in long streaks) is skipped by a branch without
 * touching out. Only the last group, when n is not a multiple of 5, is added element by
 * element (its row reaches past out[n - 1]). */
static void threelc_decode_add(const uint8_t *body, int64_t len, int64_t n,
                               const float rows[256][5], const uint8_t advance[256], float *out) {
    const int64_t whole = n / 5; /* groups with five elements inside out */
    int64_t j = 0, i = 0;
    for (; i < len && j < whole; i++) {
        const uint8_t b = body[i]; /* read once: out's stores may alias it for the compiler */
        if (b == THREELC_RUN_BASE + THREELC_MAX_RUN) {
            j += THREELC_MAX_RUN;
            continue;
        }
        const float *t = rows[b];
        float *o = out + 5 * j;
        o[0] = o[0] + t[0];
        o[1] = o[1] + t[1];
        o[2] = o[2] + t[2];
        o[3] = o[3] + t[3];
        o[4] = o[4] + t[4];
        j += advance[b];
    }
    if (i < len && body[i] <= THREELC_MAX_QUARTIC) /* the partial last group, a literal */
        for (int64_t k = 0; k < n - 5 * j; k++) out[5 * j + k] += rows[body[i]][k];
}

/* Fused zero-run decode + dequantize without materialising the quartic bytes:
 * a run byte writes 5 * r zeros directly (accumulating: leaves them as they are, see
 * threelc_decode_add). Validates as
 * hvdc_threelc_zre_decode + hvdc_threelc_dequantize do, before writing anything. */
int64_t hvdc_threelc_decode(const uint8_t *body, int64_t len, int64_t n, float S, float *out,
                            int accumulate) {
    int64_t m = (n + 4) / 5;
    if (hvdc_threelc_zre_decoded_len(body, len) != m) return THREELC_ERR_LENGTH;
    /* The last quartic byte is either the last literal body byte or a zero group
     * (valid padding): check the padding before any write. */
    if (n % 5 && len > 0 && body[len - 1] <= THREELC_MAX_QUARTIC) {
        int b = body[len - 1];
        static const int pow3[5] = {81, 27, 9, 3, 1};
        for (int k = 4; k >= (int)(n % 5); k--)
            if ((b / pow3[k]) % 3 != 1) return THREELC_ERR_PADDING;
    }
    if (accumulate) {
        float rows[256][5];
        uint8_t advance[256];
        scaled_groups(S, rows);
        for (int b = 0; b < 256; b++) {
            advance[b] = (uint8_t)(b > THREELC_MAX_QUARTIC ? b - THREELC_RUN_BASE : 1);
            if (b > THREELC_MAX_QUARTIC) /* a run: adds -0.0, the identity */
                for (int k = 0; k < 5; k++) rows[b][k] = -0.0f;
        }
        threelc_decode_add(body, len, n, rows, advance, out);
        return 0;
    }
    float table[243][5];
    scaled_groups(S, table);
    int64_t j = 0; /* quartic group index */
    for (int64_t i = 0; i < len; i++) {
        uint8_t b = body[i];
        if (b > THREELC_MAX_QUARTIC) { /* a run of r zero groups: +0.0f is S * 0 */
            int64_t r = b - THREELC_RUN_BASE;
            if (!accumulate) {
                int64_t hi = 5 * (j + r) < n ? 5 * (j + r) : n;
                memset(out + 5 * j, 0, (size_t)(hi - 5 * j) * sizeof(float));
            }
            j += r;
            continue;
        }
        const float *t = table[b];
        float *o = out + 5 * j;
        int64_t cnt = 5 * j + 5 <= n ? 5 : n - 5 * j;
        if (accumulate)
            for (int64_t k = 0; k < cnt; k++) o[k] += t[k];
        else if (cnt == 5)
            memcpy(o, t, 5 * sizeof(float));
        else
            for (int64_t k = 0; k < cnt; k++) o[k] = t[k];
        j++;
    }
    return 0;
}

/* hvdc_threelc_absmax_bits, hvdc_threelc_scale and hvdc_threelc_encode of `count` tensors in
 * one call (a bucket). Tensor p: ns[p] floats at address gs[p], its residual at es[p] (0: none),
 * sparsity sparsities[p]; its body goes to out + out_starts[p] (room for ceil(ns[p] / 5)
 * + 2 bytes). Reported per tensor: scales[p] (S) and lens[p] (the body length), or
 * lens[p] = -1 when the input or S is not finite (residual untouched, nothing written). */
void hvdc_threelc_encode_segments(int64_t count, const uint64_t *gs, const uint64_t *es,
                                  const int64_t *ns, const float *sparsities, uint8_t *out,
                                  const int64_t *out_starts, float *scales, int64_t *lens) {
    for (int64_t p = 0; p < count; p++) {
        const float *g = (const float *)(uintptr_t)gs[p];
        float *e = (float *)(uintptr_t)es[p];
        uint32_t bits = hvdc_threelc_absmax_bits(g, e, ns[p]);
        float S = bits >= 0x7f800000u ? INFINITY : hvdc_threelc_scale(bits, sparsities[p]);
        if (!isfinite(S)) {
            scales[p] = 0.0f;
            lens[p] = -1;
            continue;
        }
        scales[p] = S;
        lens[p] = hvdc_threelc_encode(g, e, S, ns[p], out + out_starts[p]);
    }
}

/* hvdc_threelc_decode (accumulating) of `count` bodies in one call: body p is lens[p] bytes at
 * body + starts[p], ns[p] values with scale scales[p], added into the floats at address
 * outs[p]. Returns -1 - p for the first body p that does not decode (bodies before it are
 * added, its output is untouched) with its error code in *code, else 0. */
int64_t hvdc_threelc_decode_segments(int64_t count, const uint8_t *body, const int64_t *starts,
                                     const int64_t *lens, const int64_t *ns, const float *scales,
                                     const uint64_t *outs, int64_t *code) {
    for (int64_t p = 0; p < count; p++) {
        int64_t rc = hvdc_threelc_decode(body + starts[p], lens[p], ns[p], scales[p],
                                         (float *)(uintptr_t)outs[p], 1);
        if (rc < 0) {
            *code = rc;
            return -1 - p;
        }
    }
    return 0;
}
