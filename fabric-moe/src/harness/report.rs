//! What one rank of the harness measured, as it travels through the store and as the
//! example and the bench print it.

use super::{pct, BATCH};

/// The 50th and 90th percentiles of a stage, in µs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pcts {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
}

impl Pcts {
    /// Of `v` (ns), nearest rank; zeros for an empty list.
    pub fn of(mut v: Vec<u64>) -> Pcts {
        Pcts { p50: pct(&mut v, 0.5), p90: pct(&mut v, 0.9) }
    }
}

/// Dispatch and combine of one pass.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassTimes {
    /// From the timing point after the barrier to the one after the dispatch.
    pub dispatch: Pcts,
    /// From the timing point after the second barrier to the one after the combine.
    pub combine: Pcts,
}

/// What one rank measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankReport {
    /// This rank.
    pub rank: usize,
    /// Its CUDA device ordinal.
    pub device: usize,
    /// The device's name.
    pub device_name: String,
    /// The engine's transport (`engine.transport()`).
    pub engine: String,
    /// The rank its lines name (the next one) and how this rank reaches it.
    pub peer: usize,
    /// `transport_to(peer)`: nvlink or proxy.
    pub to_peer: String,
    /// Rows this rank sends per step (mean over the input sets).
    pub rows: usize,
    /// Those rows' bytes, MiB.
    pub mib: f64,
    /// Steps launched back to back (the headline).
    pub back_to_back: PassTimes,
    /// Steps replayed from a CUDA graph.
    pub graph: PassTimes,
    /// Why the graph pass was timed with GPU clock kernels instead of CUDA events (`None`:
    /// events, as every other pass).
    pub graph_clocks: Option<String>,
    /// Every step checked, the GPU idle between steps.
    pub checked: PassTimes,
    /// The combine streamed (`AllToAll::streamed_combine`).
    pub streamed: bool,
    /// With [`Params::stages`](super::Params::stages): p50 of dispatch_send, dispatch_recv, combine_send,
    /// combine_recv, µs.
    pub stages: Option<[f64; 4]>,
    /// Through the proxy: its last step's time from the doorbell to its writes done, of
    /// dispatch and combine, then from the doorbell to the receive gate's opening (the
    /// arrivals there: the receive kernel may start), of dispatch and combine, µs (negative:
    /// no receive gates).
    pub proxy: Option<[f64; 4]>,
    /// Through the proxy: the engine's CUDA copy gates (its writes through CUDA IPC), their
    /// count and, per gate, µs of plan, hand-over, enqueue, copy and signal
    /// (`fabric_async::GpuStats`).
    pub gates: Option<[f64; 6]>,
}

impl RankReport {
    /// The lines the example prints for this rank (`prog`: the program's name).
    pub fn lines(&self, prog: &str) -> String {
        let (rank, peer, to, dev) = (self.rank, self.peer, &self.to_peer, self.device);
        let pass = |name: &str, t: &PassTimes, note: &str| {
            format!(
                "{prog}: rank {rank} (cuda:{dev}, {to} to rank {peer}): {name} dispatch p50 {:7.1} us  p90 {:7.1} us   combine p50 {:7.1} us  p90 {:7.1} us   ({note})",
                t.dispatch.p50, t.dispatch.p90, t.combine.p50, t.combine.p90
            )
        };
        let mut s = [
            pass(
                "back to back:",
                &self.back_to_back,
                &format!(
                    "{} rows = {:.2} MiB sent per step{}",
                    self.rows,
                    self.mib,
                    if self.streamed { ", combine streamed" } else { "" }
                ),
            ),
            pass(
                "CUDA graph:  ",
                &self.graph,
                &match &self.graph_clocks {
                    None => format!("batches of {BATCH} steps captured once and replayed"),
                    Some(why) => format!("batches of {BATCH} steps replayed, timed by GPU clocks: {why}"),
                },
            ),
            pass("checked:     ", &self.checked, "every step checked, the GPU idle between steps"),
        ]
        .join("\n");
        if let Some([d, c, gd, gc]) = self.proxy {
            s += &format!("   proxy (last step, doorbell to done): dispatch {d:.1} us, combine {c:.1} us");
            if gd >= 0.0 && gc >= 0.0 {
                s += &format!("; to receive gate open: dispatch {gd:.1} us, combine {gc:.1} us");
            }
        }
        if let Some([n, plan, handoff, enqueue, copy, signal]) = self.gates {
            s += &format!(
                "\n{prog}: rank {rank} (cuda:{dev}): the engine's {n} copy gates, per gate: plan {plan:.1} us, hand-over {handoff:.1} us, enqueue {enqueue:.1} us, copy {copy:.1} us, signal {signal:.1} us"
            );
        }
        if let Some([ds, dr, cs, cr]) = self.stages {
            s += &format!(
                "\n{prog}: rank {rank} (cuda:{dev}): stages p50: dispatch_send {ds:6.1} us  dispatch_recv {dr:6.1} us  combine_send {cs:6.1} us  combine_recv {cr:6.1} us   (a GPU clock kernel between stages)"
            );
        }
        s
    }

    /// The report as text for the store (`key value` lines).
    pub fn encode(&self) -> String {
        let f = |p: &PassTimes| {
            format!("{} {} {} {}", p.dispatch.p50, p.dispatch.p90, p.combine.p50, p.combine.p90)
        };
        let list = |v: &[f64]| v.iter().map(f64::to_string).collect::<Vec<_>>().join(" ");
        let mut s = format!(
            "rank {}\ndevice {}\npeer {}\nrows {}\nmib {}\nto_peer {}\nengine {}\ndevice_name {}\nback_to_back {}\ngraph {}\nchecked {}\n",
            self.rank,
            self.device,
            self.peer,
            self.rows,
            self.mib,
            self.to_peer,
            self.engine.replace('\n', " "),
            self.device_name.replace('\n', " "),
            f(&self.back_to_back),
            f(&self.graph),
            f(&self.checked)
        );
        if let Some(v) = self.stages {
            s += &format!("stages {}\n", list(&v));
        }
        if let Some(v) = self.proxy {
            s += &format!("proxy {}\n", list(&v));
        }
        if let Some(v) = self.gates {
            s += &format!("gates {}\n", list(&v));
        }
        if let Some(why) = &self.graph_clocks {
            s += &format!("graph_clocks {}\n", why.replace('\n', " "));
        }
        if self.streamed {
            s += "streamed 1\n";
        }
        s
    }

    /// Reads [`RankReport::encode`]'s text back.
    pub fn decode(text: &str) -> Result<RankReport, String> {
        let mut r = RankReport::default();
        let nums = |k: &str, v: &str, n: usize| -> Result<Vec<f64>, String> {
            let x: Vec<f64> =
                v.split(' ').map(str::parse).collect::<Result<_, _>>().map_err(|_| bad(k, v))?;
            if x.len() == n {
                Ok(x)
            } else {
                Err(bad(k, v))
            }
        };
        let pass = |k: &str, v: &str| -> Result<PassTimes, String> {
            let x = nums(k, v, 4)?;
            Ok(PassTimes { dispatch: Pcts { p50: x[0], p90: x[1] }, combine: Pcts { p50: x[2], p90: x[3] } })
        };
        let mut seen = 0;
        for line in text.lines().filter(|l| !l.is_empty()) {
            let (k, v) = line.split_once(' ').unwrap_or((line, ""));
            let count = || v.parse::<usize>().map_err(|_| bad(k, v));
            match k {
                "rank" => r.rank = count()?,
                "device" => r.device = count()?,
                "peer" => r.peer = count()?,
                "rows" => r.rows = count()?,
                "mib" => r.mib = v.parse().map_err(|_| bad(k, v))?,
                "to_peer" => r.to_peer = v.into(),
                "engine" => r.engine = v.into(),
                "device_name" => r.device_name = v.into(),
                "back_to_back" => r.back_to_back = pass(k, v)?,
                "graph" => r.graph = pass(k, v)?,
                "checked" => r.checked = pass(k, v)?,
                "stages" => {
                    let x = nums(k, v, 4)?;
                    r.stages = Some([x[0], x[1], x[2], x[3]]);
                    continue;
                }
                "proxy" => {
                    let x = nums(k, v, 4)?;
                    r.proxy = Some([x[0], x[1], x[2], x[3]]);
                    continue;
                }
                "gates" => {
                    let x = nums(k, v, 6)?;
                    r.gates = Some([x[0], x[1], x[2], x[3], x[4], x[5]]);
                    continue;
                }
                "graph_clocks" => {
                    r.graph_clocks = Some(v.into());
                    continue;
                }
                "streamed" => {
                    r.streamed = v == "1";
                    continue;
                }
                _ => return Err(format!("unknown key {k:?} in a rank's report")),
            }
            seen += 1;
        }
        if seen < 11 {
            return Err(format!("a rank's report has {seen} of its 11 fields"));
        }
        Ok(r)
    }
}

fn bad(k: &str, v: &str) -> String {
    format!("bad {k} {v:?} in a rank's report")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_travel_and_print_as_before() {
        let t = |a: f64| PassTimes {
            dispatch: Pcts { p50: a, p90: a + 1.0 },
            combine: Pcts { p50: a + 2.0, p90: a + 3.0 },
        };
        let mut r = RankReport {
            rank: 1,
            device: 1,
            device_name: "NVIDIA H200".into(),
            engine: "shm".into(),
            peer: 0,
            to_peer: "nvlink".into(),
            rows: 255,
            mib: 3.49,
            back_to_back: t(39.25),
            graph: t(35.0),
            graph_clocks: None,
            checked: t(42.5),
            streamed: false,
            stages: None,
            proxy: None,
            gates: None,
        };
        assert_eq!(RankReport::decode(&r.encode()), Ok(r.clone()));
        let lines = r.lines("moe_gpu");
        assert!(lines.starts_with(
            "moe_gpu: rank 1 (cuda:1, nvlink to rank 0): back to back: dispatch p50    39.2 us  p90    40.2 us   combine p50    41.2 us  p90    42.2 us   (255 rows = 3.49 MiB sent per step)\n"
        ), "{lines}");
        assert_eq!(lines.lines().count(), 3);
        r.stages = Some([1.0, 2.0, 3.0, 4.5]);
        r.proxy = Some([10.0, 20.5, -1.0, -1.0]);
        assert_eq!(RankReport::decode(&r.encode()), Ok(r.clone()));
        let lines = r.lines("moe_gpu");
        assert!(lines.contains("proxy (last step, doorbell to done): dispatch 10.0 us, combine 20.5 us\n"));
        assert!(!lines.contains("receive gate"), "no gates, no gate times");
        r.proxy = Some([10.0, 20.5, 150.25, 90.0]);
        assert_eq!(RankReport::decode(&r.encode()), Ok(r.clone()));
        let lines = r.lines("moe_gpu");
        assert!(lines.contains(
            "proxy (last step, doorbell to done): dispatch 10.0 us, combine 20.5 us; to receive gate open: dispatch 150.2 us, combine 90.0 us"
        ));
        assert!(lines.lines().nth(3).unwrap().contains("stages p50: dispatch_send    1.0 us"));
        r.gates = Some([4.0, 1.5, 2.5, 3.5, 900.25, 2.0]);
        assert_eq!(RankReport::decode(&r.encode()), Ok(r.clone()));
        assert!(r.lines("moe_gpu").contains(
            "the engine's 4 copy gates, per gate: plan 1.5 us, hand-over 2.5 us, enqueue 3.5 us, copy 900.2 us, signal 2.0 us"
        ));
        r.graph_clocks = Some("no timing in graphs".into());
        assert_eq!(RankReport::decode(&r.encode()), Ok(r.clone()));
        assert!(r.lines("moe_gpu").contains("replayed, timed by GPU clocks: no timing in graphs"));
        r.streamed = true;
        assert_eq!(RankReport::decode(&r.encode()), Ok(r.clone()));
        assert!(r.lines("moe_gpu").contains("MiB sent per step, combine streamed)"));
        assert!(RankReport::decode("rank 1\n").is_err());
        assert!(RankReport::decode(&r.encode().replace("graph 35", "graph x")).is_err());
    }
}
