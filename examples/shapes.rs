//! The transfer shapes over several NICs, one by one, with the arrivals each produces.
//!
//! ```text
//! cargo run --release --example shapes -- [--provider tcp|shm|verbs] [--nics N] [--iters N]
//! cargo run --release --example shapes -- --help    # every option, with its default
//! ```
//!
//! Three engines in this process stand for three GPUs' engines (on libfabric each NIC is its
//! own endpoint on loopback; with `--provider verbs:rxe0,rxe1` they are real devices). The
//! sender shows: a sharded `write_imm`, a paged write (KV-cache blocks), a scatter to a peer
//! group, a barrier and an RDMA read; each receiver waits for exactly the arrivals the
//! arrival functions promised and checks the bytes. Last, the latency of one write_imm (sent,
//! landed and counted at the target) with one arrival per shard against exactly one arrival
//! (`Arrivals::One`: data shards, then an imm-only write once they completed).

use std::time::{Duration, Instant};

use clap::Parser;
use fabric_async::{Engine, MemoryRegion, PageLayout, RemoteRegion, ScatterEntry, TransferOpts};
use fabric_examples::{wait_arrivals, BoxError, ProviderArg};

/// The transfer shapes over several NICs, one by one, with the arrivals each produces.
///
/// Three engines in this process (a sender and two receivers), each with --nics NICs: a
/// sharded write_imm, a paged write, a scatter to two peers, a barrier and an RDMA read, every
/// arrival count and byte checked; then the latency of one write_imm with one arrival per
/// shard against exactly one arrival. docs/transfers.md explains the output.
#[derive(Parser, Debug)]
#[command(name = "shapes", args_override_self = true)]
struct Opts {
    #[command(flatten)]
    provider: ProviderArg,
    /// NICs per engine: domains of the provider standing for N NICs (ignored when the
    /// provider names its devices, as in verbs:DEV0,DEV1).
    #[arg(long, value_name = "N", default_value_t = 2)]
    nics: usize,
    /// Timed write_imm operations per latency figure (each until counted at the target; the
    /// median is printed).
    #[arg(long, value_name = "N", default_value_t = 200)]
    iters: usize,
}

fn engine(o: &Opts) -> Result<Engine, BoxError> {
    let b = Engine::builder().provider(&o.provider.name);
    // `verbs:dev0,dev1` names the NICs; elsewhere N domains stand for N NICs.
    let b = if o.provider.name.contains(',') { b } else { b.domains(o.nics) };
    Ok(b.build()?)
}

async fn remote(from: &Engine, r: &MemoryRegion) -> Result<RemoteRegion, BoxError> {
    Ok(from.remote_region(&r.descriptor().to_bytes()).await?)
}

/// Waits for `n` arrivals of `imm` (with a timeout, so a lost one is an error, not a hang).
async fn arrivals(e: &Engine, imm: u32, n: u64) -> Result<(), BoxError> {
    wait_arrivals(&e.imm_counter(imm), n, Duration::from_secs(30)).await
}

fn check(what: &str, ok: bool) -> Result<(), BoxError> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: bytes differ").into())
    }
}

fn byte(i: u64) -> u8 {
    (i.wrapping_mul(31) >> 3) as u8
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    let o = Opts::parse();
    let (a, b, c) = (engine(&o)?, engine(&o)?, engine(&o)?);
    println!(
        "3 engines on {} with {} NIC(s) each; defaults {:?}",
        a.transport(),
        a.nics(),
        a.transfer_opts()
    );

    let len = 8 << 20;
    let src = a.register_copy((0..len as u64).map(byte).collect()).await?;
    let on_b = b.alloc(len).await?;
    let on_c = c.alloc(len).await?;
    let (rb, rc) = (remote(&a, &on_b).await?, remote(&a, &on_c).await?);

    // 1. One write, cut into 1 MiB shards over the NICs: one arrival per shard...
    let n = a.write_arrivals(&rb, len as u64)?;
    a.write_imm(&src, 0, &rb, 0, len as u64, 1).await?;
    arrivals(&b, 1, n).await?;
    check("write_imm", on_b.to_vec() == src.to_vec())?;
    println!("write_imm      8 MiB sharded:                 {n} arrival(s) of imm 1");
    // ...or exactly one, whatever the sharding.
    let one = a.with(TransferOpts::default().one_arrival());
    let n = one.write_arrivals(&rb, len as u64)?;
    one.write_imm(&src, 0, &rb, 0, len as u64, 2).await?;
    arrivals(&b, 2, n).await?;
    println!("write_imm      8 MiB, Arrivals::One:          {n} arrival(s) of imm 2");

    // 2. Paged write: KV-cache blocks 3, 9, 4 of the source into blocks 0, 1, 7 of the target.
    let layout = PageLayout::packed(64 << 10);
    let (sp, dp) = ([3u32, 9, 4], [0u32, 1, 7]);
    let n = a.paged_arrivals(&rc, sp.len())?;
    a.write_paged(&src, &rc, &layout, &sp, &dp, Some(3)).await?;
    arrivals(&c, 3, n).await?;
    let got = on_c.to_vec();
    for (s, d) in sp.iter().zip(dp) {
        let (s, d) = (*s as usize * (64 << 10), d as usize * (64 << 10));
        check("paged", got[d..d + (64 << 10)] == src.to_vec()[s..s + (64 << 10)])?;
    }
    println!("write_paged    3 blocks of 64 KiB:            {n} arrival(s) of imm 3");

    // 3. Scatter: different pieces of one region to two peers.
    let group = a.peer_group(vec![rb.clone(), rc.clone()])?;
    let entries = [
        ScatterEntry { member: 0, src_off: 0, dst_off: 0, len: 3 << 20 },
        ScatterEntry { member: 1, src_off: 3 << 20, dst_off: 0, len: 2 << 20 },
    ];
    let per_member = a.scatter_arrivals(&group, &entries)?;
    a.scatter(&src, &group, &entries, Some(4)).await?;
    arrivals(&b, 4, per_member[0]).await?;
    arrivals(&c, 4, per_member[1]).await?;
    println!("scatter        3 MiB to b, 2 MiB to c:       {per_member:?} arrival(s) of imm 4");

    // 4. Barrier: one imm-only write to every member.
    a.barrier(&group, 5).await?;
    arrivals(&b, 5, 1).await?;
    arrivals(&c, 5, 1).await?;
    println!("barrier        to b and c:                    1 arrival of imm 5 each");

    // 5. RDMA read: pull c's first 2 MiB back, sharded over the NICs.
    let back = a.alloc(2 << 20).await?;
    a.read(&back, 0, &rc, 0, 2 << 20).await?;
    check("read", back.to_vec() == on_c.to_vec()[..2 << 20])?;
    println!("read           2 MiB from c:                  no arrivals (one-sided)");

    // 6. What exactly one arrival costs: write_imm until the target has counted it.
    println!(
        "\nlatency of write_imm until counted at the target, median of {} ({} NICs):",
        o.iters,
        a.nics()
    );
    for size in [64u64 << 10, 4 << 20] {
        let mut row = Vec::new();
        for (name, opts) in [
            ("per shard", TransferOpts::sharded(1 << 20)),
            ("one", TransferOpts::sharded(1 << 20).one_arrival()),
        ] {
            let t = a.with(opts);
            let n = t.write_arrivals(&rb, size)?;
            let counter = b.imm_counter(100);
            let mut samples = Vec::with_capacity(o.iters);
            for _ in 0..o.iters {
                let t0 = Instant::now();
                t.write_imm(&src, 0, &rb, 0, size, 100).await?;
                wait_arrivals(&counter, n, Duration::from_secs(30)).await?;
                samples.push(t0.elapsed());
            }
            samples.sort();
            row.push(format!(
                "{name} ({n} arrival(s)) {:>8.1} us",
                samples[samples.len() / 2].as_secs_f64() * 1e6
            ));
        }
        println!("  {:>5} KiB: {}", size >> 10, row.join("   "));
    }
    println!("every byte verified");
    Ok(())
}
