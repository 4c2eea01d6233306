//! Peer liveness on `tcp`: a plain TCP connection per peer, which the kernel closes when
//! the peer's process dies.
//!
//! libfabric 1.17's `tcp;ofi_rxm` does not report a dead peer: when the connection resets it
//! closes it quietly, and every later post to that peer returns `-FI_EAGAIN` while rxm tries
//! to connect again, forever. So each tcp domain also listens on a TCP port of its own
//! (same IP as its libfabric endpoint), and adds that port to its address (a 2-byte trailer
//! after the `sockaddr_in`). `add_peer` opens a non-blocking connection to the peer's port
//! and keeps it open; nothing is ever sent on it. The peer's kernel closes its end when
//! the process dies (or resets it; a machine that vanishes is caught by TCP keep-alive,
//! about 8 s), and the domain's poll, which looks at these sockets every
//! [`CHECK_EVERY`](super::shm::CHECK_EVERY), reports [`Completion::PeerDown`]. A sleeping
//! reactor is woken every [`SLEEP_CHECK`] for this while peers are watched, and its first
//! poll after a sleep checks.
//!
//! An engine that shuts down closes its listener and every accepted connection, so its
//! peers see it go `Down` too. The inbound side just accepts and holds connections until
//! their far end closes.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Duration;

use socket2::{Domain as SockDomain, SockAddr, Socket, TcpKeepalive, Type};

use crate::error::Error;
use crate::provider::PeerHandle;

/// How long an `Event` reactor with watched tcp peers sleeps at most
/// ([`Domain::timer`](crate::provider::Domain::timer)): the connections are not among its
/// wait fds, so this bounds how late an idle engine notices a dead peer. Ten wake-ups a
/// second of an idle engine cost nothing measurable.
pub(super) const SLEEP_CHECK: Duration = Duration::from_millis(100);

/// Bytes the liveness port adds after the libfabric address.
pub(super) const TRAILER: usize = 2;

/// The liveness state of one tcp domain.
pub(super) struct TcpLiveness {
    listener: TcpListener,
    port: u16,
    /// Our connection to each peer's port.
    outbound: Vec<(PeerHandle, SocketAddr, TcpStream)>,
    /// Peers' connections to our port, held until their far end closes.
    inbound: Vec<TcpStream>,
    /// Every peer's liveness address, kept after its connection closed (`revive`).
    known: Vec<(PeerHandle, SocketAddr)>,
    /// Peers whose libfabric connection was just torn down under a live peer, and until
    /// when posts to them wait ([`TcpLiveness::hold`]).
    held: Vec<(PeerHandle, std::time::Instant)>,
    /// The checks' `poll` buffers, reused.
    scratch: crate::sys::PollScratch,
}

fn io_error(call: &'static str, e: std::io::Error) -> Error {
    Error::Provider { call, errno: e.raw_os_error().unwrap_or(0), message: e.to_string() }
}

/// The IPv4 address and port of a `sockaddr_in` (as `fi_getname` gives it).
pub(super) fn sockaddr_in(bytes: &[u8]) -> Option<SocketAddr> {
    if bytes.len() < 8 || u16::from_ne_bytes([bytes[0], bytes[1]]) != libc::AF_INET as u16 {
        return None;
    }
    let port = u16::from_be_bytes([bytes[2], bytes[3]]);
    let ip = std::net::Ipv4Addr::new(bytes[4], bytes[5], bytes[6], bytes[7]);
    Some(SocketAddr::from((ip, port)))
}

impl TcpLiveness {
    /// Listens on `ip`, port chosen by the kernel.
    pub(super) fn listen(ip: std::net::IpAddr) -> Result<TcpLiveness, Error> {
        let listener = TcpListener::bind((ip, 0)).map_err(|e| io_error("liveness bind", e))?;
        listener.set_nonblocking(true).map_err(|e| io_error("liveness listener", e))?;
        let port = listener.local_addr().map_err(|e| io_error("liveness listener", e))?.port();
        Ok(TcpLiveness {
            listener,
            port,
            outbound: Vec::new(),
            inbound: Vec::new(),
            known: Vec::new(),
            held: Vec::new(),
            scratch: Default::default(),
        })
    }

    /// The trailer to append to this domain's address.
    pub(super) fn trailer(&self) -> [u8; TRAILER] {
        self.port.to_be_bytes()
    }

    /// Starts a connection to a new peer's liveness port (`ip` from its libfabric address,
    /// `trailer` from its address). A refused connection is found by the next check.
    pub(super) fn watch(&mut self, peer: PeerHandle, ip: std::net::IpAddr, trailer: [u8; TRAILER]) {
        let addr = SocketAddr::new(ip, u16::from_be_bytes(trailer));
        self.known.retain(|(p, _)| *p != peer);
        self.known.push((peer, addr));
        match connect(addr) {
            Ok(s) => {
                self.outbound.retain(|(p, ..)| *p != peer);
                self.outbound.push((peer, addr, s));
            }
            Err(e) => {
                tracing::debug!(peer, %addr, error = %e, "no liveness connection; the peer's death is found by op_timeout")
            }
        }
    }

    /// Whether any peer is watched (then a sleeping reactor must still check, every
    /// [`SLEEP_CHECK`]).
    pub(super) fn watching(&self) -> bool {
        !self.outbound.is_empty()
    }

    pub(super) fn unwatch(&mut self, peer: PeerHandle) {
        self.outbound.retain(|(p, ..)| *p != peer);
        self.known.retain(|(p, _)| *p != peer);
    }

    /// Whether `peer`'s process is alive as far as its liveness connection tells right now
    /// (one `poll` of its socket): `Some(false)` when it closed (the next [`TcpLiveness::check`]
    /// reports it), `None` when the peer is not watched.
    pub(super) fn alive(&mut self, peer: PeerHandle) -> Option<bool> {
        let (_, _, s) = self.outbound.iter().find(|(p, ..)| *p == peer)?;
        let fd = s.as_raw_fd();
        match self.scratch.readable_now([fd]) {
            Ok(ready) => Some(ready.is_empty()),
            Err(_) => None,
        }
    }

    /// `Domain::revive_peer` on tcp: connects to the peer's liveness port (`addr`) again,
    /// waiting up to `limit` for the connection; `Err` when it is refused or does not come
    /// (the peer's process is gone). Then it is watched as after `add_peer`.
    pub(super) fn revive(
        &mut self,
        peer: PeerHandle,
        addr: SocketAddr,
        limit: Duration,
    ) -> Result<(), Error> {
        let s = TcpStream::connect_timeout(&addr, limit).map_err(|e| Error::PeerUnreachable {
            peer: peer as u32,
            message: format!(
                "tcp peer's liveness port {addr}: {e} (its process exited or its engine shut down)"
            ),
        })?;
        let s = Socket::from(s);
        let ka = TcpKeepalive::new()
            .with_time(Duration::from_secs(5))
            .with_interval(Duration::from_secs(1))
            .with_retries(3);
        s.set_tcp_keepalive(&ka).map_err(|e| io_error("liveness keep-alive", e))?;
        s.set_nonblocking(true).map_err(|e| io_error("liveness connection", e))?;
        self.outbound.retain(|(p, ..)| *p != peer);
        self.outbound.push((peer, addr, s.into()));
        Ok(())
    }

    /// Posts to `peer` wait (`PostError::Again`) for `span`: rxm is still tearing down the
    /// connection that failed, and a post into it now would be lost with it (measured:
    /// `EPIPE` for the next write right after the failure); after that the next post
    /// connects again.
    pub(super) fn hold(&mut self, peer: PeerHandle, span: Duration) {
        let until = std::time::Instant::now() + span;
        self.held.retain(|(p, _)| *p != peer);
        self.held.push((peer, until));
    }

    /// Whether posts to `peer` wait now (see [`TcpLiveness::hold`]); one branch while no
    /// peer is held.
    #[inline]
    pub(super) fn held(&mut self, peer: PeerHandle) -> bool {
        if self.held.is_empty() {
            return false;
        }
        let now = std::time::Instant::now();
        self.held.retain(|&(_, until)| until > now);
        self.held.iter().any(|&(p, _)| p == peer)
    }

    /// The liveness address of a peer watched now or before (`watch` keeps it).
    pub(super) fn address_of(&self, peer: PeerHandle) -> Option<SocketAddr> {
        self.known.iter().find(|(p, _)| *p == peer).map(|&(_, a)| a)
    }

    /// Accepts new inbound connections, drops closed ones, and returns the peers whose
    /// connection was closed, reset or refused (taken off the watch list), with a reason.
    /// Allocates nothing while nothing changes (it runs in reactor passes, which may run on
    /// the synchronous fast path's threads).
    pub(super) fn check(&mut self) -> Vec<(PeerHandle, String)> {
        loop {
            match self.listener.accept() {
                Ok((s, _)) => self.inbound.push(s),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::debug!(error = %e, "accepting a liveness connection failed");
                    break;
                }
            }
        }
        if let Ok(ready) = self.scratch.readable_now(self.inbound.iter().map(|s| s.as_raw_fd())) {
            // Nothing is ever sent on these: readable means the far end closed.
            for &i in ready.iter().rev() {
                self.inbound.swap_remove(i);
            }
        }
        let ready = match self.scratch.readable_now(self.outbound.iter().map(|(_, _, s)| s.as_raw_fd())) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "checking the liveness connections failed");
                return Vec::new();
            }
        };
        let mut dead = Vec::with_capacity(ready.len());
        for &i in ready.iter().rev() {
            let (peer, addr, s) = self.outbound.swap_remove(i);
            let why = match s.take_error() {
                Ok(Some(e)) => e.to_string(),
                _ => "connection closed".to_owned(),
            };
            dead.push((peer, format!("tcp peer's liveness connection to {addr}: {why} (its process exited or its engine shut down)")));
        }
        dead
    }
}

/// How long a failed operation whose peer's liveness connection was still open waits for
/// that connection to say whether the peer died. A killed process's sockets close one after
/// the other: rxm may fail the operation (its data connection reset) a moment before the
/// liveness connection's end arrives, and under load that moment was long enough for a
/// dead peer's operation to be reported as a torn connection to a live one.
pub(super) const SUSPECT_WAIT: Duration = Duration::from_millis(20);

/// A failed operation waiting for [`SUSPECT_WAIT`] to be told apart: its peer died
/// ([`FailCause::PeerLost`](crate::provider::FailCause)) or only the connection was lost.
pub(super) struct Suspect {
    pub(super) since: std::time::Instant,
    pub(super) peer: PeerHandle,
    pub(super) token: u64,
    pub(super) errno: i32,
    /// The provider's message.
    pub(super) message: String,
}

impl super::LibfabricDomain {
    /// Settles the suspects (every poll while there are some): a peer whose liveness
    /// connection closed (or is no longer watched) died, its operation fails with
    /// `PeerLost`; one still connected after [`SUSPECT_WAIT`] lives, the operation lost its
    /// connection only (`ConnectionLost`).
    pub(super) fn tcp_settle(&mut self, out: &mut std::collections::VecDeque<crate::provider::Completion>) {
        use crate::provider::{Completion, FailCause};
        let Some(live) = self.tcp_live.as_mut() else { return };
        let mut i = 0;
        while i < self.tcp_suspects.len() {
            let s = &self.tcp_suspects[i];
            let (cause, message) = match live.alive(s.peer) {
                Some(true) if s.since.elapsed() < SUSPECT_WAIT => {
                    i += 1;
                    continue;
                }
                Some(true) => (
                    FailCause::ConnectionLost,
                    format!(
                        "{}: the provider closed its connection to the live peer (a remote access with a \
                         key the peer does not know, from a stale or forged descriptor, closes it); the \
                         next operation connects again",
                        s.message
                    ),
                ),
                _ => {
                    (FailCause::PeerLost, format!("{}: the peer's liveness connection closed too", s.message))
                }
            };
            let s = self.tcp_suspects.swap_remove(i);
            out.push_back(Completion::Failed { token: s.token, errno: s.errno, message, cause });
        }
    }

    /// The periodic tcp work of a poll: peers whose liveness connection closed go down.
    pub(super) fn tcp_maintenance(
        &mut self,
        out: &mut std::collections::VecDeque<crate::provider::Completion>,
    ) {
        let Some(live) = self.tcp_live.as_mut() else { return };
        for (peer, message) in live.check() {
            // The engine says it at warn for the peers it was asked to add (`Completion::PeerDown`).
            tracing::debug!(peer, %message, "tcp peer down");
            out.push_back(crate::provider::Completion::PeerDown { peer, message });
        }
    }
}

/// A non-blocking connection to `addr` (in progress), with TCP keep-alive so that a machine
/// that vanishes without closing anything is noticed too.
fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let s = Socket::new(SockDomain::for_address(addr), Type::STREAM, None)?;
    s.set_nonblocking(true)?;
    let ka = TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    s.set_tcp_keepalive(&ka)?;
    match s.connect(&SockAddr::from(addr)) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(s.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddr_in_bytes() {
        let mut b = [0u8; 16];
        b[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        b[2..4].copy_from_slice(&5000u16.to_be_bytes());
        b[4..8].copy_from_slice(&[127, 0, 0, 1]);
        assert_eq!(sockaddr_in(&b), Some("127.0.0.1:5000".parse().unwrap()));
        assert_eq!(sockaddr_in(&b[..7]), None);
        b[0] = 99;
        b[1] = 99;
        assert_eq!(sockaddr_in(&b), None);
    }

    #[test]
    fn a_closed_listener_and_a_dead_connection_are_reported() {
        let mut a = TcpLiveness::listen("127.0.0.1".parse().unwrap()).unwrap();
        let mut b = TcpLiveness::listen("127.0.0.1".parse().unwrap()).unwrap();
        a.watch(1, "127.0.0.1".parse().unwrap(), b.trailer());
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while b.inbound.is_empty() && std::time::Instant::now() < deadline {
            assert!(a.check().is_empty(), "a live peer is not reported");
            b.check();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(b.inbound.len(), 1, "b accepted a's connection");
        drop(b); // its listener and accepted connection close, as at process exit
        let mut dead = Vec::new();
        while dead.is_empty() && std::time::Instant::now() < deadline {
            dead = a.check();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].0, 1);
        assert!(dead[0].1.contains("127.0.0.1"), "{}", dead[0].1);
        // A port nobody listens on: refused, reported.
        let closed = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        a.watch(2, "127.0.0.1".parse().unwrap(), port.to_be_bytes());
        let mut dead = Vec::new();
        while dead.is_empty() && std::time::Instant::now() < deadline {
            dead = a.check();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(dead.first().map(|d| d.0), Some(2), "refused is reported");
    }
}
