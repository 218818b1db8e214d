//! The subcommands beside `train`: each reads a trained model (or an adapter) and does one
//! job with it, or reports on the machine.

pub mod env;
pub mod generate;
pub mod memory;
pub mod merge;
pub mod predict;
