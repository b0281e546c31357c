// 3LC kernels: max|g + e|, fused quantize + quartic encode, zero-run encoding (ZRE) as
// flag / scan / scatter, ZRE decode as lengths / scan / expand, quartic decode (scaled,
// optionally accumulated) and the bucket forms of these (section 7); the payload checksum
// and the frame scan are kernels/frame.cu. Byte layout and rounding follow docs/codecs.md, "3LC"
// exactly; every backend must produce the same bytes (the C twin of this file,
// for the CPU backend, is kernels/threelc.c).
//
// Compiled three ways from this one file, unchanged:
//   * at run time by NVRTC through cupy.RawModule (hvdcompress/backends/cuda/), with
//     NVRTC_OPTIONS of hvdcompress/_native.py (--fmad=false --ftz=false --prec-div=true);
//   * by nvcc for sm_80 / sm_90 in scripts/check_kernels.sh (compile and resource check);
//   * by g++ for the host through kernels/cuda_host.h (tests/host_kernels), which runs
//     the threads of a launch one after another.
// Hence: plain C-like code, no #include under CUDA (NVRTC has no system headers), no
// __syncthreads / shared memory, no code that needs two threads to run at the same time.
// Warp reductions are wrapped in hvd_warp_* helpers whose host versions reduce nothing
// (each thread then does its own atomic, which gives the same result).
//
// Every index is 64-bit: blockIdx.x * blockDim.x and the grid stride are formed in
// long long, and element index = 5 * group index is formed in long long, because tensors
// may hold more than 2^31 elements (tests/host_kernels/index64.cpp checks this).
// Every kernel is a grid-stride loop, so any grid size is correct; the backend launches
// 256 threads per block (a multiple of 32 is required by the warp helpers) and at most
// 8 blocks per SM.
//
// Floating point: only __fadd_rn / __fsub_rn / __fmul_rn / __fdiv_rn / rintf, which are
// never contracted into FMAs and are IEEE round-to-nearest-even, matching the C and
// NumPy references on the CPU (built with -ffp-contract=off, no fast-math).
//
// `state` is a small zeroed uint32 scratch array shared by the kernels of one call:
#define HVD_ST_ABSMAX 0     // uint32: max over i of (bits(a_i) & 0x7fffffff), atomicMax
#define HVD_ST_SCALE 1      // uint32: bits of S = float32(sparsity) * M
#define HVD_ST_NONFINITE 2  // uint32: 1 when M is NaN/Inf or S overflowed
#define HVD_ST_ERROR 3      // uint32: HVD_ERR_* bits, atomicOr
#define HVD_ST_COUNT 4      // int64 at words 4-5: ZRE output length / expanded length
#define HVD_ST_LAST 6       // uint32: decode check: last body byte (diagnostics)
#define HVD_ST_SUM 7        // uint32: checksum accumulator, atomicAdd (mod 2^32; frame.cu)
#define HVD_STATE_WORDS 8

#define HVD_ERR_LENGTH 1u    // ZRE expansion does not give exactly ceil(n / 5) bytes
#define HVD_ERR_BYTE 2u      // a quartic byte > 242
#define HVD_ERR_PADDING 4u   // a padding digit of the last quartic byte is not 1 (q != 0)
#define HVD_ERR_OVERFLOW 8u  // a write past the output's end was refused
#define HVD_ERR_INPUT 16u    // encoder input out of range (q not in {-1,0,1}, byte > 242)

#define HVD_ZERO_GROUP 121   // quartic byte of five zeros (all digits 1)
#define HVD_MAX_QUARTIC 242  // largest quartic byte (all digits 2)
#define HVD_RUN_BASE 241     // byte 241 + r stands for a run of r zero groups, 2 <= r <= 14
#define HVD_MAX_RUN 14
#define HVD_RUN_GROUP 243    // internal to decoding: a zero group that came from a run code

#ifndef __CUDACC__
#include "cuda_host.h"
#endif

// ---------------------------------------------------------------------------------------
// Helpers

__device__ __forceinline__ long long hvd_first_index()
{
    return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

__device__ __forceinline__ long long hvd_grid_stride()
{
    return (long long)gridDim.x * (long long)blockDim.x;
}

// Warp-aggregated atomics. Must be reached by all 32 lanes of the warp (so: after the
// grid-stride loop, never inside a divergent branch), with blockDim.x a multiple of 32.
__device__ __forceinline__ void hvd_warp_atomic_max(unsigned int* p, unsigned int v)
{
#ifdef __CUDACC__
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    v = __reduce_max_sync(0xffffffffu, v);
#else
    for (int o = 16; o > 0; o >>= 1) {
        unsigned int w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
#endif
    if ((threadIdx.x & 31u) == 0u) atomicMax(p, v);
#else
    atomicMax(p, v);
#endif
}

// a = g + e (e optional), rounded to nearest even.
__device__ __forceinline__ float hvd_load_a(const float* g, const float* e, long long i)
{
    return e ? __fadd_rn(g[i], e[i]) : g[i];
}

// True for NaN and +-Inf bit patterns.
__device__ __forceinline__ bool hvd_nonfinite_bits(unsigned int bits)
{
    return (bits & 0x7fffffffu) >= 0x7f800000u;
}

// ---------------------------------------------------------------------------------------
// 1. M = max_i |g_i + e_i| as uint32 atomicMax on the abs bits. Non-negative floats order
// like their bit patterns and NaN bits sort above Inf, so the result is NaN/Inf iff some
// a_i is; identical to the CPU backend's reduction bit for bit.
// grid: grid-stride over n elements, 256 threads per block.
// bytes: reads 4n (8n with e); one atomic per warp into state[HVD_ST_ABSMAX].
extern "C" __global__ void threelc_absmax(const float* __restrict__ g,
                                          const float* __restrict__ e, long long n,
                                          unsigned int* __restrict__ state)
{
    unsigned int m = 0u;
    const long long stride = hvd_grid_stride();
    for (long long i = hvd_first_index(); i < n; i += stride) {
        unsigned int b = __float_as_uint(hvd_load_a(g, e, i)) & 0x7fffffffu;
        m = b > m ? b : m;
    }
    hvd_warp_atomic_max(state + HVD_ST_ABSMAX, m);
}

// ---------------------------------------------------------------------------------------
// 2. Fused quantize + quartic encode (+ residual update), one thread per group of 5
// consecutive elements. Reads M from state (written by threelc_absmax earlier on the same
// stream), computes S = sparsity * M and, unless a or S is non-finite:
//     a = g + e; q = S == 0 ? 0 : rint(a / S); e = a - S * q   (when e is given)
//     byte = 81 d0 + 27 d1 + 9 d2 + 3 d3 + d4 with d = q + 1, padding d = 1.
// q is clamped to [-1, 1]; that never changes a result for 1 <= sparsity < 2 (|a| <= M <=
// S), it only keeps digits in range for an invalid sparsity. Non-finite: every byte is
// 121, q_out is 0 and e is not written. Block 0 thread 0 stores S and the flag in state.
// q_out (int8, may be null) is for the public quantize() building block.
// grid: grid-stride over m = ceil(n / 5) groups, 256 threads per block.
// bytes: reads 4n (+4n e), writes m (quartic) (+4n e) (+n q_out).
// hvd_quantize_group is one group's byte (also for threelc_quantize_quartic_segments).
__device__ __forceinline__ unsigned char hvd_quantize_group(const float* g, float* e,
                                                            long long n, long long j, float S,
                                                            bool nonfinite, signed char* q_out)
{
    const long long base = j * 5;
    int byte = 0;
    for (int t = 0; t < 5; ++t) {
        const long long i = base + t;
        int d = 1;
        if (i < n) {
            if (!nonfinite) {
                const float a = hvd_load_a(g, e, i);
                int q = 0;
                if (S != 0.0f) q = (int)fminf(fmaxf(rintf(__fdiv_rn(a, S)), -1.0f), 1.0f);
                // S * q with q an integer (+0.0f for q == 0, never -0.0f): the residual
                // of a == -0.0f stays -0.0f, as in the CPU backend.
                if (e) e[i] = __fsub_rn(a, __fmul_rn(S, (float)q));
                d = q + 1;
            }
            if (q_out) q_out[i] = (signed char)(d - 1);
        }
        byte = byte * 3 + d;
    }
    return (unsigned char)byte;
}

extern "C" __global__ void threelc_quantize_quartic(const float* __restrict__ g,
                                                    float* __restrict__ e, long long n,
                                                    float sparsity,
                                                    unsigned int* __restrict__ state,
                                                    unsigned char* __restrict__ quartic,
                                                    signed char* __restrict__ q_out)
{
    const long long m = (n + 4) / 5;
    const unsigned int mbits = state[HVD_ST_ABSMAX];
    const float S = __fmul_rn(sparsity, __uint_as_float(mbits));
    const bool nonfinite = hvd_nonfinite_bits(mbits) || hvd_nonfinite_bits(__float_as_uint(S));
    if (hvd_first_index() == 0) {
        state[HVD_ST_SCALE] = __float_as_uint(S);
        state[HVD_ST_NONFINITE] = nonfinite ? 1u : 0u;
    }
    const long long stride = hvd_grid_stride();
    for (long long j = hvd_first_index(); j < m; j += stride)
        quartic[j] = hvd_quantize_group(g, e, n, j, S, nonfinite, q_out);
}

// Quartic encode of an int8 q in {-1, 0, 1} (building block). Out-of-range q sets
// HVD_ERR_INPUT and is clamped.
// grid: grid-stride over m = ceil(n / 5) groups. bytes: reads n, writes m.
extern "C" __global__ void threelc_quartic_encode(const signed char* __restrict__ q,
                                                  long long n,
                                                  unsigned char* __restrict__ quartic,
                                                  unsigned int* __restrict__ state)
{
    const long long m = (n + 4) / 5;
    const long long stride = hvd_grid_stride();
    for (long long j = hvd_first_index(); j < m; j += stride) {
        const long long base = j * 5;
        int byte = 0;
        for (int t = 0; t < 5; ++t) {
            const long long i = base + t;
            int d = 1;
            if (i < n) {
                d = (int)q[i] + 1;
                if (d < 0 || d > 2) {
                    atomicOr(state + HVD_ST_ERROR, HVD_ERR_INPUT);
                    d = d < 0 ? 0 : 2;
                }
            }
            byte = byte * 3 + d;
        }
        quartic[j] = (unsigned char)byte;
    }
}

// ---------------------------------------------------------------------------------------
// 3. Zero-run encoding: a maximal run of r bytes 121 becomes chunks of min(14, r - k)
// bytes starting at run offsets k = 0, 14, 28, ...; a chunk of c bytes is written as
// 241 + c (c >= 2; 255 for c = 14) or 121 (c = 1). Other bytes are copied. So position
// i emits one output byte iff qb[i] != 121 or (i - run_start(i)) % 14 == 0.
//   threelc_zre_run_starts -> cummax (torch.cummax) -> threelc_zre_flags
//   -> inclusive scan of the flags (torch.cumsum, int64) -> threelc_zre_scatter.

// start[i] = i where a run of 121 starts, else -1. Their running max is, at a 121, the
// start of its run.
// grid: grid-stride over m bytes. bytes: reads m (+m neighbours, cached), writes 8m.
extern "C" __global__ void threelc_zre_run_starts(const unsigned char* __restrict__ qb,
                                                  long long m,
                                                  long long* __restrict__ start)
{
    const long long stride = hvd_grid_stride();
    for (long long i = hvd_first_index(); i < m; i += stride) {
        const bool begins = qb[i] == HVD_ZERO_GROUP && (i == 0 || qb[i - 1] != HVD_ZERO_GROUP);
        start[i] = begins ? i : -1;
    }
}

__device__ __forceinline__ bool hvd_zre_emits(const unsigned char* qb,
                                              const long long* run_start, long long i)
{
    return qb[i] != HVD_ZERO_GROUP || (i - run_start[i]) % HVD_MAX_RUN == 0;
}

// emit[i] = 1 iff position i writes an output byte. Input bytes > 242 set HVD_ERR_INPUT
// (only possible through the zero_run_encode building block).
// grid: grid-stride over m. bytes: reads m + 8m, writes m.
extern "C" __global__ void threelc_zre_flags(const unsigned char* __restrict__ qb,
                                             const long long* __restrict__ run_start,
                                             long long m, unsigned char* __restrict__ emit,
                                             unsigned int* __restrict__ state)
{
    const long long stride = hvd_grid_stride();
    for (long long i = hvd_first_index(); i < m; i += stride) {
        if (qb[i] > HVD_MAX_QUARTIC) atomicOr(state + HVD_ST_ERROR, HVD_ERR_INPUT);
        emit[i] = hvd_zre_emits(qb, run_start, i) ? 1 : 0;
    }
}

// Writes the code of emitting position i to out[incl[i] - 1]: qb[i], or for a zero group
// its chunk of c zero groups (up to 14, none at or past `stop`, the end of its tensor's
// bytes) as 121 (c == 1) or 241 + c. A write at or past cap sets HVD_ERR_OVERFLOW in *err.
__device__ __forceinline__ void hvd_zre_write(const unsigned char* qb, const long long* incl,
                                              long long i, long long stop,
                                              unsigned char* out, long long cap,
                                              unsigned int* err)
{
    unsigned char code = qb[i];
    if (code == HVD_ZERO_GROUP) {
        const long long end = i + HVD_MAX_RUN < stop ? i + HVD_MAX_RUN : stop;
        long long k = i + 1;
        while (k < end && qb[k] == HVD_ZERO_GROUP) ++k;
        const int c = (int)(k - i);
        code = c == 1 ? (unsigned char)HVD_ZERO_GROUP : (unsigned char)(HVD_RUN_BASE + c);
    }
    const long long pos = incl[i] - 1;
    if (pos >= 0 && pos < cap) {
        out[pos] = code;
    } else {
        atomicOr(err, HVD_ERR_OVERFLOW);
    }
}

// out[incl[i] - 1] = code of position i for every emitting i; the thread of i = m - 1
// stores the output length incl[m - 1] in state. A chunk's length is found by looking
// ahead at most 14 bytes. cap is out's size (m suffices); writes past it are refused.
// grid: grid-stride over m. bytes: reads m (+14 look-ahead, cached) + 8m + 8m, writes the
// output (<= m).
extern "C" __global__ void threelc_zre_scatter(const unsigned char* __restrict__ qb,
                                               const long long* __restrict__ run_start,
                                               const long long* __restrict__ incl,
                                               long long m, unsigned char* __restrict__ out,
                                               long long cap, unsigned int* __restrict__ state)
{
    const long long stride = hvd_grid_stride();
    for (long long i = hvd_first_index(); i < m; i += stride) {
        if (i == m - 1) *(long long*)(state + HVD_ST_COUNT) = incl[i];
        if (hvd_zre_emits(qb, run_start, i))
            hvd_zre_write(qb, incl, i, m, out, cap, state + HVD_ST_ERROR);
    }
}

// ---------------------------------------------------------------------------------------
// 4. Zero-run decoding: byte b expands to b - 241 bytes of 121 when b >= 243, else to
// itself. threelc_zre_lengths -> inclusive scan (torch.cumsum, int64) ->
// threelc_zre_decode_check (the host reads state once: length and error bits) ->
// threelc_zre_expand -> threelc_quartic_decode_scale.

// lens[j] = expansion length of body byte j (1..14).
// grid: grid-stride over L body bytes. bytes: reads L, writes L.
extern "C" __global__ void threelc_zre_lengths(const unsigned char* __restrict__ body,
                                               long long len,
                                               unsigned char* __restrict__ lens)
{
    const long long stride = hvd_grid_stride();
    for (long long j = hvd_first_index(); j < len; j += stride) {
        const unsigned char b = body[j];
        lens[j] = b > HVD_RUN_BASE + 1 ? (unsigned char)(b - HVD_RUN_BASE) : (unsigned char)1;
    }
}

// The error bits of a zero-run body of n values that expands to `total` quartic bytes and
// ends with byte `last`: total must be ceil(n / 5), and the padding digits of the last
// quartic byte must be 1 (a run code expands to 121, whose digits all are).
__device__ __forceinline__ unsigned int hvd_zre_check(long long total, unsigned int last,
                                                      long long n)
{
    const long long m = (n + 4) / 5;
    if (total != m) return HVD_ERR_LENGTH;
    const int pad = (int)(5 * m - n);
    if (pad > 0 && last <= HVD_MAX_QUARTIC) {
        unsigned int p = 1u;
        for (int t = 0; t < pad; ++t) p *= 3u;
        if (last % p != (p - 1u) / 2u) return HVD_ERR_PADDING;
    }
    return 0u;
}

// One thread: total = incl[len - 1] (len >= 1) into state; with an expected n >= 0 (so
// m = ceil(n / 5)) checks total == m and that the padding digits of the last quartic byte
// are 1 (a run code expands to 121, whose digits all are). Bytes <= 242 are copied and
// codes >= 243 expand to 121, so no expanded byte can exceed 242: these two checks are all
// a body needs, and they run before anything is written to the caller's tensor.
// grid: 1 x 1 (extra threads return). bytes: reads 9.
extern "C" __global__ void threelc_zre_decode_check(const unsigned char* __restrict__ body,
                                                    const long long* __restrict__ incl,
                                                    long long len, long long n,
                                                    unsigned int* __restrict__ state)
{
    if (hvd_first_index() != 0) return;
    const long long total = incl[len - 1];
    const unsigned int last = body[len - 1];
    *(long long*)(state + HVD_ST_COUNT) = total;
    state[HVD_ST_LAST] = last;
    if (n < 0) return;
    const unsigned int err = hvd_zre_check(total, last, n);
    if (err) atomicOr(state + HVD_ST_ERROR, err);
}

// qb[incl[j] - lens(j) + t] = (b >= 243 ? run_value : b) for t < lens(j); writes at or
// past cap are refused with HVD_ERR_OVERFLOW (never happens after a passed check).
// run_value is 121 for the zero_run_decode building block, and HVD_RUN_GROUP for the fused
// decode, whose threelc_quartic_decode_scale treats zero groups from runs like the CPU
// backend does (written as +0.0f, skipped when accumulating).
// grid: grid-stride over L body bytes. bytes: reads L + 8L, writes cap (<= 14 per thread).
extern "C" __global__ void threelc_zre_expand(const unsigned char* __restrict__ body,
                                              const long long* __restrict__ incl,
                                              long long len, unsigned char run_value,
                                              unsigned char* __restrict__ qb, long long cap,
                                              unsigned int* __restrict__ state)
{
    const long long stride = hvd_grid_stride();
    for (long long j = hvd_first_index(); j < len; j += stride) {
        const unsigned char b = body[j];
        const bool run = b > HVD_RUN_BASE + 1;
        const int c = run ? (int)b - HVD_RUN_BASE : 1;
        const unsigned char v = run ? run_value : b;
        const long long start = incl[j] - c;
        for (int t = 0; t < c; ++t) {
            const long long p = start + t;
            if (p >= 0 && p < cap) {
                qb[p] = v;
            } else {
                atomicOr(state + HVD_ST_ERROR, HVD_ERR_OVERFLOW);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// 5. Quartic decode, one thread per group of 5 elements.

// Digits of a quartic byte, most significant first; returns false for bytes > 242 or a
// padding digit (element index >= n) that is not 1.
__device__ __forceinline__ bool hvd_quartic_digits(unsigned int b, long long base, long long n,
                                                   int* d)
{
    bool ok = b <= HVD_MAX_QUARTIC;
    for (int t = 4; t >= 0; --t) {
        d[t] = (int)(b % 3u);
        b /= 3u;
        if (base + t >= n && d[t] != 1) ok = false;
    }
    return ok;
}

// S * q of quartic byte b (the group of elements base .. base + 4) written into out, or
// added with accumulate; HVD_RUN_GROUP writes +0.0f, or with accumulate leaves out as it
// is. Returns HVD_ERR_BYTE / HVD_ERR_PADDING for an invalid byte (its digits still used).
__device__ __forceinline__ unsigned int hvd_decode_group(unsigned int b, long long base,
                                                         long long n, float S, float* out,
                                                         int accumulate)
{
    if (b == HVD_RUN_GROUP) {
        if (!accumulate)
            for (int t = 0; t < 5 && base + t < n; ++t) out[base + t] = 0.0f;
        return 0u;
    }
    int d[5];
    unsigned int err = 0u;
    if (!hvd_quartic_digits(b, base, n, d))
        err = b > HVD_MAX_QUARTIC ? HVD_ERR_BYTE : HVD_ERR_PADDING;
    for (int t = 0; t < 5 && base + t < n; ++t) {
        const float v = __fmul_rn(S, (float)(d[t] - 1));
        out[base + t] = accumulate ? __fadd_rn(out[base + t], v) : v;
    }
    return err;
}

// out[i] = S * q_i, or with accumulate out[i] = out[i] + S * q_i (the allgather path
// sums every rank's payload in rank order, one call per payload on one stream).
// Byte HVD_RUN_GROUP (a zero group from a run code, see threelc_zre_expand) writes +0.0f,
// or with accumulate leaves out as it is, exactly like the CPU backend's fused decode
// (identical to S * 0 for the finite S >= 0 of every valid payload except for a -0.0f
// already in out, or a NaN/negative S).
// Invalid bytes set HVD_ERR_BYTE / HVD_ERR_PADDING (the backend checks before calling).
// grid: grid-stride over m = ceil(n / 5) groups. bytes: reads m, writes 4n (+ reads 4n).
extern "C" __global__ void threelc_quartic_decode_scale(const unsigned char* __restrict__ qb,
                                                        long long n, float S,
                                                        float* __restrict__ out, int accumulate,
                                                        unsigned int* __restrict__ state)
{
    const long long m = (n + 4) / 5;
    const long long stride = hvd_grid_stride();
    for (long long j = hvd_first_index(); j < m; j += stride) {
        const unsigned int err = hvd_decode_group(qb[j], j * 5, n, S, out, accumulate);
        if (err) atomicOr(state + HVD_ST_ERROR, err);
    }
}

// q[i] in {-1, 0, 1} from quartic bytes (building block), with the same validation.
// grid: grid-stride over m groups. bytes: reads m, writes n.
extern "C" __global__ void threelc_quartic_decode(const unsigned char* __restrict__ qb,
                                                  long long n, signed char* __restrict__ q,
                                                  unsigned int* __restrict__ state)
{
    const long long m = (n + 4) / 5;
    const long long stride = hvd_grid_stride();
    for (long long j = hvd_first_index(); j < m; j += stride) {
        const long long base = j * 5;
        const unsigned int b = qb[j];
        int d[5];
        if (!hvd_quartic_digits(b, base, n, d)) {
            atomicOr(state + HVD_ST_ERROR, b > HVD_MAX_QUARTIC ? HVD_ERR_BYTE : HVD_ERR_PADDING);
        }
        for (int t = 0; t < 5; ++t) {
            const long long i = base + t;
            if (i >= n) break;
            q[i] = (signed char)(d[t] - 1);
        }
    }
}

// ---------------------------------------------------------------------------------------
// 6. (The payload checksum, its segment form and the frame scan, once sections 6 and 8 of
// this file, are kernels/frame.cu.)

// ---------------------------------------------------------------------------------------
// 7. Buckets: one launch sequence for all the tensors of a bucket (docs/backends.md,
// "One call per bucket"). The host passes a segment table, nseg rows of
// HVD_SEG_COLS int64 (one host-to-device copy per call), and a per-segment state array,
// nseg rows of HVD_STATE_WORDS words (one device-to-host copy per call). Every segment
// has at least one element (the host leaves empty tensors out).
//
// Work is cut into tiles of `tile` units (groups of 5 elements for the 3LC kernels, bytes
// for frame.cu's checksum) that never straddle two segments; row s's tiles are numbered from
// seg[s][HVD_SEG_TILE] (the host's exclusive prefix sum of ceil(units / tile)). A block
// takes tiles blockIdx.x, blockIdx.x + gridDim.x, ...; the tile loop is the same for
// every thread of a block, so the warp reductions after a tile see all 32 lanes of one
// segment. A tile's segment is found by binary search over the table (log2 nseg steps a
// tile, the table stays in cache).
#define HVD_SEG_COLS 8
#define HVD_SEG_IN 0    // pointer: g (encode) / the payload's first byte (checksum)
#define HVD_SEG_AUX 1   // pointer: e, 0 for none (encode) / out (decode)
#define HVD_SEG_N 2     // elements (3LC) / bytes (checksum)
#define HVD_SEG_QOFF 3  // the segment's first byte in the bucket's quartic buffer
#define HVD_SEG_BOFF 4  // decode: the body's first byte in the bucket's concatenated bodies
#define HVD_SEG_BLEN 5  // decode: body bytes
#define HVD_SEG_TILE 6  // the segment's first tile
#define HVD_SEG_F32 7   // float32 bits: the sparsity (encode) / the scale S (decode)

// The segment of tile t: the last row whose first tile is <= t.
__device__ __forceinline__ long long hvd_tile_segment(const long long* seg, long long nseg,
                                                      long long t)
{
    long long lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const long long mid = (lo + hi + 1) >> 1;
        if (seg[mid * HVD_SEG_COLS + HVD_SEG_TILE] <= t) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

__device__ __forceinline__ long long hvd_min64(long long a, long long b) { return a < b ? a : b; }

// Segment form of threelc_absmax: M_s = max |g + e| of each segment into its state.
// grid: blocks loop over the tiles of `tile` groups (5 * tile elements), 256 threads.
// bytes: reads 4n (8n with e) over all segments; one atomic per warp and tile.
extern "C" __global__ void threelc_absmax_segments(const long long* __restrict__ seg,
                                                   long long nseg, long long ntiles,
                                                   long long tile,
                                                   unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SEG_COLS;
        const float* g = (const float*)row[HVD_SEG_IN];
        const float* e = (const float*)row[HVD_SEG_AUX];
        const long long n = row[HVD_SEG_N];
        const long long first = (t - row[HVD_SEG_TILE]) * tile * 5;
        const long long end = hvd_min64(first + tile * 5, n);
        unsigned int m = 0u;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            unsigned int b = __float_as_uint(hvd_load_a(g, e, i)) & 0x7fffffffu;
            m = b > m ? b : m;
        }
        hvd_warp_atomic_max(states + s * HVD_STATE_WORDS + HVD_ST_ABSMAX, m);
    }
}

// Segment form of threelc_quantize_quartic (no q_out): segment s's quartic bytes go to
// quartic[qoff_s ..], its S and non-finite flag to its state (by the thread of its first
// group). M_s comes from threelc_absmax_segments earlier on the stream.
// grid: blocks loop over the tiles of `tile` groups. bytes: reads 4n (+4n e), writes
// ceil(n / 5) (+4n e) over all segments.
extern "C" __global__ void threelc_quantize_quartic_segments(
    const long long* __restrict__ seg, long long nseg, long long ntiles, long long tile,
    unsigned int* __restrict__ states, unsigned char* __restrict__ quartic)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SEG_COLS;
        const float* g = (const float*)row[HVD_SEG_IN];
        float* e = (float*)row[HVD_SEG_AUX];
        const long long n = row[HVD_SEG_N];
        unsigned int* state = states + s * HVD_STATE_WORDS;
        const float sparsity = __uint_as_float((unsigned int)row[HVD_SEG_F32]);
        const unsigned int mbits = state[HVD_ST_ABSMAX];
        const float S = __fmul_rn(sparsity, __uint_as_float(mbits));
        const bool nonfinite =
            hvd_nonfinite_bits(mbits) || hvd_nonfinite_bits(__float_as_uint(S));
        const long long first = (t - row[HVD_SEG_TILE]) * tile;
        const long long end = hvd_min64(first + tile, (n + 4) / 5);
        unsigned char* qb = quartic + row[HVD_SEG_QOFF];
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            if (j == 0) {
                state[HVD_ST_SCALE] = __float_as_uint(S);
                state[HVD_ST_NONFINITE] = nonfinite ? 1u : 0u;
            }
            qb[j] = hvd_quantize_group(g, e, n, j, S, nonfinite, (signed char*)0);
        }
    }
}

// Segment form of threelc_zre_run_starts over the bucket's quartic buffer: a run of 121
// also starts at a segment's first byte, so no run crosses two segments and one cummax
// over the whole buffer gives every byte its own segment's run start.
// grid: blocks loop over the tiles of `tile` bytes. bytes: reads m, writes 8m.
extern "C" __global__ void threelc_zre_run_starts_segments(const long long* __restrict__ seg,
                                                           long long nseg, long long ntiles,
                                                           long long tile,
                                                           const unsigned char* __restrict__ qb,
                                                           long long* __restrict__ start)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SEG_COLS;
        const long long qoff = row[HVD_SEG_QOFF];
        const long long first = (t - row[HVD_SEG_TILE]) * tile;
        const long long end = hvd_min64(first + tile, (row[HVD_SEG_N] + 4) / 5);
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            const long long i = qoff + j;
            const bool begins =
                qb[i] == HVD_ZERO_GROUP && (j == 0 || qb[i - 1] != HVD_ZERO_GROUP);
            start[i] = begins ? i : -1;
        }
    }
}

// Segment form of threelc_zre_scatter: a chunk's look-ahead stops at its segment's end,
// and the thread of a segment's last byte stores the segment's output length (incl at its
// last byte minus incl before its first) in its state. Segment s's body is then
// out[sum of the lengths before s ..][: its length].
// grid: blocks loop over the tiles of `tile` bytes. bytes: reads m (+14 look-ahead) + 16m
// (+8 a segment), writes the output (<= m).
extern "C" __global__ void threelc_zre_scatter_segments(
    const long long* __restrict__ seg, long long nseg, long long ntiles, long long tile,
    const unsigned char* __restrict__ qb, const long long* __restrict__ run_start,
    const long long* __restrict__ incl, unsigned char* __restrict__ out, long long cap,
    unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SEG_COLS;
        const long long qoff = row[HVD_SEG_QOFF];
        const long long m = (row[HVD_SEG_N] + 4) / 5;
        const long long first = (t - row[HVD_SEG_TILE]) * tile;
        const long long end = hvd_min64(first + tile, m);
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            const long long i = qoff + j;
            if (j == m - 1) {
                const long long before = qoff > 0 ? incl[qoff - 1] : 0;
                *(long long*)(states + s * HVD_STATE_WORDS + HVD_ST_COUNT) = incl[i] - before;
            }
            if (hvd_zre_emits(qb, run_start, i)) {
                hvd_zre_write(qb, incl, i, qoff + m, out, cap,
                              states + s * HVD_STATE_WORDS + HVD_ST_ERROR);
            }
        }
    }
}

// Segment form of threelc_zre_decode_check, one thread a segment: with the expansion
// lengths of the bucket's concatenated bodies scanned into incl, segment s's total is
// incl at its last body byte minus incl before its first; it must be ceil(n / 5), and the
// padding digits of its last byte must be 1. Writes the total and the error bits into
// its state. When every segment before s passed, incl before s's body equals qoff_s, so
// threelc_zre_expand over those bodies writes each segment's quartic bytes in place.
// grid: grid-stride over nseg segments. bytes: reads 17 a segment.
extern "C" __global__ void threelc_zre_decode_check_segments(
    const long long* __restrict__ seg, long long nseg, const unsigned char* __restrict__ body,
    const long long* __restrict__ incl, unsigned int* __restrict__ states)
{
    const long long stride = hvd_grid_stride();
    for (long long s = hvd_first_index(); s < nseg; s += stride) {
        const long long* row = seg + s * HVD_SEG_COLS;
        const long long boff = row[HVD_SEG_BOFF];
        const long long blen = row[HVD_SEG_BLEN];
        const long long n = row[HVD_SEG_N];
        unsigned int* state = states + s * HVD_STATE_WORDS;
        const long long before = boff > 0 ? incl[boff - 1] : 0;
        const long long total = incl[boff + blen - 1] - before;
        const unsigned int last = body[boff + blen - 1];
        *(long long*)(state + HVD_ST_COUNT) = total;
        state[HVD_ST_LAST] = last;
        state[HVD_ST_ERROR] |= hvd_zre_check(total, last, n);
    }
}

// Segment form of threelc_quartic_decode_scale with accumulate: out_s[i] += S_s * q_i from
// the bucket's expanded quartic buffer (zero groups of run codes, HVD_RUN_GROUP, leave out
// as it is, exactly like the single-tensor kernel and the CPU backend).
// grid: blocks loop over the tiles of `tile` groups. bytes: reads m + 4n, writes 4n over
// all segments.
extern "C" __global__ void threelc_quartic_decode_add_segments(
    const long long* __restrict__ seg, long long nseg, long long ntiles, long long tile,
    const unsigned char* __restrict__ quartic, unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SEG_COLS;
        float* out = (float*)row[HVD_SEG_AUX];
        const long long n = row[HVD_SEG_N];
        const float S = __uint_as_float((unsigned int)row[HVD_SEG_F32]);
        const unsigned char* qb = quartic + row[HVD_SEG_QOFF];
        const long long first = (t - row[HVD_SEG_TILE]) * tile;
        const long long end = hvd_min64(first + tile, (n + 4) / 5);
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            const unsigned int err = hvd_decode_group(qb[j], j * 5, n, S, out, 1);
            if (err) atomicOr(states + s * HVD_STATE_WORDS + HVD_ST_ERROR, err);
        }
    }
}
