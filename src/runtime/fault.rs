//! Fault injection for the crash-safety tests: with `SPRTRAIN_FAULT_KILL_AT=N` in the
//! environment, the process kills itself (SIGKILL, nothing flushed or cleaned up) at the Nth
//! fault point it passes. Fault points mark each step of writing output: every file written
//! under its temporary name, every rename into place, every removal of an old checkpoint.
//! Without the variable a point costs one load of a cached value.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The variable that arms the fault points.
pub const KILL_AT: &str = "SPRTRAIN_FAULT_KILL_AT";

static PASSED: AtomicUsize = AtomicUsize::new(0);

fn kill_at() -> Option<usize> {
    static AT: OnceLock<Option<usize>> = OnceLock::new();
    *AT.get_or_init(|| std::env::var(KILL_AT).ok()?.trim().parse().ok())
}

/// One step of a save sequence (`what` names it for the test's log).
pub fn point(what: &str) {
    let Some(at) = kill_at() else {
        return;
    };
    let n = PASSED.fetch_add(1, Ordering::SeqCst) + 1;
    if n == at {
        eprintln!("sprtrain: fault point {n} ({what}): killing the process");
        // SAFETY: raising a signal on this process has no memory-safety preconditions.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}
