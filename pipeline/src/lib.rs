//! A multi-process pipeline of the BERT-style reference model over MPI.
pub mod model;
pub mod schedule;
