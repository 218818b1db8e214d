//! sprtrain: data-parallel fine-tuning of Hugging Face encoder models on CPU clusters.
//!
//! Layout: `cli` (in main.rs) -> `config` -> `train` (the loop) -> {`models`, `data`, `optim`,
//! `checkpoint`, `metrics`, `qa` (answers from logits), `report`}; `predict` and `sysinfo` serve
//! the other commands; `allocator` picks the C allocator before any of it runs.

pub mod allocator;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod dist;
pub mod hub;
pub mod metrics;
pub mod models;
pub mod optim;
pub mod predict;
pub mod qa;
pub mod report;
pub mod sysinfo;
pub mod train;
