//! The data plane of trajectory-operator: everything a pod (or a local run) does.
//!
//! ```text
//!  run file / plan ConfigMap ──► plan ──► manifest.json ─┐
//!                                                        ▼
//!  dataset.jsonl ──seek(offset)──► batch ──► agent ◄──► model server (OpenAI-compatible)
//!                                    │         └──► tools (terminal, file) in a workspace
//!                                    ▼
//!                     batches/batch-NNNNNN.jsonl (+ .done)
//!                                    │
//!                                    ▼
//!                     merge ──► trajectories.jsonl, failures.jsonl, statistics.json
//! ```
//!
//! [`spec`] and [`contract`] are the contract with the operator and build with serde alone
//! (`default-features = false`); everything else sits behind the `engine` feature.

pub mod contract;
pub mod spec;

#[cfg(feature = "engine")]
pub mod agent;
#[cfg(feature = "engine")]
pub mod cli;
#[cfg(feature = "engine")]
pub mod dataset;
#[cfg(feature = "engine")]
pub mod distribution;
#[cfg(feature = "engine")]
pub mod hermes;
#[cfg(feature = "engine")]
pub mod json_scan;
#[cfg(feature = "engine")]
pub mod model;
#[cfg(feature = "engine")]
pub mod pyjson;
#[cfg(feature = "engine")]
pub mod run;
#[cfg(feature = "engine")]
pub mod storage;
#[cfg(feature = "engine")]
pub mod tools;
