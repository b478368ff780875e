//! Test doubles shared by the worker's integration tests and benchmarks and by the end-to-end
//! tests: kept out of the worker so that its production build carries no test server (nor axum).
//!
//! - [`scripted_server`]: an OpenAI-compatible model server that answers from a script, or with a
//!   fixed latency for benchmarks.
//! - [`chromium`]: headless Chromium, as the tests and benchmarks that open the run report start it.
//! - [`executor`]: the tool executor, built where the worker's tests look for it.
//! - [`envoy`]: not a double: Envoy shedding what exceeds a real model server's capacity.
//! - [`llama_servers`]: not a double: real llama.cpp servers, several at once, with what each
//!   computed, for the tests and benchmarks of routing over several endpoints.

pub mod chromium;
pub mod envoy;
pub mod executor;
pub mod llama_servers;
pub mod scripted_server;
