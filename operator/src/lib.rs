//! The control plane of trajectory-operator: the `TrajectoryRun` API and its reconciliation into
//! Kubernetes Jobs that run the worker.
//!
//! ```text
//!                 ┌──────────────────────── reconcile (one run) ─────────────────────────┐
//!  TrajectoryRun ─┤ observe ─► validate ─► decide ─► build ─► apply ─► status           │
//!   (watched)     │ (reads)    (once)      (pure)    (pure)   (SSA)    (pure + one write)│
//!        ▲        └───────────────────────────────────────┬──────────────────────────────┘
//!        │                                                 ▼
//!        │               plan Job ─► gen-N Indexed Job (a completion index per batch) ─► merge Job
//!        │                                  each pod: trajectory-worker <mode>
//!        └── status ◄── Job status (completedIndexes / failedIndexes → batch ids), pod summaries
//! ```
//!
//! - [`api`]: the custom resource types and the validation the API server enforces.
//! - [`crd`]: the generated `CustomResourceDefinition` (the `crd` subcommand and `crds/`);
//!   [`reference`] renders it as `docs/api-reference.md` (the `api-reference` subcommand).
//! - [`reconcile`]: the pipeline, one module per stage; its module doc draws it.
//! - [`controller`]: watches runs and their Jobs and runs the pipeline; [`settings`]: what the
//!   operator is told at start (worker image, namespace, pacing of writes and retries).
//! - [`service`]: the process around the loop: [`http`] (`/metrics`, `/healthz`, `/readyz`),
//!   [`leader`] election on a Lease, [`metrics`], and graceful shutdown on SIGTERM.
//!
//! Dependencies point one way: `service` → `controller` → `reconcile` → (`metrics`, `settings`,
//! `api`); `metrics` knows nothing of the reconciler. The spec types and the worker contract come
//! from `trajectory-worker` built without its engine: this crate must never pull in the worker's
//! HTTP client or tools.

pub mod api;
pub mod controller;
pub mod crd;
#[cfg(test)]
mod fixtures;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod reconcile;
pub mod reference;
pub mod service;
pub mod settings;
