//! `runtime.profile_steps`: libtorch's operator profiler (src/train/profile.cpp, the profiler
//! torch.profiler drives) over a few training steps, as Trainer users get from a
//! `torch.profiler.profile` callback. Rank 0 writes `<output_dir>/profile/trace.json` (Chrome
//! trace: chrome://tracing or ui.perfetto.dev) and `ops.md`, each operator's calls and self
//! time (its time less that of the operators it called), the most expensive first.

use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};

extern "C" {
    fn sprtrain_profiler_start() -> *mut c_char;
    fn sprtrain_profiler_stop(trace_path: *const c_char, error: *mut *mut c_char) -> *mut c_char;
    fn sprtrain_free_error(error: *mut c_char);
}

/// Takes a malloc'd C string from the C++ unit.
fn take_string(s: *mut c_char) -> String {
    // SAFETY: the C++ unit returns NUL-terminated strings from malloc, freed here once.
    let text = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
    unsafe { sprtrain_free_error(s) };
    text
}

/// Profiles steps `first..first + steps` (1-based step numbers) of one process.
pub struct StepProfiler {
    first: u64,
    last: u64,
    dir: PathBuf,
    started: Option<Instant>,
}

impl StepProfiler {
    /// None when `steps` is 0.
    pub fn new(first: u64, steps: u64, output_dir: &Path) -> Option<StepProfiler> {
        (steps > 0).then(|| StepProfiler {
            first: first.max(1),
            last: first.max(1) + steps - 1,
            dir: output_dir.join("profile"),
            started: None,
        })
    }

    /// Call before step `step` (1-based) runs.
    pub fn before_step(&mut self, step: u64) -> Result<()> {
        if step != self.first {
            return Ok(());
        }
        // SAFETY: no arguments; the result is null or an owned message.
        let error = unsafe { sprtrain_profiler_start() };
        if !error.is_null() {
            bail!(
                "runtime.profile_steps: libtorch's profiler did not start: {}",
                take_string(error)
            );
        }
        self.started = Some(Instant::now());
        Ok(())
    }

    /// Call after step `step` ran (and at the loop's end, with the last step run); writes the
    /// profile when the profiled steps are done. Returns the table's path once written.
    pub fn after_step(&mut self, step: u64, finished: bool) -> Result<Option<PathBuf>> {
        let Some(started) = self.started else {
            return Ok(None);
        };
        if step < self.last && !finished {
            return Ok(None);
        }
        self.started = None;
        let wall_ns = started.elapsed().as_nanos() as u64;
        let steps = step + 1 - self.first;
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let trace = self.dir.join("trace.json");
        let c_trace = CString::new(trace.to_string_lossy().as_bytes())
            .with_context(|| format!("{}: a NUL in the path", trace.display()))?;
        let mut error = std::ptr::null_mut();
        // SAFETY: a valid C string; the result is an owned string, or null with `error` set.
        let events = unsafe { sprtrain_profiler_stop(c_trace.as_ptr(), &mut error) };
        if events.is_null() {
            bail!(
                "writing the profile {}: {}",
                trace.display(),
                take_string(error)
            );
        }
        // libtorch wrote the trace in place; it is a diagnostic, kept once it is on disk.
        crate::io::atomic_file::sync_file(&trace)?;
        crate::io::atomic_file::sync_dir(&self.dir)?;
        let events = parse_events(&take_string(events))?;
        let table = ops_table(&events, steps, wall_ns);
        let path = self.dir.join("ops.md");
        crate::io::atomic_file::write_atomic(&path, table.as_bytes())?;
        Ok(Some(path))
    }
}

/// One recorded operator call.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub thread: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub name: String,
    /// Input shapes, as the profiler prints them ("[32, 40, 384];[384]").
    pub shapes: String,
}

/// The C++ unit's lines: thread, start, end, name, shapes, tab-separated.
pub fn parse_events(tsv: &str) -> Result<Vec<Event>> {
    tsv.lines()
        .filter(|l| !l.is_empty())
        .map(|line| {
            let f: Vec<&str> = line.splitn(5, '\t').collect();
            let number = |i: usize| -> Result<u64> {
                f.get(i)
                    .and_then(|s| s.parse().ok())
                    .with_context(|| format!("profiler event {line:?}: field {i}"))
            };
            Ok(Event {
                thread: number(0)?,
                start_ns: number(1)?,
                end_ns: number(2)?.max(number(1)?),
                name: f.get(3).unwrap_or(&"").to_string(),
                shapes: f.get(4).unwrap_or(&"").to_string(),
            })
        })
        .collect()
}

/// Each event's self time: its duration less that of the events nested in it on its thread.
pub fn self_times(events: &[Event]) -> Vec<u64> {
    let mut order: Vec<usize> = (0..events.len()).collect();
    // Outer events first where two start together.
    order.sort_by_key(|&i| {
        let e = &events[i];
        (e.thread, e.start_ns, std::cmp::Reverse(e.end_ns))
    });
    let mut own: Vec<u64> = events.iter().map(|e| e.end_ns - e.start_ns).collect();
    let mut open: Vec<usize> = Vec::new();
    for &i in &order {
        let e = &events[i];
        while let Some(&top) = open.last() {
            let t = &events[top];
            if t.thread == e.thread && e.start_ns < t.end_ns {
                break;
            }
            open.pop();
        }
        if let Some(&parent) = open.last() {
            // Clipped to the parent, should a child outlive it by a clock tick.
            let inner = e.end_ns.min(events[parent].end_ns) - e.start_ns;
            own[parent] = own[parent].saturating_sub(inner);
        }
        open.push(i);
    }
    own
}

/// The table of `ops.md`: operators by self time, then the costliest (operator, shapes) pairs.
pub fn ops_table(events: &[Event], steps: u64, wall_ns: u64) -> String {
    let own = self_times(events);
    let per_step = |ns: u64| ns as f64 / 1e6 / steps.max(1) as f64;
    let mut by_name: HashMap<&str, (u64, u64)> = HashMap::new();
    let mut by_shape: HashMap<(&str, &str), (u64, u64)> = HashMap::new();
    for (e, &t) in events.iter().zip(&own) {
        let slot = by_name.entry(&e.name).or_default();
        *slot = (slot.0 + 1, slot.1 + t);
        let slot = by_shape.entry((&e.name, &e.shapes)).or_default();
        *slot = (slot.0 + 1, slot.1 + t);
    }
    let total: u64 = own.iter().sum();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Operator profile: {steps} steps, {:.1} ms a step of wall time\n\n\
         Self time is an operator's time less that of the operators it called; `autograd::` rows \
         are backward's own bookkeeping. Operators run on the calling thread; time outside any \
         operator (Rust code, AdamW, waiting) is not in the table: {:.1} ms a step of self time \
         is.\n",
        per_step(wall_ns),
        per_step(total),
    );
    let mut names: Vec<_> = by_name.into_iter().collect();
    names.sort_by_key(|(name, (_, t))| (std::cmp::Reverse(*t), *name));
    out.push_str("| operator | calls a step | self ms a step | % of self time |\n| --- | --- | --- | --- |\n");
    for (name, (calls, t)) in &names {
        let _ = writeln!(
            out,
            "| `{name}` | {:.1} | {:.2} | {:.1}% |",
            *calls as f64 / steps.max(1) as f64,
            per_step(*t),
            100.0 * *t as f64 / total.max(1) as f64
        );
    }
    let mut shapes: Vec<_> = by_shape.into_iter().collect();
    shapes.sort_by_key(|(key, (_, t))| (std::cmp::Reverse(*t), *key));
    out.push_str("\n## The 40 costliest operators by input shapes\n\n| operator | input shapes | calls a step | self ms a step |\n| --- | --- | --- | --- |\n");
    for ((name, shape), (calls, t)) in shapes.iter().take(40) {
        let _ = writeln!(
            out,
            "| `{name}` | {shape} | {:.1} | {:.2} |",
            *calls as f64 / steps.max(1) as f64,
            per_step(*t)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(thread: u64, start_ns: u64, end_ns: u64, name: &str) -> Event {
        Event {
            thread,
            start_ns,
            end_ns,
            name: name.into(),
            shapes: String::new(),
        }
    }

    #[test]
    fn self_time_is_duration_less_nested_calls_on_the_same_thread() {
        let events = vec![
            event(1, 0, 100, "aten::linear"),
            event(1, 10, 60, "aten::addmm"),
            event(1, 20, 30, "aten::copy_"),
            event(1, 60, 90, "aten::add"),
            // Another thread overlapping in time is no child.
            event(2, 5, 50, "aten::mul"),
            event(1, 100, 120, "aten::relu"),
        ];
        // linear 100 - 50 - 30, addmm 50 - 10, copy_ 10, add 30, mul 45, relu 20.
        assert_eq!(self_times(&events), vec![20, 40, 10, 30, 45, 20]);
    }

    #[test]
    fn events_parse_and_the_table_ranks_by_self_time() {
        let tsv = "7\t0\t4000000\taten::linear\t[32, 384];[384, 384]\n\
                   7\t1000000\t4000000\taten::addmm\t[384];[32, 384]\n\
                   7\t5000000\t6000000\taten::add\t\n";
        let events = parse_events(tsv).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].shapes, "[32, 384];[384, 384]");
        let table = ops_table(&events, 2, 10_000_000);
        // 2 steps: addmm 3 ms -> 1.5 ms a step; linear 1 ms -> 0.5; add 0.5.
        let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| `")).collect();
        assert_eq!(rows[0], "| `aten::addmm` | 0.5 | 1.50 | 60.0% |");
        assert!(
            rows[1].starts_with("| `aten::add` | 0.5 | 0.50 |"),
            "{}",
            rows[1]
        );
        assert!(table.contains("5.0 ms a step of wall time"), "{table}");
        assert!(parse_events("7\tx\t1\tname\t").is_err());
    }
}
