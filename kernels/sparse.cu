// Sparse codecs on CUDA: a bucket of top-k bodies (top-k, DGC and GSpar send this layout;
// docs/design.md section 4), or of top-k + sign bodies, checked and added in one launch
// each: the decode of kernels/sparse.c's hvdc_topk_decode_segments and
// hvdc_topkq_decode_segments. Top-k's selection itself runs on torch
// (hvdcompress/backends/cuda.py, topk_select), tensor by tensor.
//
// Top-k body: k float32 values, then k indices in ascending order (int32 when n < 2^31,
// else int64), little-endian. Top-k + sign (`signs` set): one float32 magnitude m, the k
// indices, then k sign bits (1: -m, LSB first, padding bits zero). A rank's bodies sit
// anywhere in the gathered bytes, so every field is loaded byte by byte.
//
// Compiled three ways from this one file, like kernels/threelc.cu: by NVRTC through
// hvdcompress/backends/cuda.py (NVRTC_OPTIONS of hvdcompress/_native.py), by nvcc in
// scripts/check_kernels.sh, and by g++ for the host through kernels/cuda_host.h
// (tests/host_kernels/). Hence plain C-like code, no #include under CUDA, no barriers or
// shared memory, no code that needs two threads at once. Names: kernels sparse_<op>,
// helpers hvd_sparse_* (the host build compiles every .cu file in one unit). Every index
// is 64-bit.
//
// Segment table (threelc.cu section 7's rows of 8 int64 and its tiles, a tile being
// `tile` kept entries; the state rows are threelc.cu's, word 3 the error bits):
#define HVD_SPARSE_SEG_COLS 8
#define HVD_SPARSE_SEG_VALUES 0   // the body's first byte: the values (top-k + sign: m)
#define HVD_SPARSE_SEG_OUT 1      // float32 output (added into)
#define HVD_SPARSE_SEG_N 2        // elements of the output
#define HVD_SPARSE_SEG_INDICES 3  // the first index's byte
#define HVD_SPARSE_SEG_SIGNS 4    // top-k + sign: the first sign byte
#define HVD_SPARSE_SEG_K 5        // kept entries
#define HVD_SPARSE_SEG_TILE 6     // the segment's first tile (max(k, 1) entries a segment)
#define HVD_SPARSE_SEG_WIDE 7     // 1: int64 indices; 0: int32
#define HVD_SPARSE_STATE_WORDS 8
#define HVD_SPARSE_ST_ERROR 3
#define HVD_SPARSE_ERR_INDEX 1u   // an index outside [0, n)
#define HVD_SPARSE_ERR_ORDER 2u   // an index not above the one before it
#define HVD_SPARSE_ERR_VALUE 4u   // a value not finite (top-k + sign: m not finite and >= 0)
#define HVD_SPARSE_ERR_PADDING 8u // top-k + sign: a padding bit after the last sign is set

#ifndef __CUDACC__
#include "cuda_host.h"
#endif

// The segment of tile t: the last row whose first tile is <= t.
__device__ __forceinline__ long long hvd_sparse_tile_segment(const long long* seg,
                                                             long long nseg, long long t)
{
    long long lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const long long mid = (lo + hi + 1) >> 1;
        if (seg[mid * HVD_SPARSE_SEG_COLS + HVD_SPARSE_SEG_TILE] <= t) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Index j of a body (int32 or int64, little-endian, any byte offset), as int64.
__device__ __forceinline__ long long hvd_sparse_index(const unsigned char* p, long long j,
                                                      int wide)
{
    if (wide) {
        unsigned long long v = 0ull;
        for (int b = 7; b >= 0; --b) v = (v << 8) | p[8 * j + b];
        return (long long)v;
    }
    const unsigned char* q = p + 4 * j;
    return (long long)(int)((unsigned int)q[0] | ((unsigned int)q[1] << 8) |
                            ((unsigned int)q[2] << 16) | ((unsigned int)q[3] << 24));
}

// Value j of a body (float32, little-endian, any byte offset).
__device__ __forceinline__ float hvd_sparse_value(const unsigned char* p, long long j)
{
    const unsigned char* q = p + 4 * j;
    return __uint_as_float((unsigned int)q[0] | ((unsigned int)q[1] << 8) |
                           ((unsigned int)q[2] << 16) | ((unsigned int)q[3] << 24));
}

// Entry j's value: value j, or with `signs` -m or +m by sign bit j.
__device__ __forceinline__ float hvd_sparse_entry(const long long* row, long long j, int signs)
{
    const unsigned char* values = (const unsigned char*)row[HVD_SPARSE_SEG_VALUES];
    if (!signs) return hvd_sparse_value(values, j);
    const unsigned char* bits = (const unsigned char*)row[HVD_SPARSE_SEG_SIGNS];
    const float m = hvd_sparse_value(values, 0);
    return (bits[j >> 3] >> (j & 7)) & 1u ? -m : m;
}

// Each segment's body checked into its state, before any decode writes: every index in
// [0, n) and above the one before it, every value finite, or with `signs` m finite and
// >= 0 and the padding bits zero (the checks of the CPU's decoder; an error anywhere
// refuses the body, and the host words it from the per-payload decoder). grid: blocks
// loop over tiles of `tile` entries. bytes: reads (8 or 12) k, or (4 or 8) k + k / 8.
extern "C" __global__ void sparse_topk_check_segments(const long long* __restrict__ seg,
                                                      long long nseg, long long ntiles,
                                                      long long tile, int signs,
                                                      unsigned int* __restrict__ states)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const unsigned char* indices = (const unsigned char*)row[HVD_SPARSE_SEG_INDICES];
        const long long n = row[HVD_SPARSE_SEG_N], k = row[HVD_SPARSE_SEG_K];
        const int wide = (int)row[HVD_SPARSE_SEG_WIDE];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < k ? first + tile : k;
        unsigned int err = 0u;
        if (signs && first == 0 && threadIdx.x == 0) {  // once a segment, even when k = 0
            const float m = hvd_sparse_value((const unsigned char*)row[HVD_SPARSE_SEG_VALUES], 0);
            if (!(m >= 0.0f) || (__float_as_uint(m) & 0x7fffffffu) >= 0x7f800000u)
                err |= HVD_SPARSE_ERR_VALUE;
            const unsigned char* bits = (const unsigned char*)row[HVD_SPARSE_SEG_SIGNS];
            if ((k & 7) && (bits[(k - 1) >> 3] >> (k & 7))) err |= HVD_SPARSE_ERR_PADDING;
        }
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            const long long i = hvd_sparse_index(indices, j, wide);
            if (i < 0 || i >= n) err |= HVD_SPARSE_ERR_INDEX;
            if (j > 0 && hvd_sparse_index(indices, j - 1, wide) >= i) err |= HVD_SPARSE_ERR_ORDER;
            const unsigned int bits = __float_as_uint(hvd_sparse_entry(row, j, signs));
            if ((bits & 0x7fffffffu) >= 0x7f800000u) err |= HVD_SPARSE_ERR_VALUE;
        }
        if (err) atomicOr(states + s * HVD_SPARSE_STATE_WORDS + HVD_SPARSE_ST_ERROR, err);
    }
}

// out[index_j] += value_j (or -m / +m) for every entry of each checked segment (the host
// launches it for the segments before the first refused one; indices strictly increase,
// so no two threads add into one element). grid: blocks loop over tiles of `tile`
// entries. bytes: reads (8 or 12) k + 4 k, writes 4 k.
extern "C" __global__ void sparse_topk_add_segments(const long long* __restrict__ seg,
                                                    long long nseg, long long ntiles,
                                                    long long tile, int signs)
{
    for (long long t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const long long s = hvd_sparse_tile_segment(seg, nseg, t);
        const long long* row = seg + s * HVD_SPARSE_SEG_COLS;
        const unsigned char* indices = (const unsigned char*)row[HVD_SPARSE_SEG_INDICES];
        float* out = (float*)row[HVD_SPARSE_SEG_OUT];
        const long long k = row[HVD_SPARSE_SEG_K];
        const int wide = (int)row[HVD_SPARSE_SEG_WIDE];
        const long long first = (t - row[HVD_SPARSE_SEG_TILE]) * tile;
        const long long end = first + tile < k ? first + tile : k;
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            const long long i = hvd_sparse_index(indices, j, wide);
            out[i] = __fadd_rn(out[i], hvd_sparse_entry(row, j, signs));
        }
    }
}
