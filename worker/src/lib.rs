//! The data plane of trajectory-operator: everything a pod (or a local run) does.
//!
//! ```text
//!  run file / plan ConfigMap ──► plan ──► manifest.json, invalid.jsonl ─┐
//!                                                                       ▼
//!  dataset.jsonl ──seek(offset)──► batch ──► agent ◄──► model server (OpenAI-compatible)
//!                                    │         └──► tools (terminal, file, MCP, HTTP) in a workspace
//!                                    │ hermes: one record line per (prompt, sample)
//!                                    ▼
//!                     batches/batch-NNNNNN/w-<writer>.jsonl (+ batch-NNNNNN.done)
//!                                    │
//!                                    ▼
//!                     merge ──► trajectories.jsonl, failures.jsonl, statistics.json, report.html
//! ```
//!
//! - [`contract`]: what the operator and the worker agree on: the run plan a pod receives, mount
//!   paths and environment, exit codes, and the summaries of the termination message.
//! - [`spec`]: the `TrajectoryRun` spec a user writes; [`toolsets`]: the toolsets and built-in
//!   distributions it may name; [`template`]: the template language of the HTTP tools it may
//!   declare; [`pricing`]: its model's prices and what a completion cost by them; [`validate`]:
//!   what the schema cannot check about it, each violation naming its field.
//! - [`cli`]: the command line; each subcommand runs one mode of [`run`].
//! - [`run`]: the run modes: [`run::plan`] checks the dataset and lays out the batches,
//!   [`run::batch`] runs one batch's conversations and appends their records to files of its
//!   own, [`run::merge`] joins the batches into the outputs, [`run::local`] does all three on one
//!   machine, and [`run::prompt`] runs a single prompt.
//! - [`dataset`]: reading the JSONL dataset: line framing and the rules a prompt line follows;
//!   [`json_scan`] vouches for JSON syntax on the plan's and merge's fast paths.
//! - [`distribution`]: which toolsets each (prompt, sample) is offered.
//! - [`agent`]: one conversation, from the prompt to a final answer.
//! - [`model`]: the OpenAI-compatible chat-completions client (retries, streaming, the shapes
//!   servers return reasoning in).
//! - [`tools`]: the registry and toolsets (terminal, file, MCP servers, declared HTTP tools),
//!   each tool its own type.
//! - [`hermes`]: how a record is rendered: every line a batch writes (a trajectory in the Hermes /
//!   `ShareGPT` format, a discarded or a failed record); [`pyjson`] writes JSON as Python does.
//! - [`storage`]: the run's directory on shared storage, and its crash-safe writes.
//! - [`report`]: `report.html`, the page a person reads a run in, from merge's pass over the
//!   records or from the merged outputs.
//!
//! [`spec`], [`toolsets`], [`template`], [`pricing`], [`validate`] and [`contract`] are the
//! contract with the operator and build with serde alone (`default-features = false`); everything else sits behind
//! the `engine` feature. The scripted model server the tests and benchmarks talk to is the
//! `trajectory-testkit` crate.
//!
//! Dependencies between these modules point one way, so each reads knowing only what is below
//! it: [`spec`] and [`template`] import nothing of the crate, [`toolsets`] and [`pricing`] name
//! the spec's types, [`contract`] carries a spec, and [`validate`] sits above the spec, the
//! toolsets, the templates and the prices it checks a spec against; the engine's modules may use
//! any of them, none of them the engine.
//!
//! ```text
//!  validate ──► toolsets ──► spec ◄── contract
//!     │  │  │                 ▲ ▲
//!     │  │  └──► pricing ─────┘ │
//!     │  └──► template          │
//!     └─────────────────────────┘
//! ```

pub mod contract;
pub mod object_url;
pub mod pricing;
pub mod spec;
pub mod template;
pub mod toolsets;
pub mod validate;

#[cfg(feature = "engine")]
pub mod agent;
#[cfg(feature = "engine")]
pub mod cli;
#[cfg(feature = "engine")]
pub mod dataset;
#[cfg(feature = "engine")]
pub mod distribution;
#[cfg(feature = "engine")]
pub mod episode;
#[cfg(feature = "engine")]
pub mod export;
#[cfg(feature = "engine")]
pub mod harbor;
#[cfg(feature = "engine")]
pub mod hermes;
#[cfg(feature = "engine")]
pub mod json_scan;
#[cfg(feature = "engine")]
pub mod model;
#[cfg(feature = "engine")]
pub mod pyjson;
#[cfg(feature = "engine")]
pub mod replay;
#[cfg(feature = "engine")]
pub mod report;
#[cfg(feature = "engine")]
pub mod run;
#[cfg(feature = "engine")]
pub mod simulator;
#[cfg(feature = "engine")]
pub mod storage;
#[cfg(feature = "engine")]
pub mod tools;
#[cfg(feature = "engine")]
pub mod training;
#[cfg(feature = "engine")]
pub mod verify;
