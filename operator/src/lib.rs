//! The control plane of trajectory-operator: the `TrajectoryRun` API and its reconciliation into
//! Kubernetes Jobs that run the worker.
//!
//! ```text
//!  TrajectoryRun ──► desired (pure) ──► plan Job ─► gen-N Indexed Job ─► merge Job
//!        ▲                 │                 each pod: trajectory-worker <mode>
//!        └── status ◄──────┘◄── Job status (completedIndexes / failedIndexes → batch ids)
//! ```
//!
//! - [`api`]: the custom resource types and the validation the API server enforces.
//! - [`crd`]: the generated `CustomResourceDefinition` (the `crd` subcommand and `crds/`);
//!   [`reference`] renders it as `docs/api-reference.md` (the `api-reference` subcommand).
//! - [`desired`]: pure functions from a run (and what was observed) to the objects it should own
//!   and the status it should show; unit-tested without a client.
//! - [`state`]: the reconcile decision (plan → attempts → merge) over what was observed.
//! - [`observe`], [`apply`]: the thin reads and writes around it; [`controller`] runs the loop.
//! - [`service`]: the process around the loop: [`http`] (`/metrics`, `/healthz`, `/readyz`),
//!   [`leader`] election on a Lease, [`metrics`], and graceful shutdown on SIGTERM.
//!
//! The spec types and the worker contract come from `trajectory-worker` built without its engine:
//! this crate must never pull in the worker's HTTP client or tools.

pub mod api;
pub mod apply;
pub mod controller;
pub mod crd;
pub mod desired;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod observe;
pub mod reference;
pub mod service;
pub mod state;
