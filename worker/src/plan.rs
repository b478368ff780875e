//! The contract between the operator and the worker.
