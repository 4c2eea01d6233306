//! [`EtcdStore`]: bootstrap and membership of a fleet through etcd's v3 API (feature `etcd`).
//!
//! Every key lives under one prefix. Each process grants itself a **lease** (a TTL, 10 s by
//! default) and attaches every key it writes to it; a background task keeps the lease alive
//! while the store lives. When the process dies, the keep-alives stop, etcd expires the lease
//! and deletes its keys, so a dead process's addresses and descriptors do not linger.
//!
//! ```text
//!   {prefix}/kv/{key}          Rendezvous::put / get (values of this process, under its lease)
//!   {prefix}/members/{name}    EtcdStore::join (one per process: its engine address, say)
//!
//!   process A ──put/keep-alive──►  etcd  ◄──put/keep-alive── process B
//!                                   │ watch {prefix}/members/
//!                                   ▼
//!                MemberEvent::Joined { name, value } / MemberEvent::Left { name }
//! ```
//!
//! [`EtcdStore::members`] gives the current members with the revision they were read at;
//! [`EtcdStore::watch_members`] gives them as `Joined` events and then every change as it
//! happens, a `Stream` to feed a membership view (add the peer on `Joined`, stop routing to
//! it on `Left`). A process that leaves cleanly calls [`EtcdStore::leave`] (its lease is
//! revoked: `Left` at once); one that dies is reported `Left` when its lease expires, one TTL
//! after its last keep-alive at most.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions, WatchStream};
use futures::Stream;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::bootstrap::{BootstrapError, Rendezvous};

/// The lease TTL of [`EtcdOptions::default`].
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// Settings of [`EtcdStore::connect`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// The lease's time to live: how long after a process's last keep-alive its keys are
    /// deleted. Whole seconds (rounded up, at least 1); etcd may raise very short ones to its
    /// minimum (about 1.5 s with default settings). Keep-alives go out every third of it.
    pub lease_ttl: Duration,
    /// How long connecting (and each request) may take.
    pub connect_timeout: Duration,
    /// How long [`Rendezvous::get`] waits for a key before [`BootstrapError::Timeout`].
    pub get_timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            lease_ttl: DEFAULT_LEASE_TTL,
            connect_timeout: Duration::from_secs(10),
            get_timeout: Duration::from_secs(60),
        }
    }
}

impl EtcdOptions {
    /// These options with lease TTL `ttl`.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// These options with `get` timeout `timeout`.
    pub fn get_timeout(mut self, timeout: Duration) -> Self {
        self.get_timeout = timeout;
        self
    }

    /// These options with connect (and request) timeout `timeout`.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }
}

/// A change in the membership of a prefix (see [`EtcdStore::watch_members`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemberEvent {
    /// `name` joined (or was there when the watch started), with the value it joined with.
    Joined { name: String, value: Vec<u8> },
    /// `name` wrote a new value under its member key.
    Updated { name: String, value: Vec<u8> },
    /// `name` left: it called [`EtcdStore::leave`], or its lease expired (it died or lost
    /// etcd for longer than its TTL).
    Left { name: String },
}

fn etcd_err(context: impl Into<String>, e: etcd_client::Error) -> BootstrapError {
    BootstrapError::Store { context: context.into(), source: Box::new(e) }
}

/// A [`Rendezvous`] over etcd v3, with a lease per process and a membership watch.
///
/// Cloning is not offered: one `EtcdStore` is one process's lease. Dropping it stops the
/// keep-alive task, so its keys expire one TTL later; [`leave`](Self::leave) removes them at
/// once.
pub struct EtcdStore {
    client: Client,
    prefix: String,
    lease: i64,
    ttl: Duration,
    get_timeout: Duration,
    keepalive: JoinHandle<()>,
}

impl fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStore")
            .field("prefix", &self.prefix)
            .field("lease", &format_args!("{:x}", self.lease))
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.keepalive.abort();
    }
}

impl EtcdStore {
    /// Connects to etcd at `endpoints` (`"127.0.0.1:2379"`, `"http://host:2379"`), grants
    /// this process's lease and starts keeping it alive (a tokio task). Keys live under
    /// `prefix` (no trailing `/`; `"fabric/job-7"`).
    ///
    /// # Cancel safety
    ///
    /// If dropped, nothing is kept: a lease already granted expires after its TTL, as a dead
    /// process's would.
    pub async fn connect<E: AsRef<str>>(
        endpoints: &[E],
        prefix: &str,
        opts: EtcdOptions,
    ) -> Result<EtcdStore, BootstrapError> {
        let eps: Vec<&str> = endpoints.iter().map(|e| e.as_ref()).collect();
        if eps.is_empty() {
            return Err(BootstrapError::Protocol("no etcd endpoint given".into()));
        }
        let copts = ConnectOptions::new()
            .with_connect_timeout(opts.connect_timeout)
            .with_timeout(opts.connect_timeout);
        let mut client = tokio::time::timeout(opts.connect_timeout, Client::connect(&eps, Some(copts)))
            .await
            .map_err(|_| BootstrapError::Timeout { key: format!("connecting to etcd at {eps:?}") })?
            .map_err(|e| etcd_err(format!("connecting to etcd at {eps:?}"), e))?;
        let secs = opts.lease_ttl.as_secs_f64().ceil().max(1.0) as i64;
        let grant = client.lease_grant(secs, None).await.map_err(|e| etcd_err("granting a lease", e))?;
        let lease = grant.id();
        let ttl = Duration::from_secs(grant.ttl().max(1) as u64);
        let keepalive = tokio::spawn(keep_alive(client.clone(), lease, ttl));
        tracing::debug!(prefix, lease = format_args!("{lease:x}"), ?ttl, "etcd lease granted");
        Ok(EtcdStore {
            client,
            prefix: prefix.trim_end_matches('/').to_string(),
            lease,
            ttl,
            get_timeout: opts.get_timeout,
            keepalive,
        })
    }

    /// This process's lease id.
    pub fn lease_id(&self) -> i64 {
        self.lease
    }

    /// The lease TTL etcd granted.
    pub fn lease_ttl(&self) -> Duration {
        self.ttl
    }

    /// The prefix every key of this store lives under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn kv_key(&self, key: &str) -> String {
        format!("{}/kv/{key}", self.prefix)
    }

    fn members_prefix(&self) -> String {
        format!("{}/members/", self.prefix)
    }

    /// Announces this process as member `name` with `value` (its engine address, a region
    /// descriptor, ...), under its lease: watchers see [`MemberEvent::Joined`].
    ///
    /// # Cancel safety
    ///
    /// If dropped, the member key may or may not have been written; joining again is harmless
    /// (watchers then see `Updated`).
    pub async fn join(&self, name: &str, value: Vec<u8>) -> Result<(), BootstrapError> {
        check_name(name)?;
        let key = format!("{}{name}", self.members_prefix());
        let mut c = self.client.clone();
        c.put(key, value, Some(PutOptions::new().with_lease(self.lease)))
            .await
            .map_err(|e| etcd_err(format!("joining as {name:?}"), e))?;
        tracing::debug!(member = name, prefix = %self.prefix, "joined");
        Ok(())
    }

    /// The members now, by name, and the etcd revision they were read at.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn members(&self) -> Result<(Vec<(String, Vec<u8>)>, i64), BootstrapError> {
        let prefix = self.members_prefix();
        let mut c = self.client.clone();
        let resp = c
            .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| etcd_err("listing members", e))?;
        let rev = resp.header().map_or(0, |h| h.revision());
        let mut out = Vec::with_capacity(resp.kvs().len());
        for kv in resp.kvs() {
            out.push((member_name(&prefix, kv.key())?, kv.value().to_vec()));
        }
        Ok((out, rev))
    }

    /// The members now (as `Joined` events), then every join, update and departure as it
    /// happens. The stream ends with an error if the watch breaks (etcd unreachable); start
    /// a new one to resume (it begins with the members of that moment).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a watch opened before the drop is closed with its dropped stream.
    pub async fn watch_members(&self) -> Result<MemberEvents, BootstrapError> {
        let (now, rev) = self.members().await?;
        let prefix = self.members_prefix();
        let mut c = self.client.clone();
        let watch = c
            .watch(prefix.clone(), Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1)))
            .await
            .map_err(|e| etcd_err("watching members", e))?;
        let ready = now.into_iter().map(|(name, value)| Ok(MemberEvent::Joined { name, value })).collect();
        Ok(MemberEvents { prefix, watch, ready, done: false })
    }

    /// Leaves: revokes the lease, so every key of this process (its member key included) is
    /// deleted now and watchers see [`MemberEvent::Left`].
    ///
    /// # Cancel safety
    ///
    /// The keep-alive stops at once; if dropped before etcd answered, the lease may still be
    /// live, and its keys go when it expires (within its TTL).
    pub async fn leave(self) -> Result<(), BootstrapError> {
        self.keepalive.abort();
        let mut c = self.client.clone();
        c.lease_revoke(self.lease).await.map_err(|e| etcd_err("revoking the lease", e))?;
        tracing::debug!(prefix = %self.prefix, "left (lease revoked)");
        Ok(())
    }
}

fn check_name(name: &str) -> Result<(), BootstrapError> {
    if name.is_empty() || name.contains('/') {
        return Err(BootstrapError::Protocol(format!("member name {name:?} must be non-empty, without '/'")));
    }
    Ok(())
}

fn member_name(prefix: &str, key: &[u8]) -> Result<String, BootstrapError> {
    std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.strip_prefix(prefix))
        .map(str::to_string)
        .ok_or_else(|| BootstrapError::Protocol(format!("member key {:?} is not under {prefix:?}", key)))
}

/// Sends a keep-alive every third of the TTL until aborted. Errors are logged and retried
/// (a new keep-alive stream each time); a lease etcd reports expired ends the task.
async fn keep_alive(mut client: Client, lease: i64, ttl: Duration) {
    let every = (ttl / 3).max(Duration::from_millis(200));
    loop {
        let (mut keeper, mut stream) = match client.lease_keep_alive(lease).await {
            Ok(ks) => ks,
            Err(e) => {
                tracing::warn!(lease = format_args!("{lease:x}"), error = %e, "etcd keep-alive stream failed; retrying");
                tokio::time::sleep(every).await;
                continue;
            }
        };
        loop {
            if let Err(e) = keeper.keep_alive().await {
                tracing::warn!(lease = format_args!("{lease:x}"), error = %e, "etcd keep-alive failed; retrying");
                break;
            }
            match stream.message().await {
                Ok(Some(r)) if r.ttl() <= 0 => {
                    tracing::warn!(
                        lease = format_args!("{lease:x}"),
                        "etcd lease expired; this process's keys are gone"
                    );
                    return;
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(lease = format_args!("{lease:x}"), error = %e, "etcd keep-alive failed; retrying");
                    break;
                }
            }
            tokio::time::sleep(every).await;
        }
        tokio::time::sleep(every).await;
    }
}

/// The stream of [`EtcdStore::watch_members`]: [`MemberEvent`]s, or one error and then the end.
pub struct MemberEvents {
    prefix: String,
    watch: WatchStream,
    ready: VecDeque<Result<MemberEvent, BootstrapError>>,
    done: bool,
}

impl fmt::Debug for MemberEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemberEvents")
            .field("prefix", &self.prefix)
            .field("ready", &self.ready.len())
            .finish()
    }
}

impl Stream for MemberEvents {
    type Item = Result<MemberEvent, BootstrapError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(e) = this.ready.pop_front() {
                return Poll::Ready(Some(e));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.watch).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(BootstrapError::Protocol("the etcd watch ended".into()))));
                }
                Poll::Ready(Some(Err(e))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(etcd_err("watching members", e))));
                }
                Poll::Ready(Some(Ok(resp))) => {
                    if resp.canceled() {
                        this.done = true;
                        let why = format!("etcd cancelled the watch: {}", resp.cancel_reason());
                        return Poll::Ready(Some(Err(BootstrapError::Protocol(why))));
                    }
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        let name = match member_name(&this.prefix, kv.key()) {
                            Ok(n) => n,
                            Err(e) => {
                                this.ready.push_back(Err(e));
                                continue;
                            }
                        };
                        let event = match ev.event_type() {
                            EventType::Delete => {
                                tracing::debug!(member = %name, "member left");
                                MemberEvent::Left { name }
                            }
                            EventType::Put if kv.version() == 1 => {
                                tracing::debug!(member = %name, "member joined");
                                MemberEvent::Joined { name, value: kv.value().to_vec() }
                            }
                            EventType::Put => MemberEvent::Updated { name, value: kv.value().to_vec() },
                        };
                        this.ready.push_back(Ok(event));
                    }
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl Rendezvous for EtcdStore {
    /// Stores `value` under `{prefix}/kv/{key}`, attached to this process's lease (it is
    /// deleted when the process leaves or dies).
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), BootstrapError> {
        let mut c = self.client.clone();
        c.put(self.kv_key(key), value, Some(PutOptions::new().with_lease(self.lease)))
            .await
            .map_err(|e| etcd_err(format!("put {key:?}"), e))?;
        Ok(())
    }

    /// Reads `{prefix}/kv/{key}`; if it is not there yet, watches it from the revision of that
    /// read (so a put in between is not missed) until it is, for up to the get timeout.
    async fn get(&self, key: &str) -> Result<Vec<u8>, BootstrapError> {
        let full = self.kv_key(key);
        let deadline = Instant::now() + self.get_timeout;
        let timeout = || BootstrapError::Timeout { key: key.to_string() };
        let mut c = self.client.clone();
        let resp = c.get(full.clone(), None).await.map_err(|e| etcd_err(format!("get {key:?}"), e))?;
        if let Some(kv) = resp.kvs().first() {
            return Ok(kv.value().to_vec());
        }
        let rev = resp.header().map_or(0, |h| h.revision());
        let mut watch = c
            .watch(full, Some(WatchOptions::new().with_start_revision(rev + 1)))
            .await
            .map_err(|e| etcd_err(format!("watch {key:?}"), e))?;
        loop {
            let msg = tokio::time::timeout_at(deadline, watch.message()).await.map_err(|_| timeout())?;
            let resp = match msg {
                Ok(Some(r)) => r,
                Ok(None) => return Err(BootstrapError::Protocol(format!("the etcd watch of {key:?} ended"))),
                Err(e) => return Err(etcd_err(format!("watch {key:?}"), e)),
            };
            if resp.canceled() {
                let why = format!("etcd cancelled the watch of {key:?}: {}", resp.cancel_reason());
                return Err(BootstrapError::Protocol(why));
            }
            for ev in resp.events() {
                if let (EventType::Put, Some(kv)) = (ev.event_type(), ev.kv()) {
                    return Ok(kv.value().to_vec());
                }
            }
        }
    }
}
