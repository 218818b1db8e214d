//! sprtrain: data-parallel training of Hugging Face transformer models (encoders and decoder
//! language models) on CPU clusters.
//!
//! Layout (docs/architecture.md draws it and follows a batch through it):
//! - `main.rs` (the command line) -> `config` (typed TOML) -> `train` (the loop: `Trainer`,
//!   evaluation, gradient synchronisation, setup) -> `tasks` (what differs between tasks: data,
//!   targets, metrics, QA answers) -> {`models` (transformers classes in libtorch), `data`
//!   (files, tokenization, batching), `dist` (MPI), `optim` (flat buffers, AdamW),
//!   `checkpoint` (HF-layout output, manifests)}.
//! - `commands`: the subcommands beside training (`predict`, `generate`, `merge`, `env`).
//! - `io`: where files come from and how they are kept (the Hugging Face Hub, HF file names,
//!   Hub data sets, atomic and durable writes).
//! - `report`: what a run shows and leaves (metrics log, progress, plot, TensorBoard);
//!   `metrics`: the scores (accuracy, F1, correlations, SQuAD, seqeval).
//! - `runtime`: the process and the machine (allocator, start-up phases, signals, fault
//!   points, panics of parsers, CPU facts, thread placement).

pub mod checkpoint;
pub mod commands;
pub mod config;
pub mod data;
pub mod dist;
pub mod io;
pub mod metrics;
pub mod models;
pub mod optim;
pub mod report;
pub mod runtime;
pub mod tasks;
pub mod train;
