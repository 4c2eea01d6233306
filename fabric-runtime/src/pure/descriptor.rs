//! TEMPORARY stand-in (replaced by the real encoding at merge).
use crate::error::Error;
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineAddress {
    pub transport: String,
    pub domains: Vec<Vec<u8>>,
}
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DomainKey {
    pub address: Vec<u8>,
    pub base: u64,
    pub key: u64,
}
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RegionDescriptor {
    pub transport: String,
    pub len: u64,
    pub domains: Vec<DomainKey>,
}
fn put(v: &mut Vec<u8>, b: &[u8]) {
    v.extend_from_slice(&(b.len() as u32).to_le_bytes());
    v.extend_from_slice(b);
}
struct R<'a>(&'a [u8]);
impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if self.0.len() < n {
            return Err(Error::Malformed { what: "x", reason: "truncated".into() });
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, Error> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
}
impl EngineAddress {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = b"FADR".to_vec();
        put(&mut v, self.transport.as_bytes());
        v.extend_from_slice(&(self.domains.len() as u32).to_le_bytes());
        for d in &self.domains {
            put(&mut v, d);
        }
        v
    }
    pub fn from_bytes(b: &[u8]) -> Result<Self, Error> {
        let mut r = R(b);
        if r.take(4)? != b"FADR" {
            return Err(Error::Malformed { what: "engine address", reason: "bad magic".into() });
        }
        let t = String::from_utf8(r.bytes()?)
            .map_err(|_| Error::Malformed { what: "engine address", reason: "utf8".into() })?;
        let n = r.u32()?;
        let mut domains = vec![];
        for _ in 0..n.min(64) {
            domains.push(r.bytes()?);
        }
        Ok(Self { transport: t, domains })
    }
    pub fn check_transport(&self, e: &str) -> Result<(), Error> {
        if self.transport == e {
            Ok(())
        } else {
            Err(Error::Foreign { what: "engine address", found: self.transport.clone(), expected: e.into() })
        }
    }
    pub fn check_domains(&self, n: usize) -> Result<(), Error> {
        if self.domains.len() == n {
            Ok(())
        } else {
            Err(Error::Foreign {
                what: "engine address",
                found: format!("{} NICs", self.domains.len()),
                expected: format!("{n} NICs"),
            })
        }
    }
}
impl RegionDescriptor {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = b"FDSC".to_vec();
        put(&mut v, self.transport.as_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        v.extend_from_slice(&(self.domains.len() as u32).to_le_bytes());
        for d in &self.domains {
            put(&mut v, &d.address);
            v.extend_from_slice(&d.base.to_le_bytes());
            v.extend_from_slice(&d.key.to_le_bytes());
        }
        v
    }
    pub fn from_bytes(b: &[u8]) -> Result<Self, Error> {
        let mut r = R(b);
        if r.take(4)? != b"FDSC" {
            return Err(Error::Malformed { what: "region descriptor", reason: "bad magic".into() });
        }
        let t = String::from_utf8(r.bytes()?)
            .map_err(|_| Error::Malformed { what: "region descriptor", reason: "utf8".into() })?;
        let len = r.u64()?;
        let n = r.u32()?;
        let mut domains = vec![];
        for _ in 0..n.min(64) {
            domains.push(DomainKey { address: r.bytes()?, base: r.u64()?, key: r.u64()? });
        }
        Ok(Self { transport: t, len, domains })
    }
    pub fn check_transport(&self, e: &str) -> Result<(), Error> {
        if self.transport == e {
            Ok(())
        } else {
            Err(Error::Foreign {
                what: "region descriptor",
                found: self.transport.clone(),
                expected: e.into(),
            })
        }
    }
    pub fn check_domains(&self, n: usize) -> Result<(), Error> {
        if self.domains.len() == n {
            Ok(())
        } else {
            Err(Error::Foreign {
                what: "region descriptor",
                found: format!("{} NICs", self.domains.len()),
                expected: format!("{n} NICs"),
            })
        }
    }
}
