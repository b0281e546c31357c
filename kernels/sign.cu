// Sign codecs, signSGD and EF-signSGD (docs/baselines.md): the CUDA twin of
// kernels/sign.c (CPU backend), byte for byte the same. Body: bit i = (a_i < 0), packed
// LSB first; decoding gives bit ? -scale : +scale (scale 1 for signSGD).
//
// Compiled three ways from this one file, like kernels/threelc.cu: by NVRTC through
// hvdcompress/backends/cuda/ (NVRTC_OPTIONS of hvdcompress/_native.py), by nvcc in
// scripts/check_kernels.sh, and by g++ for the host through kernels/cuda_host.h
// (tests/host_kernels/). Hence plain C-like code, no #include under CUDA, no barriers or
// shared memory, no code that needs two threads at once.
//
// Names: kernels sign_<op>, helpers hvd_sign_* (the host build compiles every .cu file in
// one unit). Every index is 64-bit (blockIdx.x * blockDim.x and the grid stride formed in
// long long). Every kernel is a grid-stride loop, so any grid size is correct; the backend
// launches 256 threads per block and at most 8 blocks per multiprocessor.
//
// `state` is the zeroed 8-word uint32 array of threelc.cu; word 2 (non-finite flag) and
// word 3 (error bits) are used here, with atomicOr.
#define HVD_SIGN_ST_NONFINITE 2
#define HVD_SIGN_ST_ERROR 3
#define HVD_SIGN_ERR_PADDING 4u  // a padding bit after the last value is set
#define HVD_SIGN_NONFINITE_BITS 0x7f800000u

#ifndef __CUDACC__
#include "cuda_host.h"
#endif

__device__ __forceinline__ long long hvd_sign_first_index()
{
    return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

__device__ __forceinline__ long long hvd_sign_grid_stride()
{
    return (long long)gridDim.x * (long long)blockDim.x;
}

// The per-byte and per-chunk math, shared by the one-tensor kernels and the bucket kernels
// of section 5.

// Byte j of signSGD's body (bit i - 8j = x_i < 0); the largest |x| bits into *worst.
__device__ __forceinline__ unsigned char hvd_sign_encode_byte(const float* x, long long n,
                                                              long long j,
                                                              unsigned int* worst)
{
    const long long lo = 8ll * j;
    const long long hi = lo + 8 < n ? lo + 8 : n;
    unsigned int byte = 0u;
    for (long long i = lo; i < hi; ++i) {
        const float v = x[i];
        const unsigned int a = __float_as_uint(v) & 0x7fffffffu;
        *worst = a > *worst ? a : *worst;
        byte |= (v < 0.0f ? 1u : 0u) << (unsigned int)(i - lo);
    }
    return (unsigned char)byte;
}

// Chunk c's sum of |g + e| (float32 sum, |.| in double, added in double left to right);
// the largest |g + e| bits into *worst.
__device__ __forceinline__ double hvd_sign_chunk_sum(const float* g, const float* e, long long n,
                                                     long long c, long long chunk,
                                                     unsigned int* worst)
{
    const long long lo = c * chunk;
    const long long hi = lo + chunk < n ? lo + chunk : n;
    double sum = 0.0;
    for (long long i = lo; i < hi; ++i) {
        const float a = __fadd_rn(g[i], e[i]);
        const unsigned int b = __float_as_uint(a) & 0x7fffffffu;
        *worst = b > *worst ? b : *worst;
#ifdef __CUDACC__
        sum = __dadd_rn(sum, fabs((double)a));
#else
        sum = sum + fabs((double)a);
#endif
    }
    return sum;
}

// Byte j of EF-signSGD's body (the signs of a = g + e), e <- a - (a < 0 ? -scale : scale).
__device__ __forceinline__ unsigned char hvd_sign_ef_encode_byte(const float* g, float* e,
                                                                 long long n, long long j,
                                                                 float scale)
{
    const long long lo = 8ll * j;
    const long long hi = lo + 8 < n ? lo + 8 : n;
    unsigned int byte = 0u;
    for (long long i = lo; i < hi; ++i) {
        const float a = __fadd_rn(g[i], e[i]);
        const bool minus = a < 0.0f;
        byte |= (minus ? 1u : 0u) << (unsigned int)(i - lo);
        e[i] = __fsub_rn(a, minus ? -scale : scale);
    }
    return (unsigned char)byte;
}

// True when a padding bit after the last of n packed signs is set.
__device__ __forceinline__ bool hvd_sign_padding_set(const unsigned char* body, long long n)
{
    return (n & 7ll) && ((unsigned int)body[(n + 7) / 8 - 1] >> (unsigned int)(n & 7ll));
}

// The elements of body byte j: out = (bit ? -scale : scale), or out += that.
__device__ __forceinline__ void hvd_sign_decode_byte(unsigned int byte, long long n, long long j,
                                                     float scale, float* out, int accumulate)
{
    const long long lo = 8ll * j;
    const long long hi = lo + 8 < n ? lo + 8 : n;
    for (long long i = lo; i < hi; ++i) {
        const float v = ((byte >> (unsigned int)(i - lo)) & 1u) ? -scale : scale;
        out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
}

// 1. signSGD encode: one thread per output byte j (elements 8j .. 8j + 7), so no two
// threads write the same byte; any |x| with Inf / NaN bits sets the non-finite word.
// grid: grid-stride over nbytes = ceil(n / 8). bytes: reads 4n, writes n / 8.
extern "C" __global__ void sign_encode(const float* __restrict__ x, long long n,
                                       unsigned char* __restrict__ out,
                                       unsigned int* __restrict__ state)
{
    const long long nbytes = (n + 7) / 8;
    const long long stride = hvd_sign_grid_stride();
    unsigned int worst = 0u;
    for (long long j = hvd_sign_first_index(); j < nbytes; j += stride)
        out[j] = hvd_sign_encode_byte(x, n, j, &worst);
    if (worst >= HVD_SIGN_NONFINITE_BITS) atomicOr(state + HVD_SIGN_ST_NONFINITE, 1u);
}

// 2. EF-signSGD pass 1: sums[c] = sum over i in chunk c of |g_i + e_i| (float32 sum, then
// |.| in double), in double strictly left to right: one thread per chunk, the CPU's order.
// Inf / NaN in g + e sets the non-finite word. grid: grid-stride over ceil(n / chunk)
// chunks. bytes: reads 8n, writes 8 per chunk.
extern "C" __global__ void sign_ef_sums(const float* __restrict__ g, const float* __restrict__ e,
                                        long long n, long long chunk,
                                        double* __restrict__ sums,
                                        unsigned int* __restrict__ state)
{
    const long long chunks = (n + chunk - 1) / chunk;
    const long long stride = hvd_sign_grid_stride();
    unsigned int worst = 0u;
    for (long long c = hvd_sign_first_index(); c < chunks; c += stride)
        sums[c] = hvd_sign_chunk_sum(g, e, n, c, chunk, &worst);
    if (worst >= HVD_SIGN_NONFINITE_BITS) atomicOr(state + HVD_SIGN_ST_NONFINITE, 1u);
}

// 3. EF-signSGD pass 2: a = g + e, out = sign bits of a, e <- a - (a < 0 ? -scale : scale).
// One thread per output byte (elements 8j .. 8j + 7). grid: grid-stride over ceil(n / 8).
// bytes: reads 8n, writes 4n + n / 8.
extern "C" __global__ void sign_ef_encode(const float* __restrict__ g, float* __restrict__ e,
                                          float scale, long long n,
                                          unsigned char* __restrict__ out)
{
    const long long nbytes = (n + 7) / 8;
    const long long stride = hvd_sign_grid_stride();
    for (long long j = hvd_sign_first_index(); j < nbytes; j += stride)
        out[j] = hvd_sign_ef_encode_byte(g, e, n, j, scale);
}

// 4. Decode: out[i] = (bit i ? -scale : scale), or out[i] += that with accumulate. Every
// thread first looks at the padding bits of the last byte: when one is set no thread
// writes, and the thread of byte 0 sets HVD_SIGN_ERR_PADDING (out untouched). The caller
// checked nbytes == ceil(n / 8). One thread per body byte. grid: grid-stride over nbytes.
// bytes: reads n / 8, writes 4n (reads 4n more with accumulate).
extern "C" __global__ void sign_decode(const unsigned char* __restrict__ body, long long n,
                                       float scale, float* __restrict__ out, int accumulate,
                                       unsigned int* __restrict__ state)
{
    const long long nbytes = (n + 7) / 8;
    const long long first = hvd_sign_first_index();
    if (hvd_sign_padding_set(body, n)) {
        if (first == 0) atomicOr(state + HVD_SIGN_ST_ERROR, HVD_SIGN_ERR_PADDING);
        return;
    }
    const long long stride = hvd_sign_grid_stride();
    for (long long j = first; j < nbytes; j += stride)
        hvd_sign_decode_byte(body[j], n, j, scale, out, accumulate);
}

// ---------------------------------------------------------------------------------------
// 5. Buckets: one launch for all the tensors of a bucket (docs/backends.md, "The CUDA path").
// The host passes a segment table, nseg rows of HVD_SIGN_SEG_COLS int64 (the
// layout of kernels/threelc.cu section 7, with absolute pointers), and per-segment state
// rows of 8 words. Work is cut into tiles of `tile` units (output bytes, or chunks) that
// never straddle two segments; row s's tiles are numbered from its HVD_SIGN_SEG_TILE, and
// a block takes tiles blockIdx.x, blockIdx.x + gridDim.x, ... Every segment has at least
// one element (the host leaves empty tensors out).
#define HVD_SIGN_SEG_COLS 8
#define HVD_SIGN_SEG_IN 0    // pointer: x or g (encode), the body (decode)
#define HVD_SIGN_SEG_AUX 1   // pointer: e (EF-signSGD), out (decode)
#define HVD_SIGN_SEG_N 2     // elements
#define HVD_SIGN_SEG_OUT 3   // pointer: the body (encode), the first chunk sum (sums)
#define HVD_SIGN_SEG_TILE 6  // the segment's first tile
#define HVD_SIGN_SEG_F32 7   // float32 bits: the scale
#define HVD_SIGN_STATE_WORDS 8

// The segment of tile t: the last row whose first tile is <= t.
__device__ __forceinline__ long long hvd_sign_tile_segment(const long long* seg,
                                                           long long nseg, long long t)
{
    long long lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const long long mid = (lo + hi + 1) >> 1;
        const bool after = seg[mid * HVD_SIGN_SEG_COLS + HVD_SIGN_SEG_TILE] > t;
        lo = after ? lo : mid;
        hi = after ? mid - 1 : hi;
    }
    return lo;
}

// Units [first, end) of tile t of segment s with `units` units.
__device__ __forceinline__ long long hvd_sign_tile_end(long long first, long long tile,
                                                       long long units)
{
    return first + tile < units ? first + tile : units;
}

// sign_encode of each segment: the bits to its body, the non-finite flag to its state.
// grid: blocks loop over tiles of `tile` output bytes, 256 threads. bytes: reads 4n, writes
// n / 8 over all segments.
extern "C" __global__ void sign_encode_segments(const long long* __restrict__ seg,
                                                long long nseg, long long ntiles,
                                                long long tile,
                                                unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sign_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SIGN_SEG_COLS;
        const float* x = (const float*)row[HVD_SIGN_SEG_IN];
        unsigned char* out = (unsigned char*)row[HVD_SIGN_SEG_OUT];
        const long long n = row[HVD_SIGN_SEG_N];
        const long long first = (t - row[HVD_SIGN_SEG_TILE]) * tile;
        const long long end = hvd_sign_tile_end(first, tile, (n + 7) / 8);
        unsigned int worst = 0u;
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x)
            out[j] = hvd_sign_encode_byte(x, n, j, &worst);
        if (worst >= HVD_SIGN_NONFINITE_BITS) {
            atomicOr(states + s * HVD_SIGN_STATE_WORDS + HVD_SIGN_ST_NONFINITE, 1u);
        }
    }
}

// sign_ef_sums of each segment: its chunk sums from its HVD_SIGN_SEG_OUT on, one thread a
// chunk (the CPU's order), the non-finite flag to its state.
// grid: blocks loop over tiles of `tile` chunks. bytes: reads 8n, writes 8 a chunk.
extern "C" __global__ void sign_ef_sums_segments(const long long* __restrict__ seg,
                                                 long long nseg, long long ntiles,
                                                 long long tile, long long chunk,
                                                 unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sign_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SIGN_SEG_COLS;
        const float* g = (const float*)row[HVD_SIGN_SEG_IN];
        const float* e = (const float*)row[HVD_SIGN_SEG_AUX];
        double* sums = (double*)row[HVD_SIGN_SEG_OUT];
        const long long n = row[HVD_SIGN_SEG_N];
        const long long first = (t - row[HVD_SIGN_SEG_TILE]) * tile;
        const long long end = hvd_sign_tile_end(first, tile, (n + chunk - 1) / chunk);
        unsigned int worst = 0u;
        for (long long c = first + threadIdx.x; c < end; c += blockDim.x)
            sums[c] = hvd_sign_chunk_sum(g, e, n, c, chunk, &worst);
        if (worst >= HVD_SIGN_NONFINITE_BITS) {
            atomicOr(states + s * HVD_SIGN_STATE_WORDS + HVD_SIGN_ST_NONFINITE, 1u);
        }
    }
}

// sign_ef_encode of each segment with its scale (the host leaves non-finite ones out).
// grid: blocks loop over tiles of `tile` output bytes. bytes: reads 8n, writes 4n + n / 8.
extern "C" __global__ void sign_ef_encode_segments(const long long* __restrict__ seg,
                                                   long long nseg, long long ntiles,
                                                   long long tile)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sign_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SIGN_SEG_COLS;
        const float* g = (const float*)row[HVD_SIGN_SEG_IN];
        float* e = (float*)row[HVD_SIGN_SEG_AUX];
        unsigned char* out = (unsigned char*)row[HVD_SIGN_SEG_OUT];
        const long long n = row[HVD_SIGN_SEG_N];
        const float scale = __uint_as_float((unsigned int)row[HVD_SIGN_SEG_F32]);
        const long long first = (t - row[HVD_SIGN_SEG_TILE]) * tile;
        const long long end = hvd_sign_tile_end(first, tile, (n + 7) / 8);
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x)
            out[j] = hvd_sign_ef_encode_byte(g, e, n, j, scale);
    }
}

// The padding bits of each segment's last body byte, one thread a segment: a set one
// sets HVD_SIGN_ERR_PADDING in its state (the host reads the states before any decode).
// grid: grid-stride over nseg. bytes: reads 1 a segment.
extern "C" __global__ void sign_decode_check_segments(const long long* __restrict__ seg,
                                                      long long nseg,
                                                      unsigned int* __restrict__ states)
{
    const long long stride = hvd_sign_grid_stride();
    for (long long s = hvd_sign_first_index(); s < nseg; s += stride) {
        const long long* row = seg + s * HVD_SIGN_SEG_COLS;
        const unsigned char* body = (const unsigned char*)row[HVD_SIGN_SEG_IN];
        if (hvd_sign_padding_set(body, row[HVD_SIGN_SEG_N]))
            states[s * HVD_SIGN_STATE_WORDS + HVD_SIGN_ST_ERROR] |= HVD_SIGN_ERR_PADDING;
    }
}

// sign_decode with accumulate of each segment: out += (bit ? -scale : scale). The host
// launches it for the segments before the first refused one only.
// grid: blocks loop over tiles of `tile` body bytes. bytes: reads n / 8 + 4n, writes 4n.
extern "C" __global__ void sign_decode_add_segments(const long long* __restrict__ seg,
                                                    long long nseg, long long ntiles,
                                                    long long tile)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sign_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SIGN_SEG_COLS;
        const unsigned char* body = (const unsigned char*)row[HVD_SIGN_SEG_IN];
        float* out = (float*)row[HVD_SIGN_SEG_AUX];
        const long long n = row[HVD_SIGN_SEG_N];
        const float scale = __uint_as_float((unsigned int)row[HVD_SIGN_SEG_F32]);
        const long long first = (t - row[HVD_SIGN_SEG_TILE]) * tile;
        const long long end = hvd_sign_tile_end(first, tile, (n + 7) / 8);
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x)
            hvd_sign_decode_byte(body[j], n, j, scale, out, 1);
    }
}
