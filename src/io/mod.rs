//! Where files come from and how they are kept: local paths or the Hugging Face Hub (models
//! and data sets), the HF file names and shard index, and atomic, durable writes.

pub mod atomic_file;
pub mod dataset_repo;
pub mod hf_files;
pub mod hub;
