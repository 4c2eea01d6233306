//! Pinning measuring threads to cores of their own, for `rtt` and `bw`: both processes
//! compute the same plan from sysfs, the leader takes the first cores and the peer the next.

use std::collections::BTreeMap;
use std::fs;
use std::marker::PhantomData;
use std::sync::OnceLock;

/// The CPUs the two sides' measuring threads run on: the first CPU of two physical cores,
/// neither of them core 0's (it takes most interrupts). `None` with fewer than three
/// physical cores in this process's affinity mask: pinning would then share a core with
/// everything else, and the figures are as good unpinned.
pub fn plan() -> Option<[usize; 2]> {
    let free = free_cores(2)?;
    Some([free[0], free[1]])
}

/// Where `rtt` pins each side's `BusyPoll` reactor thread: a physical core of its own
/// besides the two of [`plan`], as a user of that mode would (`EngineBuilder::pin_core`), so
/// that the reactor never shares a CPU with a measuring thread. `None` with fewer than five
/// physical cores (the reactors are then left unpinned).
pub fn plan_reactors() -> Option<[usize; 2]> {
    let free = free_cores(4)?;
    Some([free[2], free[3]])
}

/// `bw`'s plan: four CPUs of four physical cores other than core 0's, leader first, each
/// side's "NIC" CPU (the raw loop's thread and the engine's reactor thread, which do the same
/// work and never run at once) then its "app" CPU (the runtime's thread that awaits). `None`
/// with fewer than five physical cores.
pub fn plan_bw() -> Option<[usize; 4]> {
    let free = free_cores(4)?;
    Some([free[0], free[1], free[2], free[3]])
}

/// The first CPU of each physical core in this process's mask, core 0's left out, if there
/// are at least `n` of them and one more core (core 0's, or any) besides.
fn free_cores(n: usize) -> Option<Vec<usize>> {
    let allowed = allowed()?;
    let mut cores: BTreeMap<(u32, u32), usize> = BTreeMap::new();
    let mut core0 = None;
    for &cpu in &allowed {
        let read = |f: &str| -> Option<u32> {
            fs::read_to_string(format!("/sys/devices/system/cpu/cpu{cpu}/topology/{f}"))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        let key = (read("physical_package_id").unwrap_or(0), read("core_id")?);
        if cpu == 0 {
            core0 = Some(key);
        }
        cores.entry(key).or_insert(cpu);
    }
    let free: Vec<usize> = cores.iter().filter(|(k, _)| Some(**k) != core0).map(|(_, &cpu)| cpu).collect();
    (cores.len() > n && free.len() >= n).then_some(free)
}

/// The affinity mask of the process when it started (`remember_start_mask`), which every
/// child process gets back: threads made while a pinned thread runs inherit its one CPU,
/// and so would the tools they start (fabtests' server and client on one core).
static START_MASK: OnceLock<libc::cpu_set_t> = OnceLock::new();

/// Records the calling thread's mask as the process's (call first thing in `main`).
pub fn remember_start_mask() {
    if let Some(set) = thread_mask() {
        let _ = START_MASK.set(set);
    }
}

/// Gives the calling thread the process's start mask back.
pub fn reset_to_start_mask() {
    if let Some(set) = START_MASK.get() {
        set_thread_mask(set);
    }
}

/// The calling thread's affinity mask.
fn thread_mask() -> Option<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is plain data for which all-zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is a live cpu_set_t of the size passed.
    (unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } == 0)
        .then_some(set)
}

/// Sets the calling thread's affinity mask; whether it took.
fn set_thread_mask(set: &libc::cpu_set_t) -> bool {
    // SAFETY: pid 0 is the calling thread; `set` is a live cpu_set_t of the size passed.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) == 0 }
}

/// Makes `cmd`'s child run with the process's start mask, whichever thread starts it.
pub fn unpinned(cmd: &mut std::process::Command) -> &mut std::process::Command {
    let Some(set) = START_MASK.get().copied() else { return cmd };
    child_mask(cmd, set)
}

/// Makes `cmd`'s child run on `cpu` only (`None`: as [`unpinned`]): a tool measured beside a
/// pinned raw loop gets the same CPUs (fabtests' server and client are one thread each).
pub fn child_on(cmd: &mut std::process::Command, cpu: Option<usize>) -> &mut std::process::Command {
    match cpu.and_then(only) {
        Some(set) => child_mask(cmd, set),
        None => unpinned(cmd),
    }
}

/// The mask of `cpu` alone (`None` past `CPU_SETSIZE`).
fn only(cpu: usize) -> Option<libc::cpu_set_t> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return None;
    }
    // SAFETY: cpu_set_t is plain data for which all-zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (checked above), so CPU_SET stays inside `set`.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    Some(set)
}

/// `cmd`'s child sets its affinity to `set` before exec.
fn child_mask(cmd: &mut std::process::Command, set: libc::cpu_set_t) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls
    // sched_setaffinity on a mask it owns (a copy): async-signal-safe, no allocation, no lock.
    unsafe {
        cmd.pre_exec(move || {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            Ok(())
        })
    }
}

/// The CPUs this thread may run on.
fn allowed() -> Option<Vec<usize>> {
    let set = thread_mask()?;
    // SAFETY: every index is below CPU_SETSIZE, inside `set`.
    Some((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// While alive, the calling thread runs on `cpu` only; dropping it restores the mask it had
/// (these are blocking-pool threads, reused by later tests).
pub struct Pinned {
    old: libc::cpu_set_t,
    /// Not `Send`: the mask is restored on the thread that set it.
    _thread: PhantomData<*const ()>,
}

impl Pinned {
    /// Pins the calling thread to `cpu` (`None`: leaves it as it is).
    pub fn to(cpu: Option<usize>) -> Option<Pinned> {
        let new = only(cpu?)?;
        let old = thread_mask()?;
        set_thread_mask(&new).then_some(Pinned { old, _thread: PhantomData })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // On the thread that made this `Pinned` (not `Send`): the mask read from it.
        set_thread_mask(&self.old);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_names_two_distinct_cores_other_than_cpu0() {
        // On a machine of fewer than three physical cores there is no plan; either way the
        // call must not fail.
        if let Some([a, b]) = plan() {
            assert_ne!(a, b);
            assert!(a != 0 && b != 0);
        }
    }

    #[test]
    fn pinning_moves_the_thread_and_dropping_restores_it() {
        std::thread::spawn(|| {
            let before = allowed().unwrap();
            let cpu = *before.last().unwrap();
            {
                let _p = Pinned::to(Some(cpu)).expect("pin to an allowed cpu");
                assert_eq!(allowed().unwrap(), vec![cpu]);
            }
            assert_eq!(allowed().unwrap(), before);
            assert!(Pinned::to(None).is_none());
        })
        .join()
        .unwrap();
    }

    /// `child_on(Some(cpu))` runs a child on that CPU alone; `None` leaves it the start mask.
    #[test]
    fn child_on_runs_a_child_on_that_cpu_only() {
        let allowed = allowed().unwrap();
        let cpu = *allowed.last().unwrap();
        let list = |cmd: &mut std::process::Command| {
            let out = cmd.args(["Cpus_allowed_list", "/proc/self/status"]).output().unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        let line = list(child_on(&mut std::process::Command::new("grep"), Some(cpu)));
        assert_eq!(line, format!("Cpus_allowed_list:\t{cpu}"));
        // None: the start mask (here, where nothing pinned this thread, the mask it has).
        if allowed.len() > 1 {
            let line = list(child_on(&mut std::process::Command::new("grep"), None));
            assert_ne!(line, format!("Cpus_allowed_list:\t{cpu}"));
        }
    }

    /// A child started from a pinned thread, and a thread made by it, get the start mask.
    #[test]
    fn children_and_new_threads_get_the_start_mask_back() {
        std::thread::spawn(|| {
            remember_start_mask();
            let start = allowed().unwrap();
            if start.len() < 2 {
                return; // one CPU: nothing to tell apart
            }
            let _p = Pinned::to(Some(start[0])).expect("pin to an allowed cpu");
            let out = unpinned(&mut std::process::Command::new("grep"))
                .args(["Cpus_allowed_list", "/proc/self/status"])
                .output()
                .unwrap();
            let line = String::from_utf8_lossy(&out.stdout).to_string();
            let inherited = std::process::Command::new("grep")
                .args(["Cpus_allowed_list", "/proc/self/status"])
                .output()
                .unwrap();
            assert_ne!(line, String::from_utf8_lossy(&inherited.stdout), "the control inherits the pin");
            assert!(!line.trim().ends_with(&format!("\t{}", start[0])), "{line}");
            let t = std::thread::spawn(|| {
                reset_to_start_mask();
                allowed().unwrap()
            });
            assert_eq!(t.join().unwrap(), start);
        })
        .join()
        .unwrap();
    }
}
