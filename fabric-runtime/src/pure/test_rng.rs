//! The pseudo-random source of the decoders' bounded fuzz tests: xorshift64, deterministic
//! and dependency-free.

pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Replaces `seed`'s bytes in `input` with a mutation: a few bytes replaced or bits
    /// flipped, then maybe truncated or extended (the third kind of fuzz case).
    pub(crate) fn mutate(&mut self, seed: &[u8], input: &mut Vec<u8>) {
        input.clear();
        input.extend_from_slice(seed);
        for _ in 0..=self.below(4) {
            let at = self.below(input.len());
            if self.next() & 1 == 0 {
                input[at] = self.next() as u8;
            } else {
                input[at] ^= 1 << self.below(8);
            }
        }
        match self.below(4) {
            0 => input.truncate(self.below(input.len() + 1)),
            1 => {
                let n = self.below(8);
                for _ in 0..n {
                    let b = self.next() as u8;
                    input.push(b);
                }
            }
            _ => {}
        }
    }
}
