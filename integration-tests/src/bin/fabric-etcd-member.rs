//! A member process of the etcd test (`tests/etcd.rs`): finds the test through etcd only.
//!
//! `fabric-etcd-member ENDPOINT PREFIX NAME PROVIDER SIZE WRITES SEED`: connects an
//! `EtcdStore` under PREFIX (lease TTL 2 s), registers SIZE bytes and joins as member NAME
//! with the region's descriptor. Waits (30 s at most) for WRITES arrivals of immediate 7,
//! checks every byte against pattern SEED and puts `done/NAME` (`ok` or what was wrong).
//! Then waits for the key `exit` (60 s at most) and leaves (revoking its lease). A member
//! the test kills leaves by lease expiry instead.

use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, EtcdOptions, EtcdStore};
use integration_tests::pattern_byte;

const IMM: u32 = 7;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [endpoint, prefix, name, provider, size, writes, seed] = &args[..] else {
        eprintln!("usage: fabric-etcd-member ENDPOINT PREFIX NAME PROVIDER SIZE WRITES SEED");
        std::process::exit(2);
    };
    let (Ok(size), Ok(writes), Ok(seed)) =
        (size.parse::<usize>(), writes.parse::<u64>(), seed.parse::<u64>())
    else {
        eprintln!("SIZE, WRITES and SEED must be numbers");
        std::process::exit(2);
    };
    if let Err(e) = run(endpoint, prefix, name, provider, size, writes, seed).await {
        eprintln!("fabric-etcd-member {name}: {e}");
        std::process::exit(1);
    }
}

async fn run(
    endpoint: &str,
    prefix: &str,
    name: &str,
    provider: &str,
    size: usize,
    writes: u64,
    seed: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let opts = EtcdOptions::default().lease_ttl(Duration::from_secs(2)).get_timeout(Duration::from_secs(60));
    let store = EtcdStore::connect(&[endpoint], prefix, opts).await?;
    let engine = Engine::builder().provider(provider).build()?;
    let region = engine.alloc(size).await?;
    store.join(name, region.descriptor().to_bytes()).await?;
    let counter = engine.imm_counter(IMM);
    let verdict = match tokio::time::timeout(Duration::from_secs(30), counter.wait_for(writes)).await {
        Err(_) => format!("only {} of {writes} arrivals within 30 s", counter.total_arrived()),
        Ok(Err(e)) => format!("waiting for arrivals: {e}"),
        Ok(Ok(())) => {
            let mut bytes = vec![0u8; size];
            region.read_at(0, &mut bytes)?;
            match bytes.iter().enumerate().find(|(i, b)| **b != pattern_byte(seed, *i as u64)) {
                Some((i, b)) => format!("byte {i} is {b:#x}, expected {:#x}", pattern_byte(seed, i as u64)),
                None => "ok".into(),
            }
        }
    };
    store.put(&format!("done/{name}"), verdict.clone().into_bytes()).await?;
    store.get("exit").await?;
    store.leave().await?;
    engine.shutdown();
    if verdict == "ok" {
        Ok(())
    } else {
        Err(verdict.into())
    }
}
