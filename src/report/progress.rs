//! What a person watches during a run: a progress bar on a terminal, and one line per logged
//! record, in the order Trainer's progress shows it (step of total, loss, learning rate,
//! gradient norm, throughput, time left). The full record goes to metrics.jsonl; the time
//! each part of a step took is logged at `RUST_LOG=debug`.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Map, Value};

/// A progress bar on a terminal; plain log lines otherwise.
pub struct Progress {
    bar: Option<ProgressBar>,
    shown: bool,
    total: usize,
    /// The step this run started from, and when: the time left is extrapolated from this
    /// run's own steps (a resumed run's earlier steps took place in another process).
    first_step: usize,
    started: Instant,
}

impl Progress {
    /// `shown` is false on ranks other than 0: they show nothing.
    pub fn new(total: usize, done: usize, shown: bool) -> Self {
        let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let bar = (shown && terminal).then(|| {
            let bar = ProgressBar::new(total as u64);
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} steps  eta {eta}  {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_position(done as u64);
            bar
        });
        Progress {
            bar,
            shown,
            total,
            first_step: done,
            started: Instant::now(),
        }
    }

    /// One optimizer step done.
    pub fn step(&mut self, loss: f64, samples: usize) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
            let per_s = samples as f64 * bar.per_sec();
            bar.set_message(format!("loss {loss:.4}  {per_s:.1} samples/s"));
        }
    }

    /// A logged record: above the bar, or as a log line; its timings at debug level.
    pub fn log(&self, record: &Value) {
        if !self.shown {
            return;
        }
        let step = record.get("step").and_then(Value::as_u64);
        let eta_s = step.and_then(|s| self.eta_s(s as usize));
        self.note(&log_line(record, self.total, eta_s));
        if let Some(times) = timings_line(record) {
            tracing::debug!("{times}");
        }
    }

    pub fn note(&self, text: &str) {
        if !self.shown {
            return;
        }
        match &self.bar {
            Some(bar) => bar.println(text),
            None => tracing::info!("{text}"),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    /// Seconds left at `step`, at this run's mean pace so far.
    fn eta_s(&self, step: usize) -> Option<f64> {
        let done = step.checked_sub(self.first_step).filter(|&d| d > 0)?;
        let per_step = self.started.elapsed().as_secs_f64() / done as f64;
        Some(per_step * self.total.saturating_sub(step) as f64)
    }
}

/// A record as one line: a training window as `step 50/298 | loss 0.5470 | lr 9.30e-5 |
/// grad norm 0.383 | 246.1 samples/s | 7129 tokens/s | eta 0:45`, an evaluation as its scores
/// at its step, anything else as its keys in order.
pub fn log_line(record: &Value, total: usize, eta_s: Option<f64>) -> String {
    let Some(fields) = record.as_object() else {
        return record.to_string();
    };
    let number = |key: &str| fields.get(key).and_then(Value::as_f64);
    let step = match fields.get("step").and_then(Value::as_u64) {
        Some(step) => format!("{step}/{total}"),
        None => "?".to_string(),
    };
    if let Some(loss) = number("loss") {
        let mut parts = vec![format!("step {step}"), format!("loss {loss:.4}")];
        let optional = [
            number("lr").map(|x| format!("lr {x:.2e}")),
            number("grad_norm").map(|x| format!("grad norm {x:.3}")),
            number("samples_per_s").map(|x| format!("{x:.1} samples/s")),
            number("tokens_per_s").map(|x| format!("{x:.0} tokens/s")),
            eta_s.map(|s| format!("eta {}", clock(s))),
        ];
        parts.extend(optional.into_iter().flatten());
        return parts.join(" | ");
    }
    let scores = pairs(fields, |k| k.starts_with("eval_"));
    if !scores.is_empty() {
        return format!("eval at step {step} | {scores}");
    }
    pairs(fields, |_| true)
}

/// `key value` pairs of the keys `keep` admits, in the record's order, numbers rounded for
/// reading (whole numbers as they are).
fn pairs(fields: &Map<String, Value>, keep: impl Fn(&str) -> bool) -> String {
    fields
        .iter()
        .filter(|(k, _)| keep(k))
        .map(|(k, v)| match (v.as_u64(), v.as_f64()) {
            (Some(n), _) => format!("{k} {n}"),
            (None, Some(x)) => format!("{k} {x:.4}"),
            _ => format!("{k} {v}"),
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Where a logged window's steps spent their time, per step, for `RUST_LOG=debug`.
fn timings_line(record: &Value) -> Option<String> {
    let ms = |key: &str| Some(record.get(key)?.as_f64()? * 1e3);
    let step = record.get("step")?;
    Some(format!(
        "step {step} per step: data {:.1} ms | forward {:.1} ms | backward {:.1} ms | \
         optimizer {:.1} ms | communication not hidden {:.1} ms | {:.0} bytes sent",
        ms("time_data_s")?,
        ms("time_forward_s")?,
        ms("time_backward_s")?,
        ms("time_optimizer_s")?,
        ms("time_comm_exposed_s")?,
        record.get("comm_bytes_sent_per_step")?.as_f64()?,
    ))
}

/// Seconds as `m:ss`, or `h:mm:ss` from an hour on.
fn clock(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_training_record_reads_as_trainer_shows_it() {
        let record = json!({
            "step": 50, "epoch": 0.17, "loss": 0.547_03, "lr": 9.3e-5, "grad_norm": 0.38321,
            "samples_per_s": 246.14, "tokens_per_s": 7129.37, "time_data_s": 1e-4,
            "time_forward_s": 0.0123, "time_backward_s": 0.0201, "time_optimizer_s": 0.0012,
            "time_comm_exposed_s": 0.0, "comm_bytes_sent_per_step": 1024.0,
        });
        assert_eq!(
            log_line(&record, 298, Some(45.2)),
            "step 50/298 | loss 0.5470 | lr 9.30e-5 | grad norm 0.383 | 246.1 samples/s | \
             7129 tokens/s | eta 0:45"
        );
        assert_eq!(
            timings_line(&record).unwrap(),
            "step 50 per step: data 0.1 ms | forward 12.3 ms | backward 20.1 ms | optimizer \
             1.2 ms | communication not hidden 0.0 ms | 1024 bytes sent"
        );
    }

    #[test]
    fn an_evaluation_reads_as_its_scores_at_its_step() {
        let record = json!({"step": 100, "epoch": 0.34, "eval_loss": 0.41234,
                            "eval_accuracy": 0.8125, "eval_samples": 872});
        assert_eq!(
            log_line(&record, 298, None),
            "eval at step 100/298 | eval_loss 0.4123 | eval_accuracy 0.8125 | eval_samples 872"
        );
        assert_eq!(timings_line(&record), None);
    }

    #[test]
    fn other_records_keep_their_order() {
        let record = json!({"step": 5, "loss_scale": 2.0, "skipped": 1});
        assert_eq!(
            log_line(&record, 10, None),
            "step 5 | loss_scale 2.0000 | skipped 1"
        );
    }

    #[test]
    fn time_left_reads_as_a_clock() {
        assert_eq!(clock(45.4), "0:45");
        assert_eq!(clock(605.0), "10:05");
        assert_eq!(clock(3725.0), "1:02:05");
        assert_eq!(clock(-3.0), "0:00");
    }
}
