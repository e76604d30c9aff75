/* bf16 <-> f32 conversion of arrays on the device, with the twins of common/dtype.h's
 * conversions (cuda_common.cuh): round to nearest even, NaN kept NaN with the quiet bit set,
 * bit for bit the host's for every input. Used where a buffer changes dtype on the device
 * (bf16 tables against f32 gradients on the wire), and by the GPU test to prove the twin. */
#include "kernels/cuda/cuda_common.cuh"

__global__ void f32_to_bf16_kernel(const float *__restrict__ in, size_t n,
                                   uint16_t *__restrict__ out) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = embps__f32_to_bf16(in[i]);
}

__global__ void bf16_to_f32_kernel(const uint16_t *__restrict__ in, size_t n,
                                   float *__restrict__ out) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = embps__bf16_to_f32(in[i]);
}

/* Grid-stride loops: 2^16 blocks of 256 threads already fill any current GPU many times. */
static unsigned blocks_for(size_t n) {
  size_t b = (n + EMBPS_CUDA_BLOCK - 1) / EMBPS_CUDA_BLOCK;
  return b < 65536 ? (unsigned)b : 65536u;
}

extern "C" embps_status_t embps_f32_to_bf16_cuda(const float *in, size_t n, uint16_t *out,
                                                 cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  if (n == 0)
    return EMBPS_OK;
  f32_to_bf16_kernel<<<blocks_for(n), EMBPS_CUDA_BLOCK, 0, stream>>>(in, n, out);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}

extern "C" embps_status_t embps_bf16_to_f32_cuda(const uint16_t *in, size_t n, float *out,
                                                 cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  if (n == 0)
    return EMBPS_OK;
  bf16_to_f32_kernel<<<blocks_for(n), EMBPS_CUDA_BLOCK, 0, stream>>>(in, n, out);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}
