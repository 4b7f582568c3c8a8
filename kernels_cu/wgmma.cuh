// wgmma.cuh — Hopper warpgroup-MMA helpers (PTX ISA 8.0+, sm_90a only: KDA_RT_HOPPER) shared by the
// wgmma kernels (moe_gemm_wg.cu, mla_prefill_wg.cu, mla_prefill_fp8.cu): fences, commit / wait, the shared-memory matrix
// descriptor of a K-major operand tile with 128-byte rows and the 128-byte swizzle, the m64nNk16 bf16
// products (A from shared memory, or A from registers), the swizzled byte offset of a 16-byte chunk, and
// stmatrix (bf16 accumulator pairs into shared memory).
//
// Register layouts (per warp q = 0..3 of the warpgroup, lane l, g = l / 4, c = l mod 4):
//   fp32 accumulator of m64nNk16: d[4j + e] is row 16q + g + 8·(e / 2), column 8j + 2c + (e mod 2);
//   bf16 A fragment from registers (m64k16): a[0] rows 16q + g, columns 2c, 2c + 1; a[1] row + 8;
//   a[2] columns + 8; a[3] both (mma.sync m16n8k16's A layout per warp).  So accumulator n8-blocks
//   2k and 2k + 1 of one product, packed to bf16 pairs, are the A fragment of k16 slice k of the next.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && !defined(KDA_RT_HOPPER)
#error "wgmma.cuh needs sm_90a (KDA_RT_HOPPER)"
#endif

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Shared-memory matrix descriptor of a K-major operand tile with 128-byte rows and the 128-byte swizzle
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)1 << 16) | ((unsigned long long)(1024 >> 4) << 32) | ((unsigned long long)1 << 62);
}

// Operand lists of the inline PTX below: accumulators "+f"(d[b]) .. "+f"(d[b + 31]), and the register
// placeholders of 32, 64 and 128 accumulators.
#define WG_ACC8(d, b) "+f"(d[(b)]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]), "+f"(d[(b) + 5]), "+f"(d[(b) + 6]), "+f"(d[(b) + 7])
#define WG_ACC32(d, b) WG_ACC8(d, b), WG_ACC8(d, (b) + 8), WG_ACC8(d, (b) + 16), WG_ACC8(d, (b) + 24)
#define WG_REGS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS64 WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_REGS128 WG_REGS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d += A[64 x 16] · B[128 x 16]ᵀ (scale_d = 1), A and B K-major in shared memory (descriptors)
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long desc_a, unsigned long long desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC32(d, 0), WG_ACC32(d, 32)
                 : "l"(desc_a), "l"(desc_b), "r"(1));
}

// d += A[64 x 16] · B[256 x 16]ᵀ (scale_d = 1), A and B K-major in shared memory (descriptors)
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long desc_a, unsigned long long desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WG_REGS128 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC32(d, 0), WG_ACC32(d, 32), WG_ACC32(d, 64), WG_ACC32(d, 96)
                 : "l"(desc_a), "l"(desc_b), "r"(1));
}

// d += A[64 x 32] · B[128 x 32]ᵀ in e4m3 (scale_d = 1), A and B K-major in shared memory (descriptors: the same
// 128-byte rows and swizzle, a k32 slice of 32 bytes as bf16's k16; 8-bit operands take no transpose)
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], unsigned long long desc_a,
                                                      unsigned long long desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WG_REGS64 "}, %64, %65, p, 1, 1;\n}\n"
                 : WG_ACC32(d, 0), WG_ACC32(d, 32)
                 : "l"(desc_a), "l"(desc_b), "r"(1));
}

// d += A[64 x 32] · B[256 x 32]ᵀ in e4m3 (scale_d = 1), as above
__device__ __forceinline__ void wgmma_m64n256k32_e4m3(float (&d)[128], unsigned long long desc_a,
                                                      unsigned long long desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {" WG_REGS128 "}, %128, %129, p, 1, 1;\n}\n"
                 : WG_ACC32(d, 0), WG_ACC32(d, 32), WG_ACC32(d, 64), WG_ACC32(d, 96)
                 : "l"(desc_a), "l"(desc_b), "r"(1));
}

// Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled tile
__device__ __forceinline__ unsigned swz(int r, int c) { return (unsigned)(r * 128 + ((c ^ (r & 7)) << 4)); }

// d += A[64 x 16] · B[128 x 16]ᵀ with A from registers (bf16 pairs, layout above), B K-major in shared memory
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
                 : WG_ACC32(d, 0), WG_ACC32(d, 32)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// d = A[64 x 16] · B[64 x 16]ᵀ (+ d when accumulate != 0), A from registers (bf16 pairs, layout above), B
// K-major in shared memory
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long desc_b,
                                                   int accumulate = 1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_REGS32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : WG_ACC32(d, 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// d = A[64 x 32] · B[128 x 32]ᵀ in e4m3 (+ d when accumulate != 0), A from registers, B K-major in shared memory.
// The 8-bit A fragment (per warp m16k32, as mma.sync m16n8k32's): a[0] row g, bytes 4c .. 4c + 3 of the k32 slice;
// a[1] row g + 8; a[2] bytes 16 + 4c ..; a[3] both (the lowest byte the lowest k).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long desc_b,
                                                         int accumulate = 1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WG_REGS64 "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : WG_ACC32(d, 0), WG_ACC32(d, 32)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// Four 8 x 8 bf16 matrices from registers into shared memory (the accumulator layout of one n8-block
// pair above, packed to bf16 pairs): lanes 8m .. 8m + 7 name the 16-byte rows of matrix m, r[m] is
// this lane's pair of matrix m
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}

// Keeps N accumulators in registers across the asynchronous wgmma (no spill / reorder around them)
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
