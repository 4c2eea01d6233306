//! What an idle engine costs: `Event` mode sleeps (under 5% of a core), `BusyPoll` spins
//! (about one core). Alone in its own test binary so nothing else runs in the process.

use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, ReactorMode};
use integration_tests::{get, process_cpu_time, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");
const IDLE: Duration = Duration::from_secs(2);

async fn idle_cpu(mode: ReactorMode) -> f64 {
    let (_server, store, addr) = store().await;
    let mut peer = Peer::spawn(PEER, addr, "tcp", &["target", "--size", "4096", "--wait", "3=1"]);
    let engine = Engine::builder().provider("tcp").mode(mode).build().expect("engine");
    let src = engine.alloc(4096).await.unwrap();
    let dst = engine.remote_region(&get(&store, "target/desc").await).await.unwrap();
    // A real transfer first, so the connection exists and the engine has done work.
    engine.write_imm(&src, 0, &dst, 0, 4096, 3).await.expect("write");
    get(&store, "target/hash").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = process_cpu_time();
    tokio::time::sleep(IDLE).await;
    let used = process_cpu_time() - before;
    store.put("target/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)));
    drop(engine);
    used.as_secs_f64() / IDLE.as_secs_f64()
}

#[tokio::test(flavor = "current_thread")]
async fn event_mode_sleeps_and_busy_poll_spins() {
    let event = idle_cpu(ReactorMode::Event).await;
    eprintln!("idle CPU, Event mode: {:.2}% of one core", event * 100.0);
    assert!(event < 0.05, "Event mode burned {:.1}% of a core while idle", event * 100.0);
    let busy = idle_cpu(ReactorMode::BusyPoll).await;
    eprintln!("idle CPU, BusyPoll mode: {:.0}% of one core", busy * 100.0);
    assert!(busy > 0.6, "BusyPoll should spin about one core, used {:.0}%", busy * 100.0);
}
