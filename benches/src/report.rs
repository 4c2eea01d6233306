//! Results: the aligned table, the JSON file and the bandwidth plot.

use std::path::Path;

use plotters::prelude::*;
use serde_json::{json, Map, Value};

use crate::pattern::Pattern;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One measured figure beside its baseline. `unit` names the JSON keys
/// (`engine_<unit>`, `baseline_<unit>`).
#[derive(Debug, Clone)]
pub struct Row {
    test: String,
    case: String,
    size: Option<usize>,
    unit: &'static str,
    engine: f64,
    baseline: Option<(String, f64)>,
    /// Further ceilings measured beside the row (JSON `ceilings_<unit>`: name → value).
    ceilings: Vec<(&'static str, f64)>,
    /// bw: the access pattern (`--buffer`).
    pattern: Option<Pattern>,
    /// bw: the engine's domain count (`--domains`).
    domains: Option<usize>,
    /// The fabtests figure beside the row (columns fabtests, engine/ft, raw/ft), or why not.
    fabtests: Option<FtRef>,
    /// A row that is the median of per-round figures: how they spread.
    rounds: Option<Rounds>,
    /// Further JSON keys of the row (`moe`: `p90_us`, `shape`, `transport`, ...).
    fields: Vec<(&'static str, Value)>,
}

/// Per-round figures (bw's and rtt's engine/raw ratios) summarised: how many, the 95%
/// confidence interval of their median (`measure::median_ci`; from 6 rounds) and their range.
/// JSON: `rounds`, `ci95` (`[lo, hi]` or null), `range` (`[lo, hi]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rounds {
    pub n: usize,
    pub ci: Option<(f64, f64)>,
    pub range: (f64, f64),
}

impl Rounds {
    /// The median of `v` (non-empty) and how `v` spreads.
    pub fn of(v: &[f64]) -> (f64, Rounds) {
        let (m, lo, hi) = crate::measure::spread(v);
        (m, Rounds { n: v.len(), ci: crate::measure::median_ci(v), range: (lo, hi) })
    }

    /// `95% CI a-b, range c-d` (no CI under 6 rounds), for a row's label.
    pub fn label(&self) -> String {
        let (lo, hi) = self.range;
        match self.ci {
            Some((a, b)) => format!("95% CI {a:.2}-{b:.2}, range {lo:.2}-{hi:.2}"),
            None => format!("range {lo:.2}-{hi:.2}"),
        }
    }
}

/// The fabtests reference of a row.
#[derive(Debug, Clone, PartialEq)]
pub enum FtRef {
    /// `tool` (the command, short) measured `v` in the row's unit.
    Value { tool: String, v: f64 },
    /// Not run: why (`skipped: no --fabtests DIR`).
    Skipped(String),
}

impl Row {
    pub fn new(test: &str, case: &str, unit: &'static str, engine: f64) -> Row {
        Row {
            test: test.into(),
            case: case.into(),
            size: None,
            unit,
            engine,
            baseline: None,
            ceilings: Vec::new(),
            pattern: None,
            domains: None,
            fabtests: None,
            rounds: None,
            fields: Vec::new(),
        }
    }

    /// A further JSON key of this row (not in the table).
    pub fn field(mut self, key: &'static str, v: Value) -> Row {
        self.fields.push((key, v));
        self
    }

    /// This row's figure is the median of per-round figures that spread as `r` says.
    pub fn rounds(mut self, r: Rounds) -> Row {
        self.rounds = Some(r);
        self
    }

    pub fn pattern(mut self, p: Pattern) -> Row {
        self.pattern = Some(p);
        self
    }

    pub fn domains(mut self, n: usize) -> Row {
        self.domains = Some(n);
        self
    }

    /// The fabtests figure (or why there is none) beside this row.
    pub fn fabtests(mut self, f: FtRef) -> Row {
        self.fabtests = Some(f);
        self
    }

    /// The raw loop's figure: the baseline when it is the raw loop.
    fn raw(&self) -> Option<f64> {
        self.baseline.as_ref().filter(|(n, _)| n == "raw").map(|(_, v)| *v)
    }

    /// (engine / fabtests, raw / fabtests), where there is a fabtests figure.
    fn ft_ratios(&self) -> (Option<f64>, Option<f64>) {
        let Some(FtRef::Value { v, .. }) = &self.fabtests else { return (None, None) };
        let r = |x: f64| Some(x / v).filter(|r| r.is_finite());
        (r(self.engine), self.raw().and_then(r))
    }

    pub fn size(mut self, size: usize) -> Row {
        self.size = Some(size);
        self
    }

    pub fn baseline(mut self, name: &str, v: f64) -> Row {
        self.baseline = Some((name.into(), v));
        self
    }

    /// A further ceiling of this row (the baseline is the one its ratio is against).
    pub fn ceiling(mut self, name: &'static str, v: f64) -> Row {
        self.ceilings.push((name, v));
        self
    }

    fn ratio(&self) -> Option<f64> {
        self.baseline.as_ref().map(|(_, b)| self.engine / b).filter(|r| r.is_finite())
    }
}

pub struct Report {
    provider: String,
    rows: Vec<Row>,
    raw_rate: Option<f64>,
    /// The engines' `await_linger` budget, in µs (0: they park at once).
    linger_us: u64,
    /// The engines' `poll_window`, in µs (0: their reactors sleep at once when idle).
    poll_window_us: u64,
}

fn unit_label(u: &str) -> &str {
    match u {
        "gbps" => "Gbit/s",
        "us" => "us",
        "ops_per_s" => "ops/s",
        "cpu_pct" => "% core",
        "kib" => "KiB",
        "bytes" => "B",
        other => other,
    }
}

fn fmt(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() >= 100_000.0 {
        format!("{:.0}", v)
    } else if v.abs() >= 100.0 {
        format!("{:.1}", v)
    } else if v.abs() >= 1.0 || v == 0.0 {
        format!("{:.2}", v)
    } else {
        // Three significant digits at least (Soft-RoCE in the VM moves ~0.1-0.4 Gbit/s).
        format!("{:.3}", v)
    }
}

impl Report {
    pub fn new(provider: &str) -> Report {
        Report {
            provider: provider.into(),
            rows: Vec::new(),
            raw_rate: None,
            linger_us: 0,
            poll_window_us: 0,
        }
    }

    /// The engines' `await_linger` budget (zero: their futures park at once).
    pub fn set_linger(&mut self, d: std::time::Duration) {
        self.linger_us = d.as_micros() as u64;
    }

    /// The engines' `poll_window` (zero: their reactors sleep at once when idle).
    pub fn set_poll_window(&mut self, d: std::time::Duration) {
        self.poll_window_us = d.as_micros() as u64;
    }

    pub fn push(&mut self, r: Row) {
        self.rows.push(r);
    }

    pub fn set_raw_rate(&mut self, v: f64) {
        self.raw_rate = Some(v);
    }

    pub fn raw_rate(&self) -> Option<f64> {
        self.raw_rate
    }

    pub fn has_bw(&self) -> bool {
        self.bw_rows().count() > 1
    }

    fn bw_rows(&self) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(|r| {
            r.test == "bw" && r.baseline.as_ref().is_some_and(|(n, _)| n == "raw") && r.size.is_some()
        })
    }

    /// The engine figure of the row `test`/`case`.
    pub fn engine_of(&self, test: &str, case: &str) -> Option<f64> {
        self.rows.iter().find(|r| r.test == test && r.case == case).map(|r| r.engine)
    }

    /// The engine's bandwidth at `size` from the sweep (or the nearest size above it): a
    /// one-domain row, `hot` where there is one (iperf3 sends from one buffer too).
    pub fn bw_at(&self, size: usize) -> Option<f64> {
        let rows = || self.bw_rows().filter(|r| r.size >= Some(size) && r.domains.unwrap_or(1) == 1);
        let hot = rows().filter(|r| r.pattern == Some(Pattern::Hot)).min_by_key(|r| r.size);
        hot.or_else(|| rows().min_by_key(|r| r.size)).map(|r| r.engine)
    }

    /// The engine's bandwidth of the sweep's row at exactly `size`, `pattern` and `domains`
    /// (a row beside the raw loop): what `bw --peer` compares its host rows with.
    pub fn bw_engine(&self, size: usize, pattern: Pattern, domains: usize) -> Option<f64> {
        self.bw_rows()
            .find(|r| r.size == Some(size) && r.pattern == Some(pattern) && r.domains.unwrap_or(1) == domains)
            .map(|r| r.engine)
    }

    /// Puts `rows` after the last row of one of `tests` (at the end if there is none): the
    /// baselines run after the tests stay beside the rows they compare with.
    pub fn insert_after(&mut self, tests: &[&str], rows: Vec<Row>) {
        let at = self
            .rows
            .iter()
            .rposition(|r| tests.contains(&r.test.as_str()))
            .map_or(self.rows.len(), |i| i + 1);
        self.rows.splice(at..at, rows);
    }

    /// The rows the plot draws: the sweep of the first row's pattern and domain count.
    fn plot_rows(&self) -> Vec<&Row> {
        let first = self.bw_rows().next().map(|r| (r.pattern, r.domains));
        self.bw_rows().filter(|r| Some((r.pattern, r.domains)) == first).collect()
    }

    pub fn print(&self) {
        let ft = self.rows.iter().any(|r| r.fabtests.is_some());
        let mut head = vec!["test", "case", "unit", "engine", "baseline", "base value", "ratio"];
        if ft {
            head.extend(["fabtests", "engine/ft", "raw/ft"]);
        }
        let ratio3 = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.3}"));
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                let (bn, bv) = match &r.baseline {
                    Some((n, v)) => (n.clone(), fmt(*v)),
                    None => ("-".into(), "-".into()),
                };
                let mut c =
                    vec![r.test.clone(), r.case.clone(), unit_label(r.unit).into(), fmt(r.engine), bn, bv];
                c.push(ratio3(r.ratio()));
                if ft {
                    let (e, w) = r.ft_ratios();
                    c.push(match &r.fabtests {
                        Some(FtRef::Value { v, .. }) => fmt(*v),
                        Some(FtRef::Skipped(_)) => "skipped".into(),
                        None => "-".into(),
                    });
                    c.push(ratio3(e));
                    c.push(ratio3(w));
                }
                c
            })
            .collect();
        let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
        for c in &cells {
            for (i, s) in c.iter().enumerate() {
                w[i] = w[i].max(s.len());
            }
        }
        println!("\nprovider {}; ratio = engine / baseline (latency, CPU: lower is better)", self.provider);
        let line = |c: &[String]| {
            let mut s = String::new();
            for (i, x) in c.iter().enumerate() {
                if i <= 2 || i == 4 {
                    s.push_str(&format!("{:<w$}  ", x, w = w[i]));
                } else {
                    s.push_str(&format!("{:>w$}  ", x, w = w[i]));
                }
            }
            println!("{}", s.trim_end());
        };
        line(&head.iter().map(|h| h.to_string()).collect::<Vec<_>>());
        line(&w.iter().map(|&n| "-".repeat(n)).collect::<Vec<_>>());
        for c in &cells {
            line(c);
        }
        // What the fabtests column holds, once per test (or why it is empty).
        let mut seen: Vec<(String, String)> = Vec::new();
        for r in &self.rows {
            let what = match &r.fabtests {
                Some(FtRef::Value { tool, .. }) => tool.clone(),
                Some(FtRef::Skipped(why)) => why.clone(),
                None => continue,
            };
            if !seen.contains(&(r.test.clone(), what.clone())) {
                seen.push((r.test.clone(), what));
            }
        }
        for (test, what) in seen {
            println!("fabtests in {test} rows: {what}");
        }
    }

    pub fn write_json(&self, path: &Path) -> Result<(), BoxError> {
        let results: Vec<Value> = self
            .rows
            .iter()
            .map(|r| {
                let mut m = Map::new();
                m.insert("test".into(), json!(r.test));
                m.insert("case".into(), json!(r.case));
                if let Some(s) = r.size {
                    m.insert("size".into(), json!(s));
                }
                let num = |v: f64| if v.is_finite() { json!(v) } else { Value::Null };
                m.insert(format!("engine_{}", r.unit), num(r.engine));
                if let Some((n, v)) = &r.baseline {
                    m.insert("baseline".into(), json!(n));
                    m.insert(format!("baseline_{}", r.unit), num(*v));
                    m.insert("ratio".into(), r.ratio().map_or(Value::Null, |x| json!(x)));
                }
                if let Some(p) = r.pattern {
                    m.insert("pattern".into(), json!(p.name()));
                }
                if let Some(n) = r.domains {
                    m.insert("domains".into(), json!(n));
                }
                if let Some(f) = &r.fabtests {
                    let (tool, v) = match f {
                        FtRef::Value { tool, v } => (tool.as_str(), *v),
                        FtRef::Skipped(why) => (why.as_str(), f64::NAN),
                    };
                    let (e, w) = r.ft_ratios();
                    let opt = |x: Option<f64>| x.map_or(Value::Null, |x| json!(x));
                    m.insert("fabtests".into(), json!(tool));
                    m.insert(format!("fabtests_{}", r.unit), num(v));
                    m.insert("ratio_engine_fabtests".into(), opt(e));
                    m.insert("ratio_raw_fabtests".into(), opt(w));
                }
                if let Some(k) = &r.rounds {
                    let pair = |(a, b): (f64, f64)| json!([num(a), num(b)]);
                    m.insert("rounds".into(), json!(k.n));
                    m.insert("ci95".into(), k.ci.map_or(Value::Null, pair));
                    m.insert("range".into(), pair(k.range));
                }
                if !r.ceilings.is_empty() {
                    let c: Map<String, Value> =
                        r.ceilings.iter().map(|(n, v)| (n.to_string(), num(*v))).collect();
                    m.insert(format!("ceilings_{}", r.unit), Value::Object(c));
                }
                for (k, v) in &r.fields {
                    m.insert(k.to_string(), v.clone());
                }
                Value::Object(m)
            })
            .collect();
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let doc = json!({
            "provider": self.provider,
            "cores": cores,
            "linger_us": self.linger_us,
            "poll_window_us": self.poll_window_us,
            "results": results
        });
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {} for the JSON report: {e}", dir.display()))?;
        }
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .map_err(|e| format!("cannot write the JSON report {}: {e}", path.display()))?;
        Ok(())
    }

    /// ib_write_bw's figure per size, from the verbs rows `<size> vs ib_write_bw -t N`.
    fn perftest_bw(&self) -> Vec<(f64, f64)> {
        self.rows
            .iter()
            .filter(|r| r.test == "bw" && r.size.is_some())
            .filter_map(|r| match &r.baseline {
                Some((n, v)) if n == "ib_write_bw" && v.is_finite() => {
                    Some(((r.size.unwrap_or(1) as f64).log2(), *v))
                }
                _ => None,
            })
            .collect()
    }

    /// The bandwidth sweep, engine against the raw loop (and, on verbs, `ib_write_bw` when it
    /// ran); log2 size on x. `engine` names the engine's setup in the legend (its reactor
    /// mode, e.g. `futures, Event`). Text labels need a TrueType font: DejaVu Sans (Debian
    /// `fonts-dejavu-core`) if present, else no labels.
    pub fn plot_bw(&self, path: &Path, engine: &str) -> Result<(), BoxError> {
        let rows = self.plot_rows();
        let pattern = rows.first().and_then(|r| r.pattern).map_or(String::new(), |p| format!(", {p} buffer"));
        let ft: Vec<(f64, f64)> = rows
            .iter()
            .filter_map(|r| match &r.fabtests {
                Some(FtRef::Value { v, .. }) if v.is_finite() => {
                    Some(((r.size.unwrap_or(1) as f64).log2(), *v))
                }
                _ => None,
            })
            .collect();
        let pts: Vec<(f64, f64, f64)> = rows
            .iter()
            .map(|r| {
                let b = r.baseline.as_ref().map_or(f64::NAN, |(_, v)| *v);
                ((r.size.unwrap_or(1) as f64).log2(), r.engine, b)
            })
            .collect();
        let perf = self.perftest_bw();
        let font = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").ok();
        let labels = match font {
            Some(bytes) => {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
            }
            None => false,
        };
        let xmin = pts.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
        let xmax = pts.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
        let ymax = pts
            .iter()
            .flat_map(|p| [p.1, p.2])
            .chain(perf.iter().chain(&ft).map(|p| p.1))
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max)
            * 1.1;
        // Soft-RoCE in the VM moves ~0.3 Gbit/s: scale to the data, not to 1 Gbit/s.
        let ymax = if ymax > 0.0 { ymax } else { 1.0 };
        let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut b = ChartBuilder::on(&root);
        b.margin(20);
        if labels {
            let vs = match (perf.is_empty(), ft.is_empty()) {
                (true, true) => "raw provider loop",
                (false, _) => "raw provider loop, ib_write_bw",
                (true, false) => "raw loop, fi_rma_bw",
            };
            b.caption(
                format!("write_imm bandwidth, {}{pattern} (engine vs {vs})", self.provider),
                ("sans-serif", 22),
            )
            .x_label_area_size(40)
            .y_label_area_size(60);
        }
        let mut chart = b.build_cartesian_2d(xmin..xmax.max(xmin + 1.0), 0.0..ymax)?;
        let mut mesh = chart.configure_mesh();
        if labels {
            // x is log2 of the size: one labelled tick per power of two, named as a size.
            let ticks = (xmax.max(xmin + 1.0) - xmin).round() as usize + 1;
            mesh.x_desc("message size (log scale)")
                .y_desc("Gbit/s")
                .x_labels(ticks)
                .x_label_formatter(&|x| size_label(*x));
        } else {
            mesh.disable_x_mesh().disable_y_mesh();
        }
        mesh.draw()?;
        let engine_line = LineSeries::new(pts.iter().map(|p| (p.0, p.1)), BLUE.stroke_width(3));
        let raw =
            LineSeries::new(pts.iter().filter(|p| p.2.is_finite()).map(|p| (p.0, p.2)), RED.stroke_width(3));
        let green = RGBColor(0, 150, 0);
        let perftest = LineSeries::new(perf.iter().copied(), green.stroke_width(3));
        let fabtests = LineSeries::new(ft.iter().copied(), MAGENTA.stroke_width(3));
        if labels {
            chart
                .draw_series(engine_line)?
                .label(format!("engine ({engine})"))
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(3)));
            chart
                .draw_series(raw)?
                .label("raw provider loop")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(3)));
            if !perf.is_empty() {
                chart
                    .draw_series(perftest)?
                    .label("ib_write_bw (perftest)")
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], green.stroke_width(3)));
            }
            if !ft.is_empty() {
                chart
                    .draw_series(fabtests)?
                    .label("fi_rma_bw (fabtests, hot)")
                    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], MAGENTA.stroke_width(3)));
            }
            chart.configure_series_labels().background_style(WHITE).border_style(BLACK).draw()?;
        } else {
            chart.draw_series(engine_line)?;
            chart.draw_series(raw)?;
            if !perf.is_empty() {
                chart.draw_series(perftest)?;
            }
            if !ft.is_empty() {
                chart.draw_series(fabtests)?;
            }
        }
        root.present()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A verbs-like sweep: the engine, the raw loop and ib_write_bw at each size.
    fn verbs_report() -> Report {
        let mut rep = Report::new("verbs");
        for (i, size) in [4usize << 10, 64 << 10, 1 << 20].into_iter().enumerate() {
            let e = 0.1 + 0.1 * i as f64;
            rep.push(Row::new("bw", "x", "gbps", e).size(size).baseline("raw", e * 1.05));
            rep.push(
                Row::new("bw", "x vs ib_write_bw -t 128", "gbps", e)
                    .size(size)
                    .baseline("ib_write_bw", e * 1.1),
            );
        }
        rep
    }

    #[test]
    fn perftest_series_only_where_ib_write_bw_ran() {
        let rep = verbs_report();
        assert_eq!(rep.perftest_bw().len(), 3);
        assert_eq!(rep.bw_rows().count(), 3, "the raw series ignores the ib_write_bw rows");
        let mut tcp = Report::new("tcp");
        tcp.push(Row::new("bw", "1 MiB", "gbps", 1.0).size(1 << 20).baseline("raw", 1.0));
        tcp.push(Row::new("bw", "1 MiB vs iperf3 -l 1M", "gbps", 1.0).size(1 << 20).baseline("iperf3", 2.0));
        assert!(tcp.perftest_bw().is_empty());
    }

    /// A hot,cold sweep with two domain counts and fabtests beside it.
    fn ft_report() -> Report {
        let mut rep = Report::new("shm");
        for d in [1, 2] {
            for p in [Pattern::Hot, Pattern::Cold] {
                for (i, size) in [64usize << 10, 1 << 20].into_iter().enumerate() {
                    let e = 10.0 + i as f64 + d as f64 + if p == Pattern::Hot { 5.0 } else { 0.0 };
                    let ft = FtRef::Value { tool: "fi_rma_bw".into(), v: 40.0 };
                    let row = Row::new("bw", "x", "gbps", e).size(size).pattern(p).domains(d);
                    rep.push(row.baseline("raw", 20.0).fabtests(ft));
                }
            }
        }
        rep.push(
            Row::new("lat", "8 B p50", "us", 30.0)
                .size(8)
                .baseline("raw", 15.0)
                .fabtests(FtRef::Skipped("skipped: no --fabtests DIR".into())),
        );
        rep
    }

    #[test]
    fn fabtests_columns_and_json() {
        let rep = ft_report();
        assert_eq!(rep.plot_rows().len(), 2, "one pattern and domain count in the plot");
        assert!(rep.plot_rows().iter().all(|r| r.pattern == Some(Pattern::Hot) && r.domains == Some(1)));
        assert_eq!(rep.bw_at(1 << 20), Some(17.0), "the hot one-domain row");
        let r = &rep.rows[0];
        assert_eq!(r.ft_ratios(), (Some(16.0 / 40.0), Some(0.5)));
        assert_eq!(rep.rows.last().unwrap().ft_ratios(), (None, None));
        rep.print();
        let path = std::env::temp_dir().join(format!("fabric-bench-ft-json-{}.json", std::process::id()));
        rep.write_json(&path).unwrap();
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let _ = std::fs::remove_file(&path);
        let res = v["results"].as_array().unwrap();
        assert_eq!(res[0]["pattern"], "hot");
        assert_eq!(res[2]["pattern"], "cold");
        assert_eq!(res[4]["domains"], 2);
        assert_eq!(res[0]["fabtests"], "fi_rma_bw");
        assert_eq!(res[0]["fabtests_gbps"], 40.0);
        assert_eq!(res[0]["ratio_raw_fabtests"], 0.5);
        let lat = res.last().unwrap();
        assert_eq!(lat["fabtests"], "skipped: no --fabtests DIR");
        assert!(lat["fabtests_us"].is_null() && lat["ratio_engine_fabtests"].is_null());
        assert!(lat.get("pattern").is_none());
        let png = path.with_extension("png");
        rep.plot_bw(&png, "futures, Event").unwrap();
        let _ = std::fs::remove_file(&png);
    }

    #[test]
    fn plot_with_ib_write_bw_series() {
        let path = std::env::temp_dir().join(format!("fabric-bench-plot-test-{}.png", std::process::id()));
        verbs_report().plot_bw(&path, "futures, BusyPoll").unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() > 0);
        if std::env::var_os("FABRIC_BENCH_KEEP_PLOT").is_none() {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// `2^x` bytes as a plot label (`4 KiB`, `1 MiB`); blank between powers of two.
fn size_label(x: f64) -> String {
    if (x - x.round()).abs() > 1e-6 || x < 0.0 {
        return String::new();
    }
    match x.round() as u32 {
        p @ 0..=9 => format!("{} B", 1u64 << p),
        p @ 10..=19 => format!("{} KiB", 1u64 << (p - 10)),
        p @ 20..=29 => format!("{} MiB", 1u64 << (p - 20)),
        p => format!("{} GiB", 1u64 << (p.min(60) - 30)),
    }
}

#[cfg(test)]
mod size_label_tests {
    use super::size_label;

    #[test]
    fn powers_of_two_are_named() {
        assert_eq!(size_label(12.0), "4 KiB");
        assert_eq!(size_label(20.0), "1 MiB");
        assert_eq!(size_label(26.0), "64 MiB");
        assert_eq!(size_label(3.0), "8 B");
        assert_eq!(size_label(12.5), "");
    }
}
