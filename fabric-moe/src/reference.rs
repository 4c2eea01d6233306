//! The host's side of a checked run (tests, examples, benches): deterministic inputs of
//! every rank from seeds, and what dispatch and combine must produce from them, computed on
//! the CPU. Any rank can compute any other rank's inputs, so nothing but the results of the
//! GPU has to be exchanged to check them.
#![forbid(unsafe_code)]

use crate::config::Config;

/// bf16 bits of `f`, rounded to nearest even (as the kernels do).
pub fn f32_to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return (((u >> 16) | 0x40) & 0xffff) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// The value of bf16 bits `h`.
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// The scale of toy expert `e` (global id): `1 + (e % 8) / 8`.
pub fn toy_scale(e: usize) -> f32 {
    1.0 + (e % 8) as f32 / 8.0
}

/// What the toy expert `e` (`AllToAll::toy_experts`) makes of one element.
pub fn toy_expert(e: usize, x: u16) -> u16 {
    f32_to_bf16(bf16_to_f32(x) * toy_scale(e))
}

/// How tokens pick their experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// `topk` distinct experts per token, uniformly; about one entry in eight is -1 (no
    /// expert) when `masked`.
    Random {
        /// Whether some entries are -1.
        masked: bool,
    },
    /// Every token of every rank to expert 0 (column 0), the other columns -1: the most
    /// uneven step there is.
    OneExpert,
}

/// One rank's inputs of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs {
    /// `[tokens, hidden]` bf16 bits.
    pub x: Vec<u16>,
    /// `[tokens, topk]` global expert ids, -1 for none.
    pub topk_idx: Vec<i64>,
    /// `[tokens, topk]`.
    pub topk_weights: Vec<f32>,
    /// Tokens.
    pub tokens: usize,
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The inputs of `rank` at `step`: `tokens` rows of finite bf16 values of magnitude 2^-7 to
/// 2^3, routing as asked, weights that are multiples of 1/256 in (0, 1].
pub fn inputs(c: &Config, routing: Routing, seed: u64, rank: usize, step: usize, tokens: usize) -> Inputs {
    let mut rng = Rng::new(seed ^ ((rank as u64) << 40) ^ ((step as u64) << 8) ^ 0x006d_6f65);
    let x = (0..tokens * c.hidden)
        .map(|_| {
            let v = rng.next();
            let sign = (v & 1) as u16;
            let exp = 120 + (v >> 1) % 11;
            let mant = ((v >> 8) & 0x7f) as u16;
            sign << 15 | (exp as u16) << 7 | mant
        })
        .collect();
    let mut topk_idx = Vec::with_capacity(tokens * c.topk);
    for _ in 0..tokens {
        match routing {
            Routing::Random { masked } => {
                let mut row: Vec<i64> = Vec::with_capacity(c.topk);
                while row.len() < c.topk {
                    let e = rng.below(c.experts()) as i64;
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                for e in row.iter_mut() {
                    if masked && rng.below(8) == 0 {
                        *e = -1;
                    }
                }
                topk_idx.extend(row);
            }
            Routing::OneExpert => {
                topk_idx.push(0);
                topk_idx.extend(std::iter::repeat_n(-1, c.topk - 1));
            }
        }
    }
    let topk_weights = (0..tokens * c.topk).map(|_| (1 + rng.below(256)) as f32 / 256.0).collect();
    Inputs { x, topk_idx, topk_weights, tokens }
}

/// What local expert `le` of `rank` must receive: the `(source rank, token)` of every
/// (token, column) routed to it, sorted.
pub fn expected_sources(c: &Config, all: &[Inputs], rank: usize) -> Vec<Vec<(usize, usize)>> {
    let mut out = vec![Vec::new(); c.experts_per_rank];
    for (src, inp) in all.iter().enumerate() {
        for t in 0..inp.tokens {
            for &e in &inp.topk_idx[t * c.topk..(t + 1) * c.topk] {
                if e >= 0 && e as usize / c.experts_per_rank == rank {
                    out[e as usize % c.experts_per_rank].push((src, t));
                }
            }
        }
    }
    out.iter_mut().for_each(|v| v.sort_unstable());
    out
}

/// Checks a dispatch's results on `rank` (`sources` and `rows` per local expert, as
/// `AllToAll::read_received` gives them): the right rows, each exactly the source's token.
pub fn check_received(
    c: &Config,
    all: &[Inputs],
    rank: usize,
    sources: &[Vec<(usize, usize)>],
    rows: &[Vec<u16>],
) -> Result<(), String> {
    let want = expected_sources(c, all, rank);
    for (le, want) in want.iter().enumerate() {
        let mut got = sources[le].clone();
        got.sort_unstable();
        if &got != want {
            return Err(format!(
                "rank {rank} expert {le}: received {} rows from {:?}..., expected {} from {:?}...",
                got.len(),
                &got[..got.len().min(4)],
                want.len(),
                &want[..want.len().min(4)]
            ));
        }
        for (i, &(src, t)) in sources[le].iter().enumerate() {
            let row = &rows[le][i * c.hidden..(i + 1) * c.hidden];
            if row != &all[src].x[t * c.hidden..(t + 1) * c.hidden] {
                return Err(format!("rank {rank} expert {le} row {i}: not token {t} of rank {src}"));
            }
        }
    }
    Ok(())
}

/// Checks `rank`'s combined rows against the weighted sum of the toy experts' outputs,
/// computed in f64: each element within `2^-7` of the sum of the magnitudes of its terms
/// (two bf16 roundings of partial sums and one of the total, with margin), plus 1e-30.
pub fn check_combined(c: &Config, inp: &Inputs, rank: usize, got: &[u16]) -> Result<(), String> {
    for t in 0..inp.tokens {
        let idx = &inp.topk_idx[t * c.topk..(t + 1) * c.topk];
        let w = &inp.topk_weights[t * c.topk..(t + 1) * c.topk];
        for h in 0..c.hidden {
            let x = inp.x[t * c.hidden + h];
            let (mut sum, mut mag) = (0f64, 0f64);
            for (&e, &w) in idx.iter().zip(w) {
                if e >= 0 {
                    let term = f64::from(w) * f64::from(bf16_to_f32(toy_expert(e as usize, x)));
                    sum += term;
                    mag += term.abs();
                }
            }
            let g = f64::from(bf16_to_f32(got[t * c.hidden + h]));
            if (g - sum).abs() > mag / 128.0 + 1e-30 {
                return Err(format!(
                    "rank {rank} token {t} element {h}: {g}, expected {sum} (+- {})",
                    mag / 128.0
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to even (1 + 2^-6).
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(f32_to_bf16(-2.5), 0xc020);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(toy_expert(3, 0x3f80), f32_to_bf16(1.375));
    }

    #[test]
    fn inputs_are_deterministic_and_valid() {
        let c = Config::new(2, 0, 4, 16, 32, 3);
        let a = inputs(&c, Routing::Random { masked: true }, 7, 1, 2, 16);
        assert_eq!(a, inputs(&c, Routing::Random { masked: true }, 7, 1, 2, 16));
        assert_ne!(a, inputs(&c, Routing::Random { masked: true }, 7, 1, 3, 16));
        assert!(a.x.iter().all(|&v| bf16_to_f32(v).is_finite() && bf16_to_f32(v) != 0.0));
        for row in a.topk_idx.chunks(3) {
            let valid: Vec<_> = row.iter().filter(|&&e| e >= 0).collect();
            assert!(valid.iter().all(|&&e| e < 8));
            let mut d = valid.clone();
            d.dedup();
            assert_eq!(d.len(), valid.len());
        }
    }

    #[test]
    fn expected_sources_of_one_expert() {
        let c = Config::new(2, 0, 4, 8, 4, 2);
        let all: Vec<_> = (0..2).map(|r| inputs(&c, Routing::OneExpert, 1, r, 0, 8)).collect();
        let want = expected_sources(&c, &all, 0);
        assert_eq!(want[0].len(), 16);
        assert!(want[1..].iter().all(Vec::is_empty));
        assert!(expected_sources(&c, &all, 1).iter().all(Vec::is_empty));
        // The host reference of a perfect dispatch passes its own check.
        let rows: Vec<Vec<u16>> = want
            .iter()
            .map(|s| s.iter().flat_map(|&(r, t)| all[r].x[t * 4..(t + 1) * 4].to_vec()).collect())
            .collect();
        check_received(&c, &all, 0, &want, &rows).unwrap();
    }

    #[test]
    fn combined_reference_accepts_the_exact_sum() {
        let c = Config::new(2, 0, 4, 4, 8, 2);
        let inp = inputs(&c, Routing::Random { masked: false }, 3, 0, 0, 4);
        let got: Vec<u16> = (0..4 * 8)
            .map(|i| {
                let (t, h) = (i / 8, i % 8);
                let s: f32 = (0..2)
                    .map(|j| {
                        let e = inp.topk_idx[t * 2 + j] as usize;
                        inp.topk_weights[t * 2 + j] * bf16_to_f32(toy_expert(e, inp.x[t * 8 + h]))
                    })
                    .sum();
                f32_to_bf16(s)
            })
            .collect();
        check_combined(&c, &inp, 0, &got).unwrap();
        let mut bad = got.clone();
        bad[5] ^= 0x0040;
        assert!(check_combined(&c, &inp, 0, &bad).is_err());
    }
}
