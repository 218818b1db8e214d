//! SIGTERM and SIGINT (what schedulers and Ctrl-C send) as a request to stop: training sees it
//! at the next step boundary, where every rank learns of it through the step's loss sum, rank
//! 0 saves a checkpoint, and every rank exits with 128 + the signal. A second signal of the
//! either kind ends the process at once, as the default action would have.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM};

/// The signal received (0: none yet).
static RECEIVED: OnceLock<Arc<AtomicUsize>> = OnceLock::new();

/// Catches SIGTERM and SIGINT from now on (idempotent).
pub fn install() -> Result<()> {
    if RECEIVED.get().is_some() {
        return Ok(());
    }
    let received = Arc::new(AtomicUsize::new(0));
    let seen_before = Arc::new(AtomicBool::new(false));
    for signal in [SIGTERM, SIGINT] {
        // Registered first, so it sees the flag as it was before this signal: set by an
        // earlier one, the default action (ending the process) runs.
        signal_hook::flag::register_conditional_default(signal, seen_before.clone())
            .with_context(|| format!("cannot handle signal {signal}"))?;
        signal_hook::flag::register(signal, seen_before.clone())
            .with_context(|| format!("cannot handle signal {signal}"))?;
        signal_hook::flag::register_usize(signal, received.clone(), signal as usize)
            .with_context(|| format!("cannot handle signal {signal}"))?;
    }
    let _ = RECEIVED.set(received);
    Ok(())
}

/// The signal this process received since `install`, if any.
pub fn received() -> Option<i32> {
    let signal = RECEIVED.get()?.load(Ordering::SeqCst);
    (signal != 0).then_some(signal as i32)
}

/// The signal's name, as `kill -l` prints it.
pub fn name(signal: i32) -> String {
    match signal {
        SIGTERM => "SIGTERM".into(),
        SIGINT => "SIGINT".into(),
        other => format!("signal {other}"),
    }
}

/// A run stopped by a signal after saving where it stood: an error (the run did not finish)
/// that ends every rank with 128 + the signal rather than aborting the job.
#[derive(Debug, Clone)]
pub struct Interrupted {
    pub signal: i32,
    /// Optimizer steps completed.
    pub step: usize,
    /// The checkpoint saved (rank 0; None elsewhere, or where the save failed).
    pub checkpoint: Option<PathBuf>,
    /// Whether this process is rank 0, the one that reports.
    pub root: bool,
}

impl Interrupted {
    /// The exit status a process killed by the signal would have had, as shells report it.
    pub fn exit_code(&self) -> u8 {
        (128 + self.signal).clamp(0, 255) as u8
    }
}

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "stopped by {} after step {}",
            name(self.signal),
            self.step
        )?;
        match &self.checkpoint {
            Some(dir) => write!(
                f,
                "; saved {}: continue with --resume latest",
                dir.display()
            ),
            None if self.root => write!(f, "; no checkpoint was saved"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for Interrupted {}
