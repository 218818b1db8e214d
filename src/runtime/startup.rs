//! Where the time before the first training step goes: the phases of startup, each marked when
//! it ends, reported in metrics.jsonl's `train_begin` (issue: startup within a second).

use std::sync::Mutex;
use std::time::SystemTime;

/// The phases that have ended so far, in order, with the wall-clock time each ended.
static MARKS: Mutex<Vec<(&'static str, SystemTime)>> = Mutex::new(Vec::new());

/// Records that `phase` ends now.
pub fn mark(phase: &'static str) {
    if let Ok(mut marks) = MARKS.lock() {
        marks.push((phase, SystemTime::now()));
    }
}

/// Seconds each phase took, in order, the first one counted from the start of the process
/// (from /proc, 10 ms resolution: it includes the dynamic loading of libtorch and, when the
/// allocator is chosen, the first process's part). None where the process age is unknown.
pub fn phases() -> Option<serde_json::Map<String, serde_json::Value>> {
    let age = crate::runtime::sysinfo::process_age_s()?;
    let now = SystemTime::now();
    let started = now.checked_sub(std::time::Duration::from_secs_f64(age))?;
    let marks = MARKS.lock().ok()?;
    let mut previous = started;
    let mut out = serde_json::Map::new();
    for &(phase, at) in marks.iter() {
        let took = at
            .duration_since(previous)
            .unwrap_or_default()
            .as_secs_f64();
        out.insert(format!("{phase}_s"), to_ms(took));
        previous = at;
    }
    let rest = now
        .duration_since(previous)
        .unwrap_or_default()
        .as_secs_f64();
    out.insert("until_first_step_s".into(), to_ms(rest));
    Some(out)
}

/// Seconds, rounded to the millisecond.
fn to_ms(seconds: f64) -> serde_json::Value {
    serde_json::json!((seconds * 1e3).round() / 1e3)
}
