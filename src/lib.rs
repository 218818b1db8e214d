//! sprtrain: data-parallel training of Hugging Face transformer models (encoders and decoder
//! language models) on CPU clusters.
//!
//! Layout (docs/architecture.md follows a batch through it):
//! - `cli` (main.rs) -> `config` (typed TOML) -> `train` (the loop: `Trainer`, evaluation,
//!   gradient synchronisation, setup) -> `tasks` (what differs between tasks: data, targets,
//!   metrics) -> {`models` (transformers classes in libtorch), `data` (files, tokenization,
//!   batching), `dist` (MPI), `optim` (flat buffers, AdamW), `checkpoint` (HF-layout output)}.
//! - Beside them: `metrics` (accuracy, F1, correlations, SQuAD EM/F1), `qa` (answers from
//!   start/end logits), `report` (metrics log, progress bar, plot), `hub` (local paths or the
//!   Hugging Face Hub), `hf_files` (HF file names and the shard index), `atomic_file` (files
//!   written whole or not at all, and synced), `predict`, `generate` and `sysinfo` (the
//!   `predict`, `generate` and `env` commands), `placement` (which cores a rank's threads run
//!   on), `allocator` (picks the C allocator before any of it runs).

pub mod allocator;
pub mod atomic_file;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod dataset_repo;
pub mod dist;
pub mod fault;
pub mod generate;
pub mod hf_files;
pub mod hub;
pub mod merge;
pub mod metrics;
pub mod models;
pub mod optim;
pub mod panic_guard;
pub mod placement;
pub mod predict;
pub mod qa;
pub mod report;
pub mod signals;
pub mod startup;
pub mod sysinfo;
pub mod tasks;
pub mod tensorboard;
pub mod train;
