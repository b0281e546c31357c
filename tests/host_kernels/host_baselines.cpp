// Host build of kernels/baselines.cu (with kernels/threelc.cu, whose quartic and zero-run
// kernels terngrad and dqsg reuse) through kernels/cuda_host.h, behind a small C ABI for
// ctypes, used by tests/test_host_kernels_baselines.py: direct wrappers of each kernel, and
// host_launch, a cuLaunchKernel-style entry for the stand-in for CuPy that runs
// hvdcompress/backends/cuda.py on the host.
//
// Build: g++ -std=c++17 -O2 -ffp-contract=off -shared -fPIC -I kernels
//            tests/host_kernels/host_baselines.cpp -o libhost_baselines.so
#include "threelc.cu"
#include "baselines.cu"

#include <stdint.h>

#include <type_traits>
#include <utility>

namespace {

unsigned int g_block = 256;
unsigned int g_max_grid = 1024;

unsigned int grid_for(long long work)
{
    long long blocks = (work + g_block - 1) / g_block;
    if (blocks < 1) blocks = 1;
    if (blocks > g_max_grid) blocks = g_max_grid;
    return (unsigned int)blocks;
}

template <typename... P, size_t... I>
void launch_params(void (*k)(P...), unsigned int grid, unsigned int block, void** params,
                   std::index_sequence<I...>)
{
    launch(k, grid, block, *static_cast<std::remove_reference_t<P>*>(params[I])...);
}

template <typename... P>
void launch_params(void (*k)(P...), unsigned int grid, unsigned int block, void** params)
{
    launch_params(k, grid, block, params, std::index_sequence_for<P...>{});
}

}  // namespace

extern "C" {

int host_launch(const char* name, unsigned int grid, unsigned int block, void** params)
{
#define HOST_KERNEL(k)                         \
    if (strcmp(name, #k) == 0) {               \
        launch_params(k, grid, block, params); \
        return 0;                              \
    }
    HOST_KERNEL(threelc_absmax)
    HOST_KERNEL(threelc_quantize_quartic)
    HOST_KERNEL(threelc_quartic_encode)
    HOST_KERNEL(threelc_zre_run_starts)
    HOST_KERNEL(threelc_zre_flags)
    HOST_KERNEL(threelc_zre_scatter)
    HOST_KERNEL(threelc_zre_lengths)
    HOST_KERNEL(threelc_zre_decode_check)
    HOST_KERNEL(threelc_zre_expand)
    HOST_KERNEL(threelc_quartic_decode_scale)
    HOST_KERNEL(threelc_quartic_decode)
    HOST_KERNEL(hvd_checksum)
    HOST_KERNEL(hvd_bl_uniform)
    HOST_KERNEL(hvd_bl_bitpack)
    HOST_KERNEL(hvd_bl_bitunpack)
    HOST_KERNEL(hvd_bl_chunk_sums)
#undef HOST_KERNEL
    return -1;
}

void host_set_launch(unsigned int max_grid, unsigned int block)
{
    g_max_grid = max_grid;
    g_block = block;
}

void host_uniform(unsigned long long key, long long offset, long long n, float* out)
{
    if (n) launch(hvd_bl_uniform, grid_for(n), g_block, key, offset, n, out);
}

void host_bitpack(const unsigned char* codes, long long n, int bits, unsigned char* out)
{
    const long long nbytes = (n * bits + 7) / 8;
    if (nbytes) launch(hvd_bl_bitpack, grid_for(nbytes), g_block, codes, n, bits, out, nbytes);
}

// Returns the error bits (HVD_BL_ERR_PADDING); nbytes must be ceil(n bits / 8).
unsigned int host_bitunpack(const unsigned char* in, long long nbytes, long long n, int bits,
                            unsigned char* codes)
{
    unsigned int state[8] = {0};
    if (n) launch(hvd_bl_bitunpack, grid_for(n), g_block, in, nbytes, n, bits, codes, state);
    return state[HVD_BL_ST_ERROR];
}

void host_chunk_sums(const float* x, long long n, long long chunk, int square, double* out)
{
    const long long chunks = (n + chunk - 1) / chunk;
    if (chunks) launch(hvd_bl_chunk_sums, grid_for(chunks), g_block, x, n, chunk, square, out);
}

}  // extern "C"
