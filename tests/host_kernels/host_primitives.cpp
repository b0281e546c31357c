// Host build of kernels/primitives.cu (with kernels/threelc.cu, whose quartic and zero-run
// kernels terngrad and dqsg reuse, kernels/frame.cu, whose checksum kernels every payload
// uses, the single-pass codec families kernels/sign.cu and kernels/quant.cu, and
// kernels/sparse.cu)
// through kernels/cuda_host.h, behind a small C ABI for ctypes, used by
// tests/host_kernels/test_primitive_kernels.py: direct wrappers of each primitive kernel,
// and host_launch (host_launch.h), a cuLaunchKernel-style entry for the stand-in for CuPy
// that runs hvdcompress/backends/cuda/ on the host.
//
// Build (tests/host_kernels/conftest.py): g++ with HOST_CXX_FLAGS of hvdcompress/_native.py
//     -shared -fPIC -I kernels tests/host_kernels/host_primitives.cpp -o libhost_primitives.so
#include "threelc.cu"
#include "frame.cu"
#include "primitives.cu"
#include "sign.cu"
#include "quant.cu"
#include "sparse.cu"

#include "host_launch.h"

extern "C" {

// Launch kernel `name` like cuLaunchKernel. Returns -1 for an unknown name.
int host_launch(const char* name, unsigned int grid, unsigned int block, void** params)
{
    HOST_THREELC_KERNELS
    HOST_FRAME_KERNELS
    HOST_PRIMITIVES_KERNELS
    HOST_SIGN_KERNELS
    HOST_QUANT_KERNELS
    HOST_SPARSE_KERNELS
    return -1;
}

void host_uniform(unsigned long long key, long long offset, long long n, float* out)
{
    if (n) launch(primitives_uniform, grid_for(n), g_block, key, offset, n, out);
}

void host_bitpack(const unsigned char* codes, long long n, int bits, unsigned char* out)
{
    const long long nbytes = (n * bits + 7) / 8;
    if (nbytes) launch(primitives_bitpack, grid_for(nbytes), g_block, codes, n, bits, out, nbytes);
}

// Returns the error bits (HVD_PRIM_ERR_PADDING); nbytes must be ceil(n bits / 8).
unsigned int host_bitunpack(const unsigned char* in, long long nbytes, long long n, int bits,
                            unsigned char* codes)
{
    unsigned int state[8] = {0};
    if (n) launch(primitives_bitunpack, grid_for(n), g_block, in, nbytes, n, bits, codes, state);
    return state[HVD_PRIM_ST_ERROR];
}

void host_chunk_sums(const float* x, long long n, long long chunk, int square, double* out)
{
    const long long chunks = (n + chunk - 1) / chunk;
    if (chunks) launch(primitives_chunk_sums, grid_for(chunks), g_block, x, n, chunk, square, out);
}

}  // extern "C"
