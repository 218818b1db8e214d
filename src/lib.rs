//! sprtrain: data-parallel fine-tuning of Hugging Face encoder models on CPU clusters.
//!
//! Layout: `cli` (in main.rs) -> `config` -> {`models`, `data`, `predict`, `sysinfo`}.

pub mod config;
pub mod data;
pub mod models;
pub mod predict;
pub mod sysinfo;
