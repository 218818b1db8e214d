//! Data: tokenization and batching. Knows nothing of models' internals or of MPI.

pub mod batching;
pub mod chat;
pub mod classification;
pub mod conll;
pub mod masking;
pub mod squad;
pub mod tokenizer;
