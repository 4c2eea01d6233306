//! Prefill/decode disaggregation: a prefill process writes each request's KV-cache blocks
//! into a decode worker's paged cache, while decode workers join and leave.
//!
//! ```text
//! cargo run --release --example kv_transfer -- [--decoders 2] [--requests 120] [--layers 8]
//!                  [--block-kib 64] [--max-blocks 16] [--inflight 8] [--deadline-ms 3000]
//!                  [--kill] [--provider tcp|shm|verbs] [--nics N] [--location host|cuda]
//! ```
//!
//! Both sides hold a **paged KV cache**: `layers x blocks` blocks of `block-kib` KiB, block
//! `b` of layer `l` at page `l * blocks + b` (as a paged-attention server lays it out). A
//! request holds 1..=`max-blocks` blocks, taken from a free list, so its block table is a
//! scattering of non-contiguous block ids on both sides. Per request the prefill process
//!
//! 1. "computes" the request's KV into its own blocks (content derived from the request id,
//!    the layer and the block's position in the request),
//! 2. takes free blocks in the chosen decode worker's cache, announces the request to it with
//!    a two-sided message (request id, immediate, arrival count, block table),
//! 3. writes every layer's blocks with **one `write_paged`** (host or GPU memory; with
//!    `--location cuda` on one host, one gate of copies through CUDA IPC) carrying the
//!    request's own immediate: one completion signal per request, whose arrival count is
//!    `engine.paged_arrivals(..)` (one per page into host memory, exactly one into GPU
//!    memory through CUDA IPC or staging; the worker checks the announced number),
//! 4. waits, with a deadline, for the worker's two messages: `got` as soon as the
//!    immediate's counter says the blocks arrived (what a decode server would start decoding
//!    on; awaited with a deadline too), then `ack` once it has checked every byte of every
//!    block (off the async runtime), after which the worker's blocks are free again.
//!
//! **Membership changes mid-run.** After a quarter of the requests a new decode worker is
//! started; it meets the prefill through the `TcpStore` (rendezvous), the prefill adds it as
//! a new peer from its new descriptor and routes to it. Halfway, worker 0 leaves: cleanly
//! (it is told to stop, drains what it was given, says goodbye and exits), or with `--kill`
//! by SIGKILL, with requests in flight. The prefill then learns of the death the way it would
//! in production: the requests routed to the dead worker fail with a typed error
//! (`PeerUnreachable` as soon as the engine reports the worker `Down`: every wait of an
//! attempt is raced against `peer_events()`, or the request deadline), the worker is taken
//! out of the routing table and those requests are re-routed to live workers. Nothing waits
//! without a deadline, and the run fails if any request is not verified in the end or if a
//! worker other than the one that left ever failed a request. A killed prefill ends every
//! worker: each takes the prefill's messages with `recv_from(prefill)` and races its counter
//! waits against the prefill's `Down`, so it exits 1 naming the prefill's peer and the error.
//!
//! Prints the request latency (p50/p99) twice: to the blocks' arrival (the `got` message:
//! announcement, transfer, counter, one message back) and to the verified `ack` (plus the
//! example's own check of every byte); GB/s three ways: over the time some request's blocks
//! were on their way (the union of every request's interval from the start of its transfer
//! to its `got`: the transfer's throughput), over the time some request was in transfer or
//! verification (to its `ack`), and over the whole run; and what the joins and leaves did to
//! the requests in flight.

mod decode;
mod prefill;

use std::time::Duration;

use clap::Parser;
use fabric_async::Engine;
use fabric_examples::{engine_builder, positive, BoxError, LocationArg, NicsArg, ProviderArg};

use decode::decode_worker;
use prefill::prefill;

/// Request `r` carries immediate `IMM_BASE + r`: one completion signal per request.
const IMM_BASE: u32 = 0x4b56_0000;
/// Attempts per request (the first, then re-routes) before it counts as failed.
const ATTEMPTS: usize = 3;
/// Rendezvous and process start-up deadline.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Prefill/decode disaggregation: one prefill process writes each request's paged KV-cache
/// blocks (one write_paged, one immediate per request) to --decoders decode processes, which
/// check every byte; mid-run a decode worker joins and one leaves (--kill: SIGKILL). Prints
/// request latency p50/p99, GB/s, and what happened to the requests in flight.
#[derive(Parser, Debug, Clone)]
#[command(name = "kv_transfer", args_override_self = true)]
struct Cli {
    #[command(flatten)]
    provider: ProviderArg,
    #[command(flatten)]
    nics: NicsArg,
    #[command(flatten)]
    location: LocationArg,
    /// Decode worker processes at the start (one more joins after a quarter of the requests,
    /// worker 0 leaves halfway).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = positive)]
    decoders: usize,
    /// Requests the prefill process sends in all.
    #[arg(long, value_name = "N", default_value_t = 120, value_parser = positive)]
    requests: usize,
    /// Transformer layers: a request writes its blocks in every layer.
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = positive)]
    layers: usize,
    /// KiB of one block in one layer (tokens per block x KV heads x head dim x 2 (K and V) x
    /// bytes per value; 16 x 8 x 128 x 2 x 2 B = 64 KiB).
    #[arg(long, value_name = "KiB", default_value_t = 64, value_parser = positive)]
    block_kib: usize,
    /// Most blocks per request; each request draws its length from 1..=this.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = positive)]
    max_blocks: usize,
    /// Requests in flight at once, over all decode workers (each cache holds this many
    /// requests of --max-blocks blocks).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = positive)]
    inflight: usize,
    /// Deadline of one attempt of a request (announce, write, verify, acknowledge), in ms; also
    /// every engine's op_timeout, after which an operation on a dead peer fails with
    /// PeerUnreachable (the library's default is 30 s).
    #[arg(long, value_name = "MS", default_value_t = 3000, value_parser = positive)]
    deadline_ms: usize,
    /// Worker 0 leaves by SIGKILL (requests in flight) instead of a clean shutdown.
    #[arg(long)]
    kill: bool,
    /// Internal: run as a decode worker for the prefill whose TcpStore is at ADDR.
    #[arg(long, value_name = "ADDR", hide = true)]
    decode_of: Option<String>,
    /// Internal: this decode worker's id.
    #[arg(long, hide = true, default_value_t = 0)]
    id: usize,
}

impl Cli {
    fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms as u64)
    }
    fn block(&self) -> usize {
        self.block_kib << 10
    }
    /// Blocks per layer in each cache: room for every request in flight at its longest.
    fn blocks(&self) -> usize {
        self.inflight * self.max_blocks
    }
    fn cache_bytes(&self) -> usize {
        self.layers * self.blocks() * self.block()
    }
    fn engine(&self) -> Result<Engine, BoxError> {
        Ok(engine_builder(&self.provider.name, self.nics.n).op_timeout(Some(self.deadline())).build()?)
    }
    /// The pages (layer-major) of a request whose block table is `table`.
    fn pages(&self, table: &[u32]) -> Vec<u32> {
        let blocks = self.blocks() as u32;
        (0..self.layers as u32).flat_map(|l| table.iter().map(move |b| l * blocks + b)).collect()
    }
    /// Blocks of request `req` (its prompt length), 1..=max_blocks.
    fn request_blocks(&self, req: u32) -> usize {
        1 + (mix(req as u64 ^ 0xb10c) % self.max_blocks as u64) as usize
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let result = match cli.decode_of.clone() {
        Some(addr) => decode_worker(cli, addr).await,
        None => prefill(cli).await,
    };
    if let Err(e) = result {
        eprintln!("kv_transfer failed: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------
// KV content: what the prefill computes and the decode worker checks.

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Word `w` of the block at position `j` of request `req`'s table in `layer`.
fn kv_word(seed: u64, w: usize) -> u64 {
    (seed ^ w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn block_seed(req: u32, layer: usize, j: usize) -> u64 {
    mix((req as u64) << 32 | (layer as u64) << 16 | j as u64)
}

fn fill_block(buf: &mut [u8], seed: u64) {
    for (w, b) in buf.chunks_exact_mut(8).enumerate() {
        b.copy_from_slice(&kv_word(seed, w).to_le_bytes());
    }
}

fn block_ok(buf: &[u8], seed: u64) -> bool {
    buf.chunks_exact(8).enumerate().all(|(w, b)| b == kv_word(seed, w).to_le_bytes())
}

/// A cache's free blocks, handed out in a shuffled order so block tables are non-contiguous.
struct FreeBlocks(Vec<u32>);

impl FreeBlocks {
    fn new(n: usize, seed: u64) -> FreeBlocks {
        let mut v: Vec<u32> = (0..n as u32).collect();
        for i in (1..v.len()).rev() {
            v.swap(i, (mix(seed ^ i as u64) % (i as u64 + 1)) as usize);
        }
        FreeBlocks(v)
    }
    fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        (self.0.len() >= n).then(|| self.0.split_off(self.0.len() - n))
    }
    fn give(&mut self, blocks: Vec<u32>) {
        self.0.extend(blocks);
    }
}
