//! libfabric < 1.18 only: a dead peer's region lock. 1.17's shm takes the peer's region
//! spinlock with a blocking `pthread_spin_lock` in every post; each peer's lock word is mapped
//! here ([`PeerLock`]) and [`lock_doctor`] releases one its dead owner left held (see the
//! parent module and docs/faults.md).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// libfabric < 1.18 only: the spinlock in the header of a peer's shm region, mapped here
/// with the peer's pidfd, so that a lock its dead owner left held can be released
/// ([`lock_doctor`]). libfabric 1.17's `struct smr_region` (`include/ofi_shm.h`): `version`
/// u8 at 0 (`SMR_VERSION` 4), `pid` i32 at 4, `lock` (`pthread_spinlock_t`) at 24. The peer
/// holds that lock while it processes its command queue, and a sender takes it with a
/// blocking `pthread_spin_lock` in every post to it: a peer killed inside that section left
/// the sender's post spinning forever (docs/faults.md).
pub(super) struct PeerLock {
    /// The first page of the peer's region, mapped shared, read-write.
    map: std::ptr::NonNull<libc::c_void>,
    /// The peer's process: readable once it has exited.
    pidfd: OwnedFd,
    pid: libc::pid_t,
    /// The value of an unlocked `pthread_spinlock_t` here.
    unlocked: i32,
}

const SMR_LOCK_OFFSET: usize = 24;
const SMR_PID_OFFSET: usize = 4;
const SMR_VERSION_1_17: u8 = 4;
const LOCK_VIEW_LEN: usize = 4096;
/// How often the doctor looks, and how many looks in a row must find the lock held with its
/// owner dead before it is released.
const DOCTOR_EVERY: Duration = Duration::from_millis(5);
const DOCTOR_STRIKES: u32 = 2;

impl PeerLock {
    /// Maps the header of the region named in `addr` (`"fi_shm://NAME"`), if it is a 1.17
    /// region of process `pid`.
    pub(super) fn open(addr: &[u8], pid: libc::pid_t, pidfd: &OwnedFd, unlocked: i32) -> Option<PeerLock> {
        let name = addr.strip_prefix(b"fi_shm://")?;
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        let cname = std::ffi::CString::new(name).ok()?;
        let pidfd = pidfd.try_clone().ok()?;
        // SAFETY: cname is NUL-terminated; opening an existing object creates nothing.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: fd is an open shm object of 16 MiB (libfabric's region); its first page is
        // mapped shared; the fd can be closed once mapped.
        let map = unsafe {
            let m = libc::mmap(
                std::ptr::null_mut(),
                LOCK_VIEW_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            m
        };
        if map == libc::MAP_FAILED {
            return None;
        }
        let lock = PeerLock { map: std::ptr::NonNull::new(map)?, pidfd, pid, unlocked };
        // SAFETY: both offsets are inside the mapped page and aligned for their types.
        let (version, owner) = unsafe {
            let base = lock.map.as_ptr().cast::<u8>();
            (base.read_volatile(), base.add(SMR_PID_OFFSET).cast::<i32>().read_volatile())
        };
        (version == SMR_VERSION_1_17 && owner == pid).then_some(lock)
    }

    fn word(&self) -> &std::sync::atomic::AtomicI32 {
        // SAFETY: the page stays mapped for self's life; the word is 4-aligned; libfabric's
        // `pthread_spin_*` change it with atomic instructions only.
        unsafe {
            &*self.map.as_ptr().cast::<u8>().add(SMR_LOCK_OFFSET).cast::<std::sync::atomic::AtomicI32>()
        }
    }

    fn held(&self) -> bool {
        self.word().load(std::sync::atomic::Ordering::Acquire) != self.unlocked
    }

    fn owner_exited(&self) -> bool {
        let mut p = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
    }

    /// Releases the lock if it is still held: only for an owner that exited.
    fn release(&self) -> bool {
        let held = self.word().load(std::sync::atomic::Ordering::Acquire);
        held != self.unlocked
            && self
                .word()
                .compare_exchange(
                    held,
                    self.unlocked,
                    std::sync::atomic::Ordering::Release,
                    std::sync::atomic::Ordering::Relaxed,
                )
                .is_ok()
    }
}

impl Drop for PeerLock {
    fn drop(&mut self) {
        // SAFETY: the page was mapped by `open` and is unmapped once.
        unsafe { libc::munmap(self.map.as_ptr(), LOCK_VIEW_LEN) };
    }
}

// SAFETY: the mapping is shared memory, used only through atomics; the fd is a plain fd.
unsafe impl Send for PeerLock {}
// SAFETY: as above.
unsafe impl Sync for PeerLock {}

/// The value of an unlocked `pthread_spinlock_t` in this C library (glibc on x86-64: 1, its
/// assembly lock decrements; the generic C one: 0), found by initialising one.
pub(super) fn spin_unlocked_value() -> i32 {
    let mut lock: libc::pthread_spinlock_t = 0;
    // SAFETY: a local spinlock, initialised and destroyed here.
    unsafe {
        libc::pthread_spin_init(&mut lock, libc::PTHREAD_PROCESS_SHARED);
        let v = std::ptr::read_volatile(&lock);
        libc::pthread_spin_destroy(&mut lock);
        v
    }
}

/// Whether the libfabric loaded is older than 1.18, whose shm took the peer's region lock in
/// every post (1.18 replaced that queue by a lock-free one).
pub(super) fn shm_post_takes_peer_lock() -> bool {
    super::super::version() < (1, 18)
}

/// The peer locks the doctor watches, for every domain of this process; `running`: whether
/// its thread is up.
struct Doctor {
    locks: Vec<(Weak<PeerLock>, u32)>,
    running: bool,
}

static DOCTOR: Mutex<Doctor> = Mutex::new(Doctor { locks: Vec::new(), running: false });

/// Hands a peer lock to the doctor: a thread of its own (the reactor may be the thread
/// stuck in the post), which every [`DOCTOR_EVERY`] looks at each lock, and releases one
/// that it finds held [`DOCTOR_STRIKES`] times in a row while its owner's pidfd says the
/// owner exited. Nothing else ever releases it: the owner is dead, and its region is read
/// by nobody but the senders still posting to it, whose operations then fail at the
/// pidfd check. The thread ends when no lock is left to watch.
pub(super) fn lock_doctor(lock: &Arc<PeerLock>) {
    let mut d = DOCTOR.lock().unwrap_or_else(|p| p.into_inner());
    d.locks.push((Arc::downgrade(lock), 0));
    if d.running {
        return;
    }
    let spawned = std::thread::Builder::new().name("fabric-shm-locks".into()).spawn(|| loop {
        std::thread::sleep(DOCTOR_EVERY);
        let mut d = DOCTOR.lock().unwrap_or_else(|p| p.into_inner());
        d.locks.retain(|(w, _)| w.strong_count() > 0);
        if d.locks.is_empty() {
            d.running = false;
            return;
        }
        for (w, strikes) in d.locks.iter_mut() {
            let Some(lock) = w.upgrade() else { continue };
            if !(lock.held() && lock.owner_exited()) {
                *strikes = 0;
                continue;
            }
            *strikes += 1;
            if *strikes >= DOCTOR_STRIKES && lock.release() {
                *strikes = 0;
                tracing::warn!(pid = lock.pid, "released the shm region lock that a dead peer left held");
            }
        }
    });
    match spawned {
        Ok(_) => d.running = true,
        Err(e) => tracing::warn!(error = %e, "no thread to watch the shm peers' region locks"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake 1.17 region header in /dev/shm, its lock left held by a process that exited:
    /// the view opens, sees it held and its owner gone, and releases it; a region of
    /// another pid is not opened.
    #[test]
    fn a_dead_owners_region_lock_is_released() {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id() as libc::pid_t;
        let pidfd = crate::sys::pidfd_open(pid).expect("pidfd");
        child.wait().expect("wait");
        let unlocked = spin_unlocked_value();
        let name = format!("fabric-lock-test-{}", std::process::id());
        let cname = std::ffi::CString::new(name.clone()).unwrap();
        let mut page = vec![0u8; LOCK_VIEW_LEN];
        page[0] = SMR_VERSION_1_17;
        page[SMR_PID_OFFSET..SMR_PID_OFFSET + 4].copy_from_slice(&pid.to_ne_bytes());
        page[SMR_LOCK_OFFSET..SMR_LOCK_OFFSET + 4].copy_from_slice(&(1 - unlocked).to_ne_bytes());
        // SAFETY: a new shm object of this test, written through its own fd, then closed.
        unsafe {
            let fd = libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600);
            assert!(fd >= 0, "shm_open");
            assert_eq!(libc::write(fd, page.as_ptr().cast(), page.len()), page.len() as isize);
            libc::close(fd);
        }
        let addr = format!("fi_shm://{name}\0");
        assert!(PeerLock::open(addr.as_bytes(), pid + 1, &pidfd, unlocked).is_none(), "another pid's region");
        let lock = PeerLock::open(addr.as_bytes(), pid, &pidfd, unlocked).expect("the view opens");
        assert!(lock.held() && lock.owner_exited());
        assert!(lock.release());
        assert!(!lock.held() && !lock.release());
        // SAFETY: the object this test created.
        unsafe { libc::shm_unlink(cname.as_ptr()) };
    }
}
