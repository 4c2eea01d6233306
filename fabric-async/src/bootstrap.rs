//! Bootstrapping: exchanging addresses between processes before any RDMA can happen.
//!
//! Engines learn each other's addresses (and region descriptors) through a small key-value
//! store that every process can reach. The store is abstracted by [`Rendezvous`], so an
//! application can plug in the one it already has (redis, a shared file system). With the
//! `etcd` feature, `EtcdStore` is one over etcd v3, with a lease per process
//! and a membership watch (`fabric_async::etcd`). For everything else there is [`TcpStore`], a tiny store over TCP in the spirit of PyTorch's
//! `TCPStore`: one process runs a [`TcpStoreServer`], every process (the server's included)
//! connects a [`TcpStore`] to it.
//!
//! ```text
//!   rank 0                          rank 1 .. n-1
//!   TcpStoreServer <---- TCP ----+- TcpStore   put("addr/1", ..), get("addr/0") ...
//!        ^                       +- TcpStore   put("addr/2", ..), get("addr/0") ...
//!        +------ TcpStore (rank 0's own client)
//! ```
//!
//! [`all_gather`] builds the usual "everyone learns everyone's address" step on top of any
//! [`Rendezvous`].
//!
//! # Wire protocol of `TcpStore`
//!
//! Little-endian, one request at a time per connection. On connecting, the client sends the
//! 4-byte hello `FKV\x01` and the server answers with the same four bytes.
//!
//! ```text
//! request:  op u8 ('P' | 'G') | key_len u32 | key | ('P' only:) value_len u32 | value
//! reply:    0 u8 | ('G' only:) value_len u32 | value          (success)
//!           1 u8 | msg_len u32 | msg (UTF-8)                   (error; server closes)
//! ```
//!
//! The server answers a `G` only once the key exists. Keys are at most [`MAX_KEY_LEN`] bytes,
//! values at most [`MAX_VALUE_LEN`]; both sides check the limits before sending or
//! allocating.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// The longest key a [`TcpStore`] accepts, in bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// The largest value a [`TcpStore`] accepts, in bytes (64 MiB).
pub const MAX_VALUE_LEN: usize = 64 << 20;
/// How long [`TcpStore::connect`] keeps retrying before giving up.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

const HELLO: [u8; 4] = *b"FKV\x01";
const OP_PUT: u8 = b'P';
const OP_GET: u8 = b'G';
const STATUS_OK: u8 = 0;
const STATUS_ERR: u8 = 1;
const MAX_ERROR_LEN: usize = 4096;

/// What can go wrong while bootstrapping.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// An I/O operation failed; `context` says which one and with whom.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },

    /// [`Rendezvous::get`] gave up waiting for `key` (see [`TcpStore::with_timeout`]).
    #[error("timed out waiting for key {key:?}")]
    Timeout { key: String },

    /// The other side did not follow the protocol, or reported an error of its own.
    #[error("bootstrap protocol error: {0}")]
    Protocol(String),

    /// A key or value is over its limit ([`MAX_KEY_LEN`], [`MAX_VALUE_LEN`]). Nothing was sent.
    #[error("{what} is {len} bytes, the limit is {max}")]
    TooLarge { what: &'static str, len: usize, max: usize },

    /// An external store (etcd, with the `etcd` feature) failed; `context` says doing what.
    #[error("{context}: {source}")]
    Store {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// [`all_gather`] was called with `rank >= world`.
    #[error("rank {rank} is not below the world size {world}")]
    InvalidRank { rank: usize, world: usize },
}

impl BootstrapError {
    fn io(context: impl Into<String>, source: io::Error) -> Self {
        let source = if source.kind() == io::ErrorKind::UnexpectedEof {
            io::Error::new(io::ErrorKind::UnexpectedEof, "the store server closed the connection")
        } else {
            source
        };
        BootstrapError::Io { context: context.into(), source }
    }
}

/// A key-value store that every process of a job can reach, used to exchange addresses.
///
/// # Contract
///
/// * [`put`](Self::put) stores `value` under `key`. Keys are meant to be written once; if a
///   key is written again, which value later readers see is up to the implementation
///   ([`TcpStore`]: the last one written).
/// * [`get`](Self::get) returns the value of `key`, **waiting until some process has put
///   it**. It does not remove the key: any number of processes may get the same key.
/// * Both may be called concurrently from many tasks on one `&self`. A `get` that waits must
///   not stop other calls (on this or any other handle) from making progress; in particular a
///   `put` from another task on the same handle must be able to satisfy a waiting `get`.
/// * Both must be cancel safe as described in their `# Cancel safety` sections.
/// * An implementation may bound how long `get` waits and fail with
///   [`BootstrapError::Timeout`]; it must not retry forever on errors that will not go away.
#[async_trait::async_trait]
pub trait Rendezvous: Send + Sync {
    /// Stores `value` under `key`.
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped before it completes, the value may or may not have been
    /// stored. Putting the same value again is harmless, so the call can be retried.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), BootstrapError>;

    /// Returns the value stored under `key`, waiting until it exists.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future loses nothing (the key stays in the store) and leaves
    /// the handle usable; a later `get` of the same key returns the value.
    async fn get(&self, key: &str) -> Result<Vec<u8>, BootstrapError>;
}

/// Every rank puts `mine` under `{prefix}/{rank}`, then gets the values of all ranks
/// `0..world`. Returns them in rank order (`result[rank] == mine`).
///
/// All `world` ranks must call it with the same `prefix`, which should be fresh for each
/// exchange (e.g. `"addr"`, then `"desc/0"`), since keys are never removed.
///
/// # Cancel safety
///
/// Not cancel safe as a whole: if the future is dropped, this rank's value may already be in
/// the store while the others' values were not all read. Retrying with the same `prefix` is
/// correct (it puts the same value again and reads the same keys).
pub async fn all_gather(
    store: &dyn Rendezvous,
    prefix: &str,
    rank: usize,
    world: usize,
    mine: Vec<u8>,
) -> Result<Vec<Vec<u8>>, BootstrapError> {
    if rank >= world {
        return Err(BootstrapError::InvalidRank { rank, world });
    }
    store.put(&format!("{prefix}/{rank}"), mine.clone()).await?;
    let mut all = Vec::with_capacity(world);
    for r in 0..world {
        if r == rank {
            all.push(mine.clone());
        } else {
            all.push(store.get(&format!("{prefix}/{r}")).await?);
        }
    }
    Ok(all)
}

// ---------------------------------------------------------------------------------------------
// Server

/// The server side of [`TcpStore`]: holds the keys and answers clients, in a tokio task.
///
/// The task (and every client connection) stops when this value is dropped; clients then see
/// their requests fail instead of hanging.
#[must_use = "the store server stops when this value is dropped"]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    task: JoinHandle<()>,
}

impl fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStoreServer").field("local_addr", &self.local_addr).finish()
    }
}

#[derive(Default)]
struct Keys {
    map: Mutex<HashMap<String, Bytes>>,
    /// Notified (all waiters) after every put.
    changed: Notify,
}

impl Keys {
    fn put(&self, key: String, value: Bytes) {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).insert(key, value);
        self.changed.notify_waiters();
    }

    async fn wait(&self, key: &str) -> Bytes {
        loop {
            // Register interest before looking, so a put between the look and the await is
            // not missed.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = self.map.lock().unwrap_or_else(|e| e.into_inner()).get(key) {
                return v.clone();
            }
            notified.await;
        }
    }
}

impl TcpStoreServer {
    /// Binds `addr` (use port 0 for any free port) and starts serving in a spawned task.
    ///
    /// Must be called inside a tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// If dropped before it completes, nothing is served and the socket is closed.
    pub async fn bind(addr: SocketAddr) -> io::Result<TcpStoreServer> {
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let task = tokio::spawn(accept_loop(listener, Arc::new(Keys::default())));
        Ok(TcpStoreServer { local_addr, task })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        // Aborting the accept loop drops its `JoinSet`, which aborts every connection task
        // and so closes every client socket.
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, keys: Arc<Keys>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let keys = keys.clone();
                    connections.spawn(async move {
                        if let Err(e) = serve_connection(stream, &keys).await {
                            tracing::debug!(%peer, error = %e, "TcpStore connection ended");
                        }
                    });
                }
                Err(e) => {
                    // Typically EMFILE; back off instead of spinning.
                    tracing::warn!(error = %e, "TcpStore accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            // Reap finished connections so the set does not grow without bound.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve_connection(stream: TcpStream, keys: &Keys) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut stream = BufReader::new(stream);
    let mut hello = [0u8; 4];
    stream.read_exact(&mut hello).await?;
    if hello != HELLO {
        return reply_error(&mut stream, "bad hello: not a fabric TcpStore client").await;
    }
    stream.get_mut().write_all(&HELLO).await?;
    loop {
        let op = match stream.read_u8().await {
            Ok(op) => op,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        if op != OP_PUT && op != OP_GET {
            return reply_error(&mut stream, &format!("unknown operation {op:#04x}")).await;
        }
        let key = match read_limited(&mut stream, "key", MAX_KEY_LEN).await? {
            Ok(key) => key,
            Err(msg) => return reply_error(&mut stream, &msg).await,
        };
        let Ok(key) = String::from_utf8(key) else {
            return reply_error(&mut stream, "key is not UTF-8").await;
        };
        if op == OP_PUT {
            let value = match read_limited(&mut stream, "value", MAX_VALUE_LEN).await? {
                Ok(value) => value,
                Err(msg) => return reply_error(&mut stream, &msg).await,
            };
            keys.put(key, Bytes::from(value));
            stream.get_mut().write_all(&[STATUS_OK]).await?;
        } else {
            // While waiting, the client must not send anything: any byte or EOF means it gave
            // up (or broke the protocol), so stop waiting and close.
            let value = tokio::select! {
                value = keys.wait(&key) => value,
                _ = stream.read_u8() => return Ok(()),
            };
            let mut header = Vec::with_capacity(5);
            header.push(STATUS_OK);
            header.extend_from_slice(&len_u32(value.len()).to_le_bytes());
            let s = stream.get_mut();
            s.write_all(&header).await?;
            s.write_all(&value).await?;
        }
    }
}

async fn reply_error(stream: &mut BufReader<TcpStream>, msg: &str) -> io::Result<()> {
    let msg = &msg.as_bytes()[..msg.len().min(MAX_ERROR_LEN)];
    let mut frame = Vec::with_capacity(5 + msg.len());
    frame.push(STATUS_ERR);
    frame.extend_from_slice(&len_u32(msg.len()).to_le_bytes());
    frame.extend_from_slice(msg);
    stream.get_mut().write_all(&frame).await?;
    stream.get_mut().shutdown().await
}

/// Reads a `u32` length and that many bytes. The inner `Err` is a limit violation (nothing
/// was allocated for it); the outer one an I/O error.
async fn read_limited<R: AsyncRead + Unpin>(
    r: &mut R,
    what: &str,
    max: usize,
) -> io::Result<Result<Vec<u8>, String>> {
    let len = r.read_u32_le().await?;
    if u64::from(len) > max as u64 {
        return Ok(Err(format!("{what} is {len} bytes, the limit is {max}")));
    }
    // Grow the buffer as bytes arrive rather than trusting the length up front.
    let mut buf = Vec::new();
    r.take(u64::from(len)).read_to_end(&mut buf).await?;
    if buf.len() != len as usize {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Ok(buf))
}

/// Lengths are checked against limits far below `u32::MAX` before any frame is built.
fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

// ---------------------------------------------------------------------------------------------
// Client

/// A [`Rendezvous`] client of a [`TcpStoreServer`].
///
/// Cheap to share (`&TcpStore` is enough for concurrent use). Each request uses one TCP
/// connection from a small pool, so a `get` that waits never blocks other requests: a
/// concurrent request simply opens another connection. A request whose future is dropped
/// closes its connection, so a cancelled request can never leave a half-read reply behind.
pub struct TcpStore {
    addr: SocketAddr,
    connect_timeout: Duration,
    get_timeout: Option<Duration>,
    idle: Mutex<Vec<BufReader<TcpStream>>>,
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("connect_timeout", &self.connect_timeout)
            .field("get_timeout", &self.get_timeout)
            .finish_non_exhaustive()
    }
}

impl TcpStore {
    /// Connects to the server at `addr`, retrying for up to [`DEFAULT_CONNECT_TIMEOUT`] (30 s)
    /// so that a process may start before the server does.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes any connection being opened; nothing else happened.
    pub async fn connect(addr: SocketAddr) -> Result<TcpStore, BootstrapError> {
        Self::connect_timeout(addr, DEFAULT_CONNECT_TIMEOUT).await
    }

    /// Like [`connect`](Self::connect), retrying for up to `timeout`. The same bound applies
    /// later to opening each further connection (without retries).
    ///
    /// A server that answers with something other than the `TcpStore` hello is a
    /// [`BootstrapError::Protocol`] at once; connection errors are retried with backoff until
    /// `timeout`, then returned as [`BootstrapError::Io`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes any connection being opened; nothing else happened.
    pub async fn connect_timeout(addr: SocketAddr, timeout: Duration) -> Result<TcpStore, BootstrapError> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(10);
        loop {
            let attempt = tokio::time::timeout_at(deadline, open(addr)).await;
            let err = match attempt {
                Ok(Ok(conn)) => {
                    return Ok(TcpStore {
                        addr,
                        connect_timeout: timeout,
                        get_timeout: None,
                        idle: Mutex::new(vec![conn]),
                    })
                }
                Ok(Err(OpenError::Protocol(msg))) => return Err(BootstrapError::Protocol(msg)),
                Ok(Err(OpenError::Io(e))) => e,
                Err(_elapsed) => io::Error::new(io::ErrorKind::TimedOut, "connection attempt timed out"),
            };
            if Instant::now() + backoff >= deadline {
                return Err(BootstrapError::io(
                    format!("connecting to TcpStore at {addr} (gave up after {timeout:?})"),
                    err,
                ));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// Makes [`get`](Rendezvous::get) fail with [`BootstrapError::Timeout`] after waiting
    /// `timeout` for a key, instead of waiting forever (the default).
    pub fn with_timeout(mut self, timeout: Duration) -> TcpStore {
        self.get_timeout = Some(timeout);
        self
    }

    /// The server address this store talks to.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    async fn checkout(&self) -> Result<BufReader<TcpStream>, BootstrapError> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if let Some(conn) = idle {
            return Ok(conn);
        }
        let context = || format!("opening a connection to TcpStore at {}", self.addr);
        match tokio::time::timeout(self.connect_timeout, open(self.addr)).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(OpenError::Protocol(msg))) => Err(BootstrapError::Protocol(msg)),
            Ok(Err(OpenError::Io(e))) => Err(BootstrapError::io(context(), e)),
            Err(_) => Err(BootstrapError::io(context(), io::ErrorKind::TimedOut.into())),
        }
    }

    fn checkin(&self, conn: BufReader<TcpStream>) {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(conn);
    }

    /// One request on one connection. The connection goes back to the pool only after a
    /// complete, successful exchange; on error or cancellation it is dropped (closed).
    async fn request(
        &self,
        op: u8,
        key: &str,
        value: Option<&[u8]>,
    ) -> Result<Option<Vec<u8>>, BootstrapError> {
        let opname = if op == OP_PUT { "PUT" } else { "GET" };
        let mut conn = self.checkout().await?;
        let mut header = Vec::with_capacity(1 + 4 + key.len() + 4);
        header.push(op);
        header.extend_from_slice(&len_u32(key.len()).to_le_bytes());
        header.extend_from_slice(key.as_bytes());
        if let Some(value) = value {
            header.extend_from_slice(&len_u32(value.len()).to_le_bytes());
        }
        let io_err = |e| BootstrapError::io(format!("{opname} {key:?} at TcpStore {}", self.addr), e);
        let s = conn.get_mut();
        s.write_all(&header).await.map_err(io_err)?;
        if let Some(value) = value {
            s.write_all(value).await.map_err(io_err)?;
        }
        let status = conn.read_u8().await.map_err(io_err)?;
        let reply = match status {
            STATUS_OK if op == OP_GET => {
                match read_limited(&mut conn, "value", MAX_VALUE_LEN).await.map_err(io_err)? {
                    Ok(value) => Some(value),
                    Err(msg) => return Err(BootstrapError::Protocol(format!("server sent a {msg}"))),
                }
            }
            STATUS_OK => None,
            STATUS_ERR => {
                let msg = match read_limited(&mut conn, "error message", MAX_ERROR_LEN).await {
                    Ok(Ok(msg)) => String::from_utf8_lossy(&msg).into_owned(),
                    _ => "(unreadable error message)".to_owned(),
                };
                return Err(BootstrapError::Protocol(format!("server rejected {opname} {key:?}: {msg}")));
            }
            other => {
                return Err(BootstrapError::Protocol(format!(
                    "server replied to {opname} {key:?} with unknown status {other:#04x}"
                )))
            }
        };
        self.checkin(conn);
        Ok(reply)
    }
}

enum OpenError {
    Io(io::Error),
    Protocol(String),
}

async fn open(addr: SocketAddr) -> Result<BufReader<TcpStream>, OpenError> {
    let mut stream = TcpStream::connect(addr).await.map_err(OpenError::Io)?;
    stream.set_nodelay(true).map_err(OpenError::Io)?;
    stream.write_all(&HELLO).await.map_err(OpenError::Io)?;
    let mut hello = [0u8; 4];
    stream.read_exact(&mut hello).await.map_err(OpenError::Io)?;
    if hello != HELLO {
        return Err(OpenError::Protocol(format!(
            "{addr} is not a fabric TcpStore server (it answered {:?})",
            hello.escape_ascii().to_string()
        )));
    }
    Ok(BufReader::new(stream))
}

fn check_key(key: &str) -> Result<(), BootstrapError> {
    if key.len() > MAX_KEY_LEN {
        return Err(BootstrapError::TooLarge { what: "key", len: key.len(), max: MAX_KEY_LEN });
    }
    Ok(())
}

#[async_trait::async_trait]
impl Rendezvous for TcpStore {
    /// Stores `value` under `key` on the server (the last write of a key wins).
    ///
    /// Fails with [`BootstrapError::TooLarge`] (sending nothing) if the key or value is over
    /// its limit.
    ///
    /// # Cancel safety
    ///
    /// If dropped, the value may or may not have been stored; the connection it used is
    /// closed, so the store stays usable. Retrying is harmless.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), BootstrapError> {
        check_key(key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(BootstrapError::TooLarge { what: "value", len: value.len(), max: MAX_VALUE_LEN });
        }
        self.request(OP_PUT, key, Some(&value)).await.map(drop)
    }

    /// Waits for `key` on the server and returns its value; with
    /// [`with_timeout`](TcpStore::with_timeout), fails with [`BootstrapError::Timeout`] after
    /// that long.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes the connection it used, which ends the wait on
    /// the server; the key and the store are unaffected.
    async fn get(&self, key: &str) -> Result<Vec<u8>, BootstrapError> {
        check_key(key)?;
        let request = self.request(OP_GET, key, None);
        let reply = match self.get_timeout {
            None => request.await?,
            Some(t) => tokio::time::timeout(t, request)
                .await
                .map_err(|_| BootstrapError::Timeout { key: key.to_owned() })??,
        };
        reply.ok_or_else(|| BootstrapError::Protocol("GET reply without a value".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_secs(10);

    fn localhost() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }

    async fn raw_client(server: &TcpStoreServer) -> TcpStream {
        let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
        s.write_all(&HELLO).await.unwrap();
        let mut hello = [0; 4];
        s.read_exact(&mut hello).await.unwrap();
        assert_eq!(hello, HELLO);
        s
    }

    async fn read_error(s: &mut TcpStream) -> String {
        assert_eq!(s.read_u8().await.unwrap(), STATUS_ERR);
        String::from_utf8(read_limited(s, "msg", MAX_ERROR_LEN).await.unwrap().unwrap()).unwrap()
    }

    #[tokio::test]
    async fn server_rejects_oversized_key_without_allocating() {
        tokio::time::timeout(BOUND, async {
            let server = TcpStoreServer::bind(localhost()).await.unwrap();
            let mut s = raw_client(&server).await;
            let mut frame = vec![OP_PUT];
            frame.extend_from_slice(&(1u32 << 30).to_le_bytes());
            s.write_all(&frame).await.unwrap();
            let msg = read_error(&mut s).await;
            assert!(msg.contains("key is 1073741824 bytes"), "{msg}");
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn server_rejects_oversized_value_and_unknown_op() {
        tokio::time::timeout(BOUND, async {
            let server = TcpStoreServer::bind(localhost()).await.unwrap();
            let mut s = raw_client(&server).await;
            let mut frame = vec![OP_PUT];
            frame.extend_from_slice(&1u32.to_le_bytes());
            frame.push(b'k');
            frame.extend_from_slice(&u32::MAX.to_le_bytes());
            s.write_all(&frame).await.unwrap();
            let msg = read_error(&mut s).await;
            assert!(msg.contains("value is 4294967295 bytes"), "{msg}");

            let mut s = raw_client(&server).await;
            s.write_all(b"X").await.unwrap();
            let msg = read_error(&mut s).await;
            assert!(msg.contains("unknown operation"), "{msg}");
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn client_rejects_a_server_that_is_not_a_store() {
        tokio::time::timeout(BOUND, async {
            let listener = TcpListener::bind(localhost()).await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                let _ = s.write_all(b"HTTP/1.1 400\r\n").await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            });
            let err = TcpStore::connect_timeout(addr, Duration::from_secs(5)).await.unwrap_err();
            assert!(
                matches!(err, BootstrapError::Protocol(ref m) if m.contains("not a fabric TcpStore")),
                "{err}"
            );
        })
        .await
        .unwrap();
    }
}
