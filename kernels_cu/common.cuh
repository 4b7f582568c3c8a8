// common.cuh — shared helpers for every kda_rt kernel: bf16 <-> fp32, warp/block reductions,
// vector loads.  Included by each kernels_cu/<op>.cu; compiled by NVRTC (kda_rt/cuda/ops/compile.py)
// with -std=c++17 and the arch of the device (sm_90a on Hopper, sm_100a on Blackwell).
#pragma once
#include <cuda_bf16.h>
// NVRTC has no libc headers: use the built-in fixed-width types (int64_t etc. come with cuda_bf16.h)

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------------------------
// conversions

__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }

// ---------------------------------------------------------------------------------------------
// reductions (all lanes / threads get the result)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum; `scratch` needs blockDim.x / 32 floats of shared memory.  Ends with a barrier
// so scratch can be reused right after.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < num_warps; ++w) total += scratch[w];
    __syncthreads();
    return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float m = -__int_as_float(0x7f800000);  // -inf (NVRTC has no math.h INFINITY)
    for (int w = 0; w < num_warps; ++w) m = fmaxf(m, scratch[w]);
    __syncthreads();
    return m;
}

// ---------------------------------------------------------------------------------------------
// math

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

// ---------------------------------------------------------------------------------------------
// varlen batches

// Index b of the sequence holding flat token t: the largest b with cu_seqlens[b] <= t.
__device__ __forceinline__ int sequence_of(const int* __restrict__ cu_seqlens, int num_seqs, int t) {
    int lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (__ldg(cu_seqlens + mid) <= t) lo = mid; else hi = mid;
    }
    return lo;
}

// 8 bf16 = 16 bytes: one vector load / store
struct __align__(16) bf16x8 { bf16 v[8]; };
