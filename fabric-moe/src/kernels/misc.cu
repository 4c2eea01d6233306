// fabric-moe's kernels, part 4 of 4: the GPU barrier, the clock and the stand-in experts.

// Every rank raises its flag in every peer's window, then waits for every peer's: a barrier
// on the GPU, for timing (one block).
extern "C" __global__ void moe_barrier(const char* window, const u64* peers, u64* state, u64* status,
                                       u32 rank, u32 ranks, u64 off_bflag, u64 timeout_ns, const u64* proxy) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    u64 seq = (state[ST_BARRIER] + 1) & 0xffffffffull;
    if (threadIdx.x < ranks) {
        px_raise(peers, proxy, threadIdx.x, rank, off_bflag, PX_BARRIER, seq << 32);
        wait_seq((const u64*)(window + off_bflag) + threadIdx.x, (u32)seq, timeout_ns, &failed);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (failed) report(status, ERR_BARRIER_TIMEOUT, rank);
        state[ST_BARRIER] = seq;
    }
}

// The GPU's clock (ns) into *dst: stamps between stages, for timing without the host.
extern "C" __global__ void moe_clock(u64* dst) {
    *dst = now_ns();
    __threadfence_system();
}

// A stand-in for the experts (tests, examples): expert_out[le][i] = bf16(x_expert[le][i] *
// (1 + (e % 8) / 8)) for the rows each local expert received, e the global expert id.
extern "C" __global__ void moe_toy_experts(const char* x_expert, char* expert_out, const int* expert_count,
                                           u32 rank, u32 experts_per_rank, u32 capacity, u32 hidden) {
    u32 lane = threadIdx.x & 31;
    u32 warps = gridDim.x * (blockDim.x >> 5);
    u64 rows = (u64)experts_per_rank * capacity;
    for (u64 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        u32 le = (u32)(r / capacity), i = (u32)(r % capacity);
        if ((int)i >= expert_count[le]) continue;
        float scale = 1.0f + (float)((rank * experts_per_rank + le) % 8) / 8.0f;
        const u16* src = (const u16*)(x_expert + r * hidden * 2);
        u16* dst = (u16*)(expert_out + r * hidden * 2);
        for (u32 h = lane; h < hidden; h += 32) dst[h] = (u16)f32_to_bf16(bf16_to_f32(src[h]) * scale);
    }
}

// The stand-in experts for RecvLayout::RankMajor: for each received row (source s, slot),
// out[s][slot] = bf16(sum over the row's experts e on this rank of w_e * bf16(x * (1 + (e % 8)
// / 8))), f32 sums: what moe_toy_experts then moe_combine_send compute for the expert-major
// layout, so the combined rows are the same.
extern "C" __global__ void moe_toy_experts_rank(const char* window, char* expert_out, const int* recv_count,
                                                u32 rank, u32 ranks, u32 max_tokens, u32 k,
                                                u32 experts_per_rank, u32 hidden, u64 off_meta, u64 off_rx) {
    u32 lane = threadIdx.x & 31;
    u32 warps = gridDim.x * (blockDim.x >> 5);
    u32 meta_words = 1 + 3 * k;
    int first = (int)(rank * experts_per_rank);
    for (u64 i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); i < (u64)ranks * max_tokens; i += warps) {
        u32 s = (u32)(i / max_tokens), slot = (u32)(i % max_tokens);
        if ((int)slot >= recv_count[s]) continue;
        const int* meta = (const int*)(window + off_meta) + i * meta_words;
        const u16* src = (const u16*)(window + off_rx + i * hidden * 2);
        u16* dst = (u16*)(expert_out + i * hidden * 2);
        for (u32 h = lane; h < hidden; h += 32) {
            float x = bf16_to_f32(src[h]);
            float acc = 0.f;
            for (u32 j = 0; j < k; ++j) {
                int e = meta[1 + j];
                if (e < first || e >= first + (int)experts_per_rank) continue;
                float scale = 1.0f + (float)(e % 8) / 8.0f;
                acc += __int_as_float(meta[1 + k + j]) * bf16_to_f32(f32_to_bf16(x * scale));
            }
            dst[h] = (u16)f32_to_bf16(acc);
        }
    }
}
