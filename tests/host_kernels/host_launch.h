// Shared by the C++ drivers of tests/host_kernels (host_threelc.cpp, host_primitives.cpp):
// the launch shape the tests set (host_set_launch), the grid a backend-style launch gets
// for a number of work items, and host_launch, a cuLaunchKernel-style entry (a pointer to
// each argument's value) that the stand-in for CuPy in tests/host_kernels/conftest.py
// calls to run hvdcompress/backends/cuda/ on the host.
//
// Include it after the kernels/*.cu sources; the driver then defines host_launch with
// the kernel lists below:
//     extern "C" int host_launch(const char* name, unsigned int grid, unsigned int block,
//                                void** params)
//     {
//         HOST_THREELC_KERNELS
//         HOST_FRAME_KERNELS
//         return -1;  // an unknown name
//     }
#ifndef HVDCOMPRESS_TESTS_HOST_LAUNCH_H
#define HVDCOMPRESS_TESTS_HOST_LAUNCH_H

#include <string.h>

#include <cstddef>
#include <type_traits>
#include <utility>

namespace {

unsigned int g_block = 256;      // threads per block (a multiple of 32, like on the GPU)
unsigned int g_max_grid = 1024;  // most blocks per launch; fewer makes threads loop

// Blocks for `work` items, at least 1, capped like the backend's (grid-stride kernels).
unsigned int grid_for(long long work)
{
    long long blocks = (work + g_block - 1) / g_block;
    if (blocks < 1) blocks = 1;
    if (blocks > g_max_grid) blocks = g_max_grid;
    return (unsigned int)blocks;
}

// cuLaunchKernel-style launch: params[i] points at the value of argument i, which must
// have exactly the parameter's type (the CUDA driver copies sizeof(parameter) bytes).
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

// The kernels of each family (hvdcompress/backends/cuda/_runtime.py: THREELC, FRAME,
// PRIMITIVES, SIGN, QUANT, SPARSE).
#define HOST_THREELC_KERNELS                  \
    HOST_KERNEL(threelc_absmax)               \
    HOST_KERNEL(threelc_quantize_quartic)     \
    HOST_KERNEL(threelc_quartic_encode)       \
    HOST_KERNEL(threelc_zre_run_starts)       \
    HOST_KERNEL(threelc_zre_flags)            \
    HOST_KERNEL(threelc_zre_scatter)          \
    HOST_KERNEL(threelc_zre_lengths)          \
    HOST_KERNEL(threelc_zre_decode_check)     \
    HOST_KERNEL(threelc_zre_expand)           \
    HOST_KERNEL(threelc_quartic_decode_scale) \
    HOST_KERNEL(threelc_quartic_decode)       \
    HOST_KERNEL(threelc_absmax_segments)      \
    HOST_KERNEL(threelc_quantize_quartic_segments) \
    HOST_KERNEL(threelc_zre_run_starts_segments)   \
    HOST_KERNEL(threelc_zre_scatter_segments)      \
    HOST_KERNEL(threelc_zre_decode_check_segments) \
    HOST_KERNEL(threelc_quartic_decode_add_segments)
#define HOST_FRAME_KERNELS                    \
    HOST_KERNEL(hvd_checksum)                 \
    HOST_KERNEL(hvd_checksum_segments)        \
    HOST_KERNEL(hvd_checksum_store)           \
    HOST_KERNEL(hvd_frame_table)              \
    HOST_KERNEL(hvd_frame_headers)            \
    HOST_KERNEL(hvd_length_prefixes)
#define HOST_PRIMITIVES_KERNELS        \
    HOST_KERNEL(primitives_uniform)    \
    HOST_KERNEL(primitives_bitpack)    \
    HOST_KERNEL(primitives_bitunpack)  \
    HOST_KERNEL(primitives_chunk_sums)

#define HOST_SIGN_KERNELS                     \
    HOST_KERNEL(sign_encode)                   \
    HOST_KERNEL(sign_ef_sums)                  \
    HOST_KERNEL(sign_ef_encode)                \
    HOST_KERNEL(sign_decode)                   \
    HOST_KERNEL(sign_encode_segments)          \
    HOST_KERNEL(sign_ef_sums_segments)         \
    HOST_KERNEL(sign_ef_encode_segments)       \
    HOST_KERNEL(sign_decode_check_segments)    \
    HOST_KERNEL(sign_decode_add_segments)
#define HOST_QUANT_KERNELS              \
    HOST_KERNEL(quant_qsgd_norms)       \
    HOST_KERNEL(quant_qsgd_encode)      \
    HOST_KERNEL(quant_qsgd_check)       \
    HOST_KERNEL(quant_qsgd_decode)      \
    HOST_KERNEL(quant_terngrad_quartic) \
    HOST_KERNEL(quant_dqsg_deltas)      \
    HOST_KERNEL(quant_dqsg_quantize)    \
    HOST_KERNEL(quant_dqsg_dequantize)          \
    HOST_KERNEL(quant_terngrad_quartic_segments) \
    HOST_KERNEL(quant_bucket_floats_segments)   \
    HOST_KERNEL(quant_packed_encode_segments)     \
    HOST_KERNEL(quant_packed_check_segments)    \
    HOST_KERNEL(quant_packed_decode_add_segments) \
    HOST_KERNEL(quant_dqsg_quartic_segments)      \
    HOST_KERNEL(quant_dqsg_deltas_check_segments) \
    HOST_KERNEL(quant_dqsg_quartic_decode_add_segments)
#define HOST_SPARSE_KERNELS                \
    HOST_KERNEL(sparse_topk_check_segments) \
    HOST_KERNEL(sparse_topk_add_segments)   \
    HOST_KERNEL(sparse_topk_finite_segments) \
    HOST_KERNEL(sparse_topk_update_segments) \
    HOST_KERNEL(sparse_topk_pick_segments)  \
    HOST_KERNEL(sparse_topk_histogram_segments) \
    HOST_KERNEL(sparse_topk_ties_segments)  \
    HOST_KERNEL(sparse_topk_keep_segments)  \
    HOST_KERNEL(sparse_topk_gather_segments) \
    HOST_KERNEL(sparse_topkq_write_segments) \
    HOST_KERNEL(quant_randomk_flags_segments) \
    HOST_KERNEL(quant_randomk_check_segments) \
    HOST_KERNEL(quant_randomk_add_segments)   \
    HOST_KERNEL(quant_randomk_count_segments) \
    HOST_KERNEL(quant_randomk_gather_segments) \
    HOST_KERNEL(quant_gspar_prepare_segments) \
    HOST_KERNEL(quant_gspar_form_segments)    \
    HOST_KERNEL(quant_gspar_round_segments)   \
    HOST_KERNEL(quant_gspar_flags_segments)   \
    HOST_KERNEL(quant_gspar_count_segments)   \
    HOST_KERNEL(quant_gspar_gather_segments)

#define HOST_KERNEL(k)                         \
    if (strcmp(name, #k) == 0) {               \
        launch_params(k, grid, block, params); \
        return 0;                              \
    }

// Sets the launch shape of the driver's backend-style launches (grid_for, g_block).
extern "C" void host_set_launch(unsigned int max_grid, unsigned int block)
{
    g_max_grid = max_grid;
    g_block = block;
}

#endif  // HVDCOMPRESS_TESTS_HOST_LAUNCH_H
