//! Gradient synchronisation for data parallelism: the flat gradient is cut into buckets in
//! backward order, and on the last micro-batch of a step backward runs layer by layer so each
//! bucket is summed across processes as soon as it is complete, while backward goes on
//! (llm.c and PyTorch DDP do the same). Also the start-of-run agreement: every process checks
//! it runs the same job, then takes rank 0's weights.

use std::ops::Range;

use anyhow::Result;
use tch::{Kind, Tensor};

use crate::config::{Config, ReduceDtype};
use crate::dist::{Dist, Pending};
use crate::models::{Boundary, TaskModel};
use crate::optim::{FlatParams, Slot};

/// A run of whole parameters reduced together: elements of the flat buffer and the slots
/// (parameters) they hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub elems: Range<usize>,
    pub slots: Range<usize>,
}

/// Cuts the flat buffer into buckets of about `bytes` (never splitting a parameter), in
/// buffer order, i.e. the order backward fills them.
pub fn plan_buckets(slots: &[Slot], bytes: usize) -> Vec<Bucket> {
    let cap = (bytes / 4).max(1);
    let mut out = Vec::new();
    let (mut start, mut first) = (0usize, 0usize);
    for (i, slot) in slots.iter().enumerate() {
        let end = (slot.offset + slot.numel) as usize;
        if end - start >= cap || i + 1 == slots.len() {
            out.push(Bucket {
                elems: start..end,
                slots: first..i + 1,
            });
            (start, first) = (end, i + 1);
        }
    }
    out
}

/// Every rank must run the same job on the same model: compares the resolved config, the
/// parameter layout and the number of training examples with rank 0's before the first
/// collective that depends on them, then starts every rank from rank 0's weights.
pub fn agree_and_broadcast(
    dist: &Dist,
    config: &Config,
    flat: &FlatParams,
    train_examples: usize,
) -> Result<()> {
    let mut fingerprint = config.dotted_lines()?;
    fingerprint.extend(
        flat.slots
            .iter()
            .map(|s| format!("tensor {} {:?} float32", s.name, s.shape)),
    );
    fingerprint.push(format!("training examples {train_examples}"));
    dist.check_same(
        "the resolved configuration or parameter layout",
        &fingerprint,
    )?;
    if dist.topo.world > 1 {
        // SAFETY: nothing else reads or writes the parameters until the broadcast returns.
        dist.broadcast_into("initial parameters", unsafe { flat.params_mut() })?;
    }
    Ok(())
}

/// The buckets of a run and the sums of the current step in flight.
pub struct GradSync {
    buckets: Vec<Bucket>,
    /// The backward stage after which each bucket's gradients are complete.
    stages: Vec<usize>,
    /// Send buffers, one per bucket, reused step after step.
    bufs: Vec<Vec<f32>>,
    bf16: bool,
    pending: Vec<Pending>,
    step: usize,
}

impl GradSync {
    pub fn new(flat: &FlatParams, model: &TaskModel, config: &Config) -> Self {
        let buckets = plan_buckets(
            &flat.slots,
            (config.dist.bucket_mb * 1024.0 * 1024.0) as usize,
        );
        // A bucket is ready once backward has passed the stage of its last (deepest) parameter.
        let stages = buckets
            .iter()
            .map(|b| model.backward_stage(&flat.slots[b.slots.end - 1].name))
            .collect();
        let bufs = buckets
            .iter()
            .map(|b| Vec::with_capacity(b.elems.len()))
            .collect();
        GradSync {
            buckets,
            stages,
            bufs,
            bf16: config.dist.reduce_dtype == ReduceDtype::Bf16,
            pending: Vec::new(),
            step: 0,
        }
    }

    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Starts optimizer step `step` (1-based, for messages): no bucket launched yet.
    pub fn begin(&mut self, step: usize) {
        self.pending.clear();
        self.step = step;
    }

    /// Launches every bucket whose parameters all have their gradients (stage <= `done`).
    fn launch_ready(&mut self, flat: &FlatParams, dist: &Dist, done: usize) -> Result<()> {
        while let Some(b) = self.buckets.get(self.pending.len()) {
            let i = self.pending.len();
            if self.stages[i] > done {
                break;
            }
            flat.read_grads(b.elems.clone(), &mut self.bufs[i]);
            let what = format!(
                "gradient bucket {i} (elements {}..{}) of step {}",
                b.elems.start, b.elems.end, self.step
            );
            let send = std::mem::take(&mut self.bufs[i]);
            // SAFETY: this range of the flat gradient is touched by nothing but the sum until
            // `finish` has waited for it; buckets are disjoint.
            let pending = unsafe {
                dist.start_allreduce_into(what, send, flat.grads_mut(b.elems.clone()), self.bf16)?
            };
            self.pending.push(pending);
        }
        Ok(())
    }

    /// Backward of the last micro-batch of a step, from a `forward_staged` pass: the heads
    /// and last layer first, then one layer at a time down to the embeddings, each bucket
    /// launched as soon as backward has completed it.
    pub fn backward_staged(
        &mut self,
        loss: &Tensor,
        boundaries: &[Boundary],
        flat: &FlatParams,
        dist: &Dist,
    ) -> Result<()> {
        loss.backward();
        self.launch_ready(flat, dist, 1)?;
        let layers = boundaries.len();
        for (k, b) in boundaries.iter().enumerate().rev() {
            // Below a frozen stage (LoRA's embeddings) there is nothing left to differentiate.
            if b.below.requires_grad() {
                (&b.below * b.leaf.grad()).sum(Kind::Float).backward();
            }
            self.launch_ready(flat, dist, layers + 1 - k)?;
        }
        Ok(())
    }

    /// Launches the buckets not launched yet (a rank without a micro-batch in a short last
    /// step still takes part, with zeros), then waits for every sum: the flat gradient then
    /// holds the sum over all processes.
    pub fn finish(&mut self, flat: &FlatParams, dist: &Dist) -> Result<()> {
        self.launch_ready(flat, dist, usize::MAX)?;
        for (i, pending) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            self.bufs[i] = pending.wait(dist)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_backward_order_without_splitting_parameters() {
        let slot = |offset, numel| Slot {
            name: String::new(),
            offset,
            numel,
            shape: vec![numel],
        };
        let slots = [slot(0, 100), slot(100, 500), slot(600, 200), slot(800, 300)];
        let elems = |b: Vec<Bucket>| b.into_iter().map(|b| b.elems).collect::<Vec<_>>();
        assert_eq!(elems(plan_buckets(&slots, 2400)), vec![0..600, 600..1100]);
        assert_eq!(plan_buckets(&slots, 2400)[1].slots, 2..4);
        assert_eq!(elems(plan_buckets(&slots, 4 * 1_000_000)), vec![0..1100]);
    }
}
