//! What the loop adds up between log records: losses, examples, tokens and where the time
//! went, per optimizer step.

use std::time::Instant;

use serde_json::{json, Value};

use crate::optim::StepUpdate;

/// Seconds one step (or a window of steps) spent in each part.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Collating batches.
    pub data: f64,
    /// Forward passes and losses.
    pub forward: f64,
    /// Backward passes (with the gradient sums they launch).
    pub backward: f64,
    /// Waiting for gradient sums after backward: communication not hidden behind it.
    pub comm_exposed: f64,
    /// Clipping, AdamW and zeroing the gradient.
    pub optimizer: f64,
}

/// What one optimizer step did, summed over every process.
#[derive(Debug, Clone, Copy)]
pub struct StepOutcome {
    /// The mean loss of the global batch.
    pub loss: f64,
    pub samples: usize,
    /// Real (not padding) tokens.
    pub tokens: usize,
    pub update: StepUpdate,
    pub times: StepTimes,
    /// Payload bytes this process sent in the step's sums.
    pub bytes_sent: u64,
    /// A stop signal (SIGTERM, SIGINT) that some process received before the step ended.
    pub signal: Option<i32>,
}

/// Sums over steps since `start`.
#[derive(Debug, Clone)]
pub struct StepWindow {
    steps: usize,
    loss: f64,
    samples: usize,
    tokens: usize,
    times: StepTimes,
    bytes_sent: u64,
    start: Instant,
}

impl Default for StepWindow {
    fn default() -> Self {
        StepWindow {
            steps: 0,
            loss: 0.0,
            samples: 0,
            tokens: 0,
            times: StepTimes::default(),
            bytes_sent: 0,
            start: Instant::now(),
        }
    }
}

impl StepWindow {
    pub fn add(&mut self, step: &StepOutcome) {
        self.steps += 1;
        self.loss += step.loss;
        self.samples += step.samples;
        self.tokens += step.tokens;
        self.bytes_sent += step.bytes_sent;
        let (t, s) = (&mut self.times, &step.times);
        t.data += s.data;
        t.forward += s.forward;
        t.backward += s.backward;
        t.comm_exposed += s.comm_exposed;
        t.optimizer += s.optimizer;
    }

    /// Mean loss per step (0 before any step).
    pub fn mean_loss(&self) -> f64 {
        self.loss / self.steps.max(1) as f64
    }

    pub fn samples(&self) -> usize {
        self.samples
    }

    /// The metrics.jsonl record of this window, ending at `step` with `last`'s learning rate
    /// and gradient norm; then starts a new window.
    pub fn take_record(&mut self, step: usize, epoch: f64, last: StepUpdate) -> Value {
        let wall = self.start.elapsed().as_secs_f64();
        let per_step = |x: f64| x / self.steps.max(1) as f64;
        let t = &self.times;
        let record = json!({
            "step": step, "epoch": epoch, "loss": self.mean_loss(), "lr": last.lr,
            "grad_norm": last.grad_norm, "samples_per_s": self.samples as f64 / wall,
            "tokens_per_s": self.tokens as f64 / wall,
            "time_data_s": per_step(t.data), "time_forward_s": per_step(t.forward),
            "time_backward_s": per_step(t.backward), "time_optimizer_s": per_step(t.optimizer),
            "time_comm_exposed_s": per_step(t.comm_exposed),
            "comm_bytes_sent_per_step": per_step(self.bytes_sent as f64),
        });
        *self = StepWindow::default();
        record
    }
}
