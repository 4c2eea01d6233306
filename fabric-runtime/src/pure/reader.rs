//! A bounds-checked little-endian reader over bytes a peer sent: what every decoder of this
//! module reads with. Every read names its field, so a short input says which field of which
//! offset is missing. Never panics.

pub(crate) struct Reader<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8], pos: usize) -> Self {
        Reader { bytes, pos: pos.min(bytes.len()) }
    }

    pub(crate) fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], String> {
        let left = self.bytes.len() - self.pos;
        if n > left {
            return Err(format!(
                "truncated: the {field} at offset {} needs {n} byte(s), only {left} left",
                self.pos
            ));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    pub(crate) fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, field: &str) -> Result<u8, String> {
        self.array::<1>(field).map(|[b]| b)
    }

    pub(crate) fn u16(&mut self, field: &str) -> Result<u16, String> {
        self.array(field).map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self, field: &str) -> Result<u32, String> {
        self.array(field).map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self, field: &str) -> Result<u64, String> {
        self.array(field).map(u64::from_le_bytes)
    }
}
