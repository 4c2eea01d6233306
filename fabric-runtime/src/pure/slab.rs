//! The reactor's table of in-flight operations: a slab addressed by generational tokens.
//!
//! A token is `generation << 32 | index`. The generation of a slot moves on every time its
//! entry leaves, so a stale or duplicated completion (a token whose entry is gone, or whose
//! slot now holds another operation) finds nothing and can never complete the wrong
//! operation. Generations use 31 bits: bit 63 of a token is left clear for the reactor's
//! receive tags.
//!
//! Not part of the API: public (hidden from the docs) only so that `fabric-bench` can
//! measure it.
#![forbid(unsafe_code)]

/// Generations wrap within 31 bits.
const GEN_MASK: u32 = 0x7fff_ffff;

/// In-flight entries by token. Reserve with [`Slab::next_token`], then [`Slab::insert`]
/// (the token names the slot the next insert takes, so it can be posted first); take back
/// with [`Slab::remove`].
#[derive(Debug)]
pub struct Slab<T> {
    entries: Vec<(u32, Option<T>)>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { entries: Vec::new(), free: Vec::new(), len: 0 }
    }
}

impl<T> Slab<T> {
    /// The token the next [`Slab::insert`] will answer to. Calling it again before that
    /// insert returns the same token.
    pub fn next_token(&mut self) -> u64 {
        let idx = match self.free.last() {
            Some(&i) => i,
            None => {
                self.entries.push((0, None));
                let i = (self.entries.len() - 1) as u32;
                self.free.push(i);
                i
            }
        };
        ((self.entries[idx as usize].0 as u64) << 32) | idx as u64
    }

    /// Inserts at the slot `next_token` named.
    ///
    /// # Panics
    ///
    /// If `next_token` was not called first.
    pub fn insert(&mut self, v: T) {
        let idx = self.free.pop().expect("next_token reserved a slot");
        self.entries[idx as usize].1 = Some(v);
        self.len += 1;
    }

    /// Takes the entry of `token`; `None` if the token is stale, unknown or already removed.
    pub fn remove(&mut self, token: u64) -> Option<T> {
        let idx = (token & 0xffff_ffff) as usize;
        let gen = ((token >> 32) as u32) & GEN_MASK;
        let e = self.entries.get_mut(idx)?;
        if e.0 != gen || e.1.is_none() {
            return None;
        }
        let v = e.1.take();
        e.0 = (e.0 + 1) & GEN_MASK;
        self.free.push(idx as u32);
        self.len -= 1;
        v
    }

    /// Takes every entry (shutdown).
    pub fn drain(&mut self) -> Vec<T> {
        let mut out = Vec::new();
        for (i, e) in self.entries.iter_mut().enumerate() {
            if let Some(v) = e.1.take() {
                e.0 = (e.0 + 1) & GEN_MASK;
                self.free.push(i as u32);
                out.push(v);
            }
        }
        self.len = 0;
        out
    }

    /// Every entry in the slab, in slot order (deadline checks).
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.entries.iter_mut().filter_map(|e| e.1.as_mut())
    }

    /// Every entry in the slab, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.entries.iter().filter_map(|e| e.1.as_ref())
    }

    /// Entries in the slab.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slab holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_generational() {
        let mut s = Slab::default();
        let t1 = s.next_token();
        s.insert(1);
        assert_eq!(s.remove(t1), Some(1));
        assert_eq!(s.remove(t1), None, "a token completes once");
        let t2 = s.next_token();
        s.insert(2);
        assert_ne!(t1, t2, "a reused slot gets a new generation");
        assert_eq!(t1 & 0xffff_ffff, t2 & 0xffff_ffff, "the slot is reused");
        assert_eq!(s.remove(t1), None, "a stale token cannot complete the new entry");
        assert_eq!(s.remove(t2), Some(2));
        assert!(s.is_empty());
    }

    #[test]
    fn next_token_is_stable_until_insert() {
        let mut s = Slab::default();
        let t = s.next_token();
        assert_eq!(s.next_token(), t);
        s.insert('a');
        assert_ne!(s.next_token(), t);
    }

    #[test]
    fn unknown_tokens_find_nothing() {
        let mut s: Slab<u8> = Slab::default();
        assert_eq!(s.remove(0), None);
        assert_eq!(s.remove(u64::MAX), None);
        let t = s.next_token();
        assert_eq!(s.remove(t), None, "reserved but not inserted");
        s.insert(7);
        assert_eq!(s.remove(t | 1 << 40), None, "wrong generation");
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn many_in_flight() {
        let mut s = Slab::default();
        let mut toks = Vec::new();
        for i in 0..1000u32 {
            toks.push(s.next_token());
            s.insert(i);
        }
        assert_eq!(s.len(), 1000);
        assert_eq!(s.iter_mut().count(), 1000);
        for (i, t) in toks.iter().enumerate().rev() {
            assert_eq!(s.remove(*t), Some(i as u32));
        }
        assert_eq!(s.len(), 0);
        assert!(s.drain().is_empty());
    }

    #[test]
    fn drain_retires_every_token() {
        let mut s = Slab::default();
        let toks: Vec<u64> = (0..3)
            .map(|i| {
                let t = s.next_token();
                s.insert(i);
                t
            })
            .collect();
        s.remove(toks[1]);
        assert_eq!(s.drain(), vec![0, 2]);
        assert!(s.is_empty());
        for t in toks {
            assert_eq!(s.remove(t), None);
        }
        // Slots are reused with new generations.
        let t = s.next_token();
        s.insert(9);
        assert_eq!(s.remove(t), Some(9));
    }

    #[test]
    fn generation_wraps_within_31_bits() {
        let mut s = Slab::default();
        let t = s.next_token();
        s.insert(());
        s.remove(t);
        s.entries[0].0 = GEN_MASK;
        let last = s.next_token();
        assert_eq!(last >> 32, GEN_MASK as u64);
        s.insert(());
        assert_eq!(s.remove(last), Some(()));
        let wrapped = s.next_token();
        assert_eq!(wrapped, 0, "generation 0 again, slot 0");
        assert_eq!(last & (1 << 63), 0, "bit 63 stays clear");
    }
}
