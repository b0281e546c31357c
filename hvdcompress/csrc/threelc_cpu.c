/* CPU backend of the 3LC codec (shared/SPEC.md section 2), loaded through ctypes.
 *
 * Pure functions over caller-owned buffers; no allocation, no global state.
 * Built with -O3 -ffp-contract=off and without fast-math, so that every float
 * operation is the single IEEE-rounded operation the SPEC names: the CUDA kernels
 * in kernels/threelc.cu (using __fadd_rn / __fdiv_rn / rintf) produce the same bytes.
 *
 * Memory traffic per element of float32 input (n elements):
 *   encode: absmax pass reads g, e (8 B); fused pass reads g, e, writes e and
 *           1/5 B of quartic (12.2 B); zero-run pass reads n/5 B.
 *   decode: zero-run pass n/5 B, then 4 B written per element (8 B with accumulate).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TLC_ZERO_GROUP 121 /* quartic byte of five zeros: digits (1,1,1,1,1) */
#define TLC_MAX_QUARTIC 242
#define TLC_RUN_BASE 241 /* a byte b >= 243 is a run of b - 241 zero groups */
#define TLC_MAX_RUN 14

/* Errors returned (negative) by the decoders. */
#define TLC_ERR_LENGTH -1  /* zero-run decoding does not give exactly the expected bytes */
#define TLC_ERR_BYTE -2    /* a quartic byte above 242 */
#define TLC_ERR_PADDING -3 /* a padding digit of the last group is not zero (d != 1) */

/* Blocks of whole groups keep the per-element loop vectorisable and the digit
 * scratch in L1. */
#define TLC_BLOCK_GROUPS 256
#define TLC_BLOCK (TLC_BLOCK_GROUPS * 5)

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* Max over i of the abs bits of (g[i] + e[i]) (e may be NULL). Non-negative
 * floats order like their bit patterns and NaN patterns sort above Inf, so the
 * result is the bits of max|a|, or >= 0x7f800000 iff a holds a NaN or an Inf. */
uint32_t hvdc_tlc_absmax_bits(const float *g, const float *e, int64_t n) {
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

/* rint for |x| <= 2^22 in the default round-to-nearest-even mode, without a libm
 * call so that the loop vectorises. |a / S| <= 1 always holds here because
 * S = fl(s * M) >= M for s >= 1. */
static inline float rint_small(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    return (x + magic) - magic;
}

/* Quantise, update the residual, and emit quartic bytes / int8 digits.
 *   a = g + e_in (e_in may be NULL), q = rint(a / S) (0 when S == 0),
 *   e_out = a - S * q (e_out may be NULL; may alias e_in),
 *   q_out[i] = q (may be NULL), quartic[j] = 81 d0 + 27 d1 + 9 d2 + 3 d3 + d4, d = q + 1,
 *   for j < ceil(n / 5), padded with d = 1 (may be NULL). */
void hvdc_tlc_quantize(const float *g, const float *e_in, float *e_out, float S, int64_t n,
                       int8_t *q_out, uint8_t *quartic) {
    int8_t d[TLC_BLOCK];
    for (int64_t base = 0; base < n; base += TLC_BLOCK) {
        int64_t len = n - base < TLC_BLOCK ? n - base : TLC_BLOCK;
        const float *gb = g + base;
        if (S == 0.0f) {
            for (int64_t i = 0; i < len; i++) {
                float a = e_in ? gb[i] + e_in[base + i] : gb[i];
                if (e_out) e_out[base + i] = a;
                d[i] = 1;
            }
        } else {
            for (int64_t i = 0; i < len; i++) {
                float a = e_in ? gb[i] + e_in[base + i] : gb[i];
                float q = rint_small(a / S);
                if (e_out) e_out[base + i] = a - S * q;
                d[i] = (int8_t)((int)q + 1);
            }
        }
        if (q_out)
            for (int64_t i = 0; i < len; i++) q_out[base + i] = (int8_t)(d[i] - 1);
        if (quartic) {
            int64_t full = len / 5;
            uint8_t *out = quartic + base / 5;
            for (int64_t j = 0; j < full; j++) {
                const int8_t *p = d + 5 * j;
                out[j] = (uint8_t)(81 * p[0] + 27 * p[1] + 9 * p[2] + 3 * p[3] + p[4]);
            }
            if (len % 5) {
                int8_t p[5] = {1, 1, 1, 1, 1};
                for (int64_t k = 0; k < len % 5; k++) p[k] = d[5 * full + k];
                out[full] = (uint8_t)(81 * p[0] + 27 * p[1] + 9 * p[2] + 3 * p[3] + p[4]);
            }
        }
    }
}

/* Quartic encoding of int8 digits q in {-1, 0, 1} (the public building block). */
void hvdc_tlc_quartic_encode(const int8_t *q, int64_t n, uint8_t *quartic) {
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

/* Zero-run encoding; out must hold m bytes (the output is never longer than the
 * input). Returns the output length. */
int64_t hvdc_tlc_zre_encode(const uint8_t *in, int64_t m, uint8_t *out) {
    int64_t o = 0, i = 0;
    while (i < m) {
        if (in[i] != TLC_ZERO_GROUP) {
            out[o++] = in[i++];
            continue;
        }
        int64_t r = 1;
        while (i + r < m && in[i + r] == TLC_ZERO_GROUP) r++;
        i += r;
        for (int64_t k = r / TLC_MAX_RUN; k > 0; k--) out[o++] = TLC_RUN_BASE + TLC_MAX_RUN;
        int64_t rem = r % TLC_MAX_RUN;
        if (rem >= 2)
            out[o++] = (uint8_t)(TLC_RUN_BASE + rem);
        else if (rem == 1)
            out[o++] = TLC_ZERO_GROUP;
    }
    return o;
}

/* Length that zero-run decoding of in[0..len) produces (no writes). */
int64_t hvdc_tlc_zre_decoded_len(const uint8_t *in, int64_t len) {
    int64_t total = 0;
    for (int64_t i = 0; i < len; i++) total += in[i] > TLC_MAX_QUARTIC ? in[i] - TLC_RUN_BASE : 1;
    return total;
}

/* Zero-run decoding into exactly m bytes. Returns m, or TLC_ERR_LENGTH (and
 * writes nothing past out[m - 1]) when the input does not expand to m bytes. */
int64_t hvdc_tlc_zre_decode(const uint8_t *in, int64_t len, uint8_t *out, int64_t m) {
    int64_t o = 0;
    for (int64_t i = 0; i < len; i++) {
        uint8_t b = in[i];
        if (b > TLC_MAX_QUARTIC) {
            int64_t r = b - TLC_RUN_BASE;
            if (o + r > m) return TLC_ERR_LENGTH;
            memset(out + o, TLC_ZERO_GROUP, (size_t)r);
            o += r;
        } else {
            if (o >= m) return TLC_ERR_LENGTH;
            out[o++] = b;
        }
    }
    return o == m ? m : TLC_ERR_LENGTH;
}

/* Checks that quartic[0..ceil(n/5)) are valid: every byte <= 242 and the padding
 * digits of the last group equal 1. Returns 0 or a negative error. */
static int64_t check_quartic(const uint8_t *quartic, int64_t n) {
    int64_t m = (n + 4) / 5;
    uint8_t worst = 0;
    for (int64_t j = 0; j < m; j++) worst = quartic[j] > worst ? quartic[j] : worst;
    if (worst > TLC_MAX_QUARTIC) return TLC_ERR_BYTE;
    if (n % 5) {
        int b = quartic[m - 1];
        static const int pow3[5] = {81, 27, 9, 3, 1};
        for (int k = 4; k >= (int)(n % 5); k--)
            if ((b / pow3[k]) % 3 != 1) return TLC_ERR_PADDING;
    }
    return 0;
}

/* int8 digits of n elements from quartic bytes (public building block). */
int64_t hvdc_tlc_quartic_decode(const uint8_t *quartic, int64_t n, int8_t *q) {
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
int64_t hvdc_tlc_dequantize(const uint8_t *quartic, int64_t n, float S, float *out,
                            int accumulate) {
    int64_t err = check_quartic(quartic, n);
    if (err) return err;
    float table[243][5];
    const float level[3] = {S * -1.0f, S * 0.0f, S * 1.0f};
    for (int b = 0; b < 243; b++) {
        table[b][0] = level[b / 81];
        table[b][1] = level[b / 27 % 3];
        table[b][2] = level[b / 9 % 3];
        table[b][3] = level[b / 3 % 3];
        table[b][4] = level[b % 3];
    }
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

/* Fused zero-run decode + dequantize without materialising the quartic bytes:
 * a run byte writes (or, accumulating, skips) 5 * r zeros directly. Validates as
 * hvdc_tlc_zre_decode + hvdc_tlc_dequantize do, before writing anything. */
int64_t hvdc_tlc_decode(const uint8_t *body, int64_t len, int64_t n, float S, float *out,
                        int accumulate) {
    int64_t m = (n + 4) / 5;
    if (hvdc_tlc_zre_decoded_len(body, len) != m) return TLC_ERR_LENGTH;
    /* The last quartic byte is either the last literal body byte or a zero group
     * (valid padding): check the padding before any write. */
    if (n % 5 && len > 0 && body[len - 1] <= TLC_MAX_QUARTIC) {
        int b = body[len - 1];
        static const int pow3[5] = {81, 27, 9, 3, 1};
        for (int k = 4; k >= (int)(n % 5); k--)
            if ((b / pow3[k]) % 3 != 1) return TLC_ERR_PADDING;
    }
    float table[243][5];
    const float level[3] = {S * -1.0f, S * 0.0f, S * 1.0f};
    for (int b = 0; b < 243; b++) {
        table[b][0] = level[b / 81];
        table[b][1] = level[b / 27 % 3];
        table[b][2] = level[b / 9 % 3];
        table[b][3] = level[b / 3 % 3];
        table[b][4] = level[b % 3];
    }
    int64_t j = 0; /* quartic group index */
    for (int64_t i = 0; i < len; i++) {
        uint8_t b = body[i];
        if (b > TLC_MAX_QUARTIC) { /* a run of r zero groups: +0.0f is S * 0 */
            int64_t r = b - TLC_RUN_BASE;
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

/* Payload checksum of buf[0..len) placed at payload position offset (see wire.py):
 * sum of (b + 1) * mix(offset + j) modulo 2^32. */
uint32_t hvdc_checksum(const uint8_t *buf, int64_t len, int64_t offset) {
    uint32_t sum = 0;
    for (int64_t j = 0; j < len; j++) {
        uint64_t idx = (uint64_t)(offset + j);
        uint32_t w = (uint32_t)((idx * 0x9E3779B97F4A7C15ull) >> 32) | 1u;
        sum += (uint32_t)(buf[j] + 1) * w;
    }
    return sum;
}
