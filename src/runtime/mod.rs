//! The process and the machine it runs on: the C allocator, start-up phases, signals, fault
//! points for tests, panics of third-party parsers, CPU facts and where threads run.

pub mod allocator;
pub mod fault;
pub mod panic_guard;
pub mod placement;
pub mod signals;
pub mod startup;
pub mod sysinfo;
