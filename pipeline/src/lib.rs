//! A multi-process pipeline of the BERT-style reference model over MPI.
pub mod collective;
pub mod decoder;
pub mod model;
pub mod plot;
pub mod report;
pub mod runtime;
pub mod schedule;
pub mod share;
pub mod step;
