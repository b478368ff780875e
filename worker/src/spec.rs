//! The `TrajectoryRun` spec: what a user writes, in a run file or as a Kubernetes resource.
//!
//! These types are serde-only (plus JSON-schema derives behind the `schema` feature) so that the
//! operator's CRD and the worker's run file are one definition. Defaults live here, in one place.
//! This module imports nothing else of the crate: what the schema cannot express is checked above
//! it, by [`RunSpec::validate`](crate::validate) in [`crate::validate`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[cfg(feature = "schema")]
use schemars::JsonSchema;

/// Desired state of a trajectory run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct RunSpec {
    /// The JSONL file of prompts.
    pub dataset: DatasetSpec,
    /// Prompts per batch. A batch is one Job completion index and one file on storage.
    #[serde(default = "default_batch_size")]
    pub batch_size: u32,
    /// Batches worked at once (pods running in parallel; in a local run, batches in flight).
    /// Can be changed while a run is going.
    #[serde(default = "default_workers")]
    pub workers: u32,
    /// Conversations in flight inside one batch.
    #[serde(default = "default_concurrency")]
    pub concurrency: u32,
    /// Toolset distribution: the name of a built-in distribution, or an inline map of toolset
    /// name to inclusion probability in percent (each toolset drawn independently per prompt). A
    /// key may group toolsets with `+` (`browser+search`): one draw offers all of them.
    #[serde(default)]
    pub distribution: DistributionSpec,
    /// Seed of toolset sampling. The toolsets of a prompt are a pure function of
    /// (seed, prompt index, sample), identical across runs and machines.
    #[serde(default)]
    pub seed: u64,
    /// Samples generated per prompt; each sample is a distinct record.
    #[serde(default = "default_samples_per_prompt")]
    pub samples_per_prompt: u32,
    /// The OpenAI-compatible model server and sampling settings.
    pub model: ModelSpec,
    /// Agent loop settings.
    #[serde(default)]
    pub agent: AgentSpec,
    /// Tool settings.
    #[serde(default)]
    pub tools: ToolsSpec,
    /// Where and how confined the model's terminal commands run.
    #[serde(default)]
    pub sandbox: SandboxSpec,
    /// The check run after each conversation in the environment it left, whose reward goes
    /// into the record: the default of rows that name no verifier of their own (`test`,
    /// `verify`, `tests_tar`, `test_sh`), and the settings of every row's. Without it, only rows
    /// that name one are verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verifier: Option<VerifierSpec>,
    /// Reuse another run's tool outputs: a conversation whose tool call is the same, at the
    /// same position, as in the other run's conversation of the same row and sample gets that
    /// call's recorded output instead of running the tool, until its first call that differs;
    /// from there its tools run for real. For regenerating a dataset with another model or
    /// system prompt without paying for the tools of the shared prefix, and for deterministic
    /// tests of the agent loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<ReplaySpec>,
    /// A simulated user for the rows that carry a `user_scenario` (tau2-bench's: a `persona`
    /// and `instructions`): once the model has answered the row's own turns, another model,
    /// playing that user, writes the next user message, until it says one of its `stopTokens`
    /// or has written `maxTurns`. Its turns are never the model's: records mark them
    /// `user_simulator` and keep its usage and cost apart from the agent's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_simulator: Option<Box<UserSimulatorSpec>>,
    /// Which finished conversations are kept as trajectories.
    #[serde(default)]
    pub filters: FiltersSpec,
    /// Where the run's outputs go.
    #[serde(default)]
    pub storage: StorageSpec,
    /// Retry limits.
    #[serde(default)]
    pub retry: RetrySpec,
    /// Also write `trajectories.openai.jsonl` with each record as `OpenAI` `messages` + `tools`.
    #[serde(default)]
    pub openai_format: bool,
    /// Kueue `LocalQueue` to admit the run's Jobs through (cluster only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_name: Option<String>,
    /// Stop starting new work; finished batches stay finished. Can be changed while a run is going.
    #[serde(default)]
    pub suspend: bool,
    /// Pod settings of the run's Jobs (cluster only): image, resources, scheduling, env.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("x-kubernetes-preserve-unknown-fields" = true)))]
    pub pod_template: Option<Value>,
}

/// The simulated user (`spec.userSimulator`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct UserSimulatorSpec {
    /// The simulator's model, named as `spec.model` names one (its own endpoint, key and
    /// prices; it has no `budget` or `tokens` of its own). On a cluster its key comes from its
    /// `apiKeySecretRef`.
    pub model: ModelSpec,
    /// User messages it may write in one conversation, after the row's own turns.
    #[serde(default = "default_simulated_turns")]
    pub max_turns: u32,
    /// What the simulated user says to end the conversation (tau2-bench's markers by default):
    /// a message holding one ends it, and is not sent to the model.
    #[serde(default = "default_stop_tokens")]
    pub stop_tokens: Vec<String>,
}

fn default_simulated_turns() -> u32 {
    5
}

fn default_stop_tokens() -> Vec<String> {
    ["###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"]
        .map(str::to_owned)
        .to_vec()
}

/// The dataset of prompts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct DatasetSpec {
    /// Path of the JSONL file (or, with `format: HarborTasks`, of the directory of tasks),
    /// relative to the storage volume. Absolute paths and `..` are refused.
    pub path: String,
    /// What `path` names: a JSONL file of rows (`Jsonl`, the default), or Harbor task
    /// directories (`HarborTasks`: a task, or a directory of them), each task read as a row.
    #[serde(default, skip_serializing_if = "DatasetFormat::is_jsonl")]
    pub format: DatasetFormat,
    /// Field of each JSON line that holds the prompt. Lines may instead carry a chat-style
    /// `conversations` or `messages` list whose first user turn is the prompt.
    #[serde(default = "default_prompt_field")]
    pub prompt_field: String,
    /// Keep only the first N valid prompts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_samples: Option<u64>,
    /// With `format: HarborTasks`: an oracle run's output directory (or its `oracle.jsonl`),
    /// relative to the storage volume. The tasks that run did not pass (a reward below 1, or
    /// none) are left out of this one, each named in `harbor-refused.jsonl`; tasks it did not
    /// run are kept. Run the oracle (`spec.agent.oracle`) over the same tasks first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude_oracle_failures: Option<String>,
}

impl DatasetSpec {
    /// The oracle report `exclude_oracle_failures` names, relative to the storage volume.
    pub fn oracle_report(&self) -> Option<String> {
        self.exclude_oracle_failures
            .as_deref()
            .map(|from| file_or_default(from, "oracle.jsonl"))
    }
}

/// `from` when it names a JSONL file, else the file `name` in the directory `from` names.
fn file_or_default(from: &str, name: &str) -> String {
    let named_file = std::path::Path::new(from)
        .extension()
        .is_some_and(|extension| extension.eq_ignore_ascii_case("jsonl"));
    if named_file {
        from.to_owned()
    } else {
        format!("{}/{name}", from.trim_end_matches('/'))
    }
}

/// What `spec.dataset.path` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub enum DatasetFormat {
    /// A JSONL file, a row a line.
    #[default]
    Jsonl,
    /// Harbor task directories (`instruction.md`, `task.toml`, `environment/`, `tests/`,
    /// `solution/`): a task, or a directory whose subdirectories are tasks. The plan writes
    /// them as the run's rows (`harbor-tasks.jsonl` in the run's output) and names the tasks
    /// it refuses (`harbor-refused.jsonl`).
    HarborTasks,
}

impl DatasetFormat {
    pub fn is_jsonl(&self) -> bool {
        *self == Self::Jsonl
    }
}

/// A named distribution or an inline one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(untagged)]
pub enum DistributionSpec {
    /// One of the built-in distribution names (e.g. `terminal_only`, `development`).
    Named(String),
    /// Toolset name, or toolsets joined by `+` that one draw offers together
    /// (`browser+search`), → inclusion probability in percent (0–100). Entries are drawn in the
    /// map's (alphabetical) order, which is the order of `toolsets_used`.
    Inline(BTreeMap<String, f64>),
}

impl Default for DistributionSpec {
    fn default() -> Self {
        Self::Named("terminal_only".to_owned())
    }
}

/// The model server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// Base URL of the OpenAI-compatible API, including `/v1` (e.g. `http://vllm:8000/v1`): the
    /// model's one endpoint. Servers of the same model behind several URLs go in `endpoints`
    /// instead; one of the two is set.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub base_url: String,
    /// Several servers of the same model (replicas), instead of `baseUrl`. Every turn of a
    /// conversation goes to one of them, chosen by the conversation's identity with a load
    /// bound (`routing`), so that the server's prefix cache keeps its history; an endpoint that
    /// keeps failing is taken out for a while and its conversations move to the others.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<EndpointSpec>,
    /// How conversations are spread over the endpoints, and how their identity is sent.
    #[serde(default)]
    pub routing: RoutingSpec,
    /// Model name sent in every request.
    pub name: String,
    /// Secret holding the API key (cluster). Never inline, never logged, never in status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret_ref: Option<SecretKeyRef>,
    /// Environment variable holding the API key (local runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// `max_tokens` of every completion; unset leaves the provider default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Sampling temperature; unset leaves the provider default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Reasoning settings, passed as the provider expects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<ReasoningSpec>,
    /// Timeout of one HTTP request to the model, in seconds.
    #[serde(default = "default_request_timeout")]
    pub request_timeout_seconds: u64,
    /// Attempts per model call for retryable errors (5xx, timeouts, empty replies). Being told
    /// to slow down (429, 529, a 503 with `Retry-After` or shed by a proxy) spends none: the
    /// worker sends that endpoint fewer requests at once and waits out the `Retry-After`.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Receive completions as server-sent events instead of one JSON body.
    #[serde(default)]
    pub stream: bool,
    /// Extra JSON merged verbatim into every request body (provider routing and the like).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("x-kubernetes-preserve-unknown-fields" = true)))]
    pub extra_body: Option<Value>,
    /// What the model's tokens cost, so that every record carries its cost and the run its
    /// totals; unset: only costs the provider reports with the usage (`usage.cost`) count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pricing: Option<PricingSpec>,
    /// A cap on what the run's model calls cost, priced by `pricing` (which it needs), held by
    /// all of the run's pods together. At the budget no new conversation starts: those in
    /// flight finish, and the run stops with reason `BudgetExhausted` (on a cluster it is held
    /// `Suspended`, its generation Jobs suspended); raising `maxCost` finishes it, every record
    /// once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetSpec>,
    /// The provider's rate limits on the run's key, kept by the run's requests over all its
    /// pods: a request waits until it fits instead of being refused with a 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsSpec>,
    /// Ask the provider for a service tier on every call (`service_tier`), such as the flex
    /// tier's lower price for slower answers; each call's cost is at the tier it was served at
    /// (the response's `service_tier`, else the one asked). Unset: the provider's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_tier: Option<ServiceTierSpec>,
    /// Send the model calls through the provider's Batch API (`OpenAI`'s files and batches
    /// dialect) at its price, about half: the ready turns of the run's conversations are
    /// collected into windows, each sent as one provider batch, and each conversation goes on
    /// when its answer comes back. A turn that waits past `deadlineSeconds`, or whose batch gives
    /// no answer, goes live. For large, patient runs: give `concurrency` enough conversations to
    /// fill the windows. Unset: every call is a live request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchSpec>,
    /// Ask each call for the server's own token ids and logprobs and keep them, for trainers
    /// that need them (reinforcement learning, distillation): per call the prompt and
    /// completion ids and one logprob per sampled token, in `trajectories.tokens.jsonl` beside
    /// the trajectories (which stay as they are). Unset: nothing is asked or kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokensSpec>,
}

/// Batch mode (`spec.model.batch`): how turns are collected into provider batches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct BatchSpec {
    /// Which Batch API the provider speaks: `OpenAI`'s files and batches, or Anthropic's
    /// Message Batches (each turn translated into a message's parameters).
    #[serde(default)]
    pub provider: BatchProvider,
    /// Base URL of the provider's Batch API, including `/v1` (its `/files` and `/batches`, or
    /// `/messages/batches`); unset: the model's `baseUrl`. The model's key is sent to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// A window closes at this many turns (1 to 50,000, `OpenAI`'s limit per batch; 100,000
    /// Anthropic's).
    #[serde(default = "default_batch_max_requests")]
    pub max_requests: u32,
    /// A window closes before its requests grow past this many MiB (1 to 200, `OpenAI`'s limit
    /// per file; 256 Anthropic's per batch).
    #[serde(default = "default_batch_max_megabytes")]
    pub max_megabytes: u32,
    /// A window closes this many seconds after its first turn, however few it holds.
    #[serde(default = "default_batch_max_wait_seconds")]
    pub max_wait_seconds: u64,
    /// How often a provider batch's status is asked, in seconds.
    #[serde(default = "default_batch_poll_seconds")]
    pub poll_seconds: u64,
    /// A turn that has waited this many seconds for its batch goes live (its batch answer is
    /// dropped when it comes): the run's tail is not the batch's.
    #[serde(default = "default_batch_deadline_seconds")]
    pub deadline_seconds: u64,
    /// Once a worker has started every conversation of its batch and at most this percent of
    /// them are still running, their turns go live (those waiting in a window too): the last
    /// turns of the stragglers do not each wait a batch's turnaround. 0: never.
    #[serde(default = "default_batch_live_tail_percent")]
    pub live_tail_percent: u32,
}

/// The dialect of a provider's Batch API (`spec.model.batch.provider`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub enum BatchProvider {
    /// `POST /files` (`purpose=batch`) then `POST /batches`, as `OpenAI`, `OpenRouter`,
    /// Together, Groq, Fireworks and gateways such as `LiteLLM` take them; batches are named in
    /// their metadata, so a batch whose id a killed worker never recorded is found again.
    #[default]
    OpenAI,
    /// Anthropic's Message Batches (`POST /messages/batches`, `x-api-key`,
    /// `anthropic-version: 2023-06-01`). Its batches carry no metadata: a worker killed in the
    /// instant between a batch's creation and the journal entry of its id leaves a batch no
    /// one can find, and its window is sent again.
    Anthropic,
}

fn default_batch_live_tail_percent() -> u32 {
    5
}

fn default_batch_max_requests() -> u32 {
    1000
}

fn default_batch_max_megabytes() -> u32 {
    100
}

fn default_batch_max_wait_seconds() -> u64 {
    30
}

fn default_batch_poll_seconds() -> u64 {
    30
}

fn default_batch_deadline_seconds() -> u64 {
    3600
}

/// The service tier asked of the provider (`spec.model.serviceTier`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ServiceTierSpec {
    /// The tier, sent as the request's `service_tier`.
    pub tier: ServiceTier,
    /// A call the provider keeps refusing at this tier (429: no capacity, which slows the
    /// run's calls down as any 429 does) is sent at the standard tier once it has been refused
    /// for this many seconds, and priced so. Unset: it keeps asking at this tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_after_seconds: Option<u64>,
}

/// A provider's service tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub enum ServiceTier {
    /// `service_tier: "flex"` (`OpenAI`, and providers that copy it): the Batch API's price,
    /// answered synchronously but more slowly, refused with a 429 when the provider has no
    /// capacity. Give it a long `requestTimeoutSeconds` (`OpenAI` advises 15 minutes).
    Flex,
    /// `service_tier: "priority"`: faster answers at a higher price.
    Priority,
}

impl ServiceTier {
    /// The request's `service_tier`.
    pub fn wire_name(self) -> &'static str {
        match self {
            Self::Flex => "flex",
            Self::Priority => "priority",
        }
    }
}

/// What is asked of the model server for each call's tokens (`spec.model.tokens`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct TokensSpec {
    /// How the server gives token ids.
    #[serde(default)]
    pub request: TokenRequest,
    /// Alternatives kept for each sampled token with their logprobs, 0 to 20 (0: the sampled
    /// token's logprob only).
    #[serde(default)]
    pub top_logprobs: u8,
    /// With `request: Retokenize`, the root of the llama.cpp server (`llama-server`, the same
    /// model's tokenizer and chat template loaded) whose `/apply-template` and `/tokenize` make
    /// the ids, e.g. `http://tokenizer:8080`; unset, the model endpoint's own root. The model's
    /// key is not sent to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_url: Option<String>,
}

/// How a model server gives the token ids of a chat completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub enum TokenRequest {
    /// `return_token_ids` with `logprobs` (vLLM 0.10.2 and later, SGLang): the response carries
    /// the prompt's ids and the completion's.
    #[default]
    ReturnTokenIds,
    /// llama.cpp's `llama-server`: each logprob carries its token's id, and the prompt's ids are
    /// asked of the same server's `/apply-template` and `/tokenize` for the same request (the
    /// steps its chat endpoint takes).
    LlamaServer,
    /// `logprobs` only, as hosted APIs give them: no ids (records say `none`).
    LogprobsOnly,
    /// `logprobs` only, and ids made again from the text by a llama.cpp server's
    /// `/apply-template` and `/tokenize` (`tokenizerUrl`): the prompt's as its template renders
    /// the request, the reply's as the next prompt holds it (end of turn included). Not the
    /// sampled ids (tokenizing a reply again gives others for some replies, and a template may
    /// render a reply apart from how it was sampled), so records say `retokenized` and the
    /// reinforcement-learning exports take them only with `--force`. For servers that give no
    /// ids, such as hosted APIs serving open weights.
    Retokenize,
}

/// Rate limits on a model's key, over every pod of a run. Each pod keeps its share, the limit
/// divided by `workers` (at most `workers` pods run at once, so the shares never add up to more
/// than the limit); a local run keeps all of it. Each per-minute limit holds over any 60 s,
/// not only over calendar minutes, and lets through at least 95 % of it when there is work.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct LimitsSpec {
    /// Requests a minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Input tokens a minute, every prompt token counted (cached ones too). A request reserves
    /// its prompt's size (a token a 4 bytes of its body) and is settled to the usage it reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens_per_minute: Option<u64>,
    /// Output tokens a minute. A request reserves `maxTokens` (1,024 when unset) and is settled
    /// to the usage it reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens_per_minute: Option<u64>,
    /// Input and output tokens together a minute, as `OpenAI` counts its tokens-a-minute limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Whether the limits not set here are learnt from the provider's answers (default true):
    /// the first `x-ratelimit-limit-requests` / `x-ratelimit-limit-tokens` (`OpenAI`) or
    /// `anthropic-ratelimit-*-limit` (Anthropic) header it sends is kept from then on, at this
    /// pod's share (or whole, through `gubernator`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_headers: Option<bool>,
    /// Requests in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u64>,
    /// A Gubernator service that keeps the per-minute counts for every pod of the run, and of
    /// every run that names the same `key`, instead of each pod keeping its share: a pod then
    /// uses what the others leave. A pod that cannot reach it keeps its share meanwhile.
    /// (`maxInFlight` stays a share a pod.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gubernator: Option<GubernatorSpec>,
}

/// Where the counts of a key's rate limits are kept across pods and runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct GubernatorSpec {
    /// Its HTTP address (`http://gubernator.infra:1050`).
    pub url: String,
    /// What the counts are kept under: runs that name the same key share the limits (name it
    /// after the provider's key they share; every run naming it must give the same limits).
    pub key: String,
}

/// One server of the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct EndpointSpec {
    /// Base URL of its OpenAI-compatible API, including `/v1` (e.g.
    /// `http://vllm-0.vllm:8000/v1`).
    pub base_url: String,
}

/// How a run's conversations are spread over the model's endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct RoutingSpec {
    /// `ConversationHash` (every request of a conversation to one endpoint, by the
    /// conversation's identity) or `RoundRobin` (each request to the next endpoint in turn, for
    /// servers that keep no cache between requests).
    #[serde(default)]
    pub strategy: RoutingStrategy,
    /// How far above an equal share of a pod's conversations one endpoint may go before a new
    /// conversation goes to the next endpoint in its order: 1.25 lets one hold a quarter more
    /// than its share. At least 1.
    #[serde(default = "default_load_bound")]
    pub load_bound: f64,
    /// HTTP header that carries the conversation's identity on each of its requests, for
    /// gateways and routers that keep a session on one replica (vLLM production-stack's
    /// session router, llm-d's session affinity); empty sends none.
    #[serde(default = "default_session_header")]
    pub session_header: String,
    /// Also send the conversation's identity as `prompt_cache_key` in the request body, as
    /// `OpenAI`'s API takes it to route a conversation's requests to one cache. Off by default:
    /// servers that check their fields strictly refuse a field they do not know.
    #[serde(default)]
    pub prompt_cache_key: bool,
}

/// How requests are spread over the model's endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub enum RoutingStrategy {
    /// Every request of a conversation to one endpoint, chosen by its identity within the load
    /// bound.
    #[default]
    ConversationHash,
    /// Each request to the next endpoint in turn, whatever its conversation.
    RoundRobin,
}

impl Default for RoutingSpec {
    fn default() -> Self {
        Self {
            strategy: RoutingStrategy::default(),
            load_bound: default_load_bound(),
            session_header: default_session_header(),
            prompt_cache_key: false,
        }
    }
}

impl ModelSpec {
    /// The base URLs of the model's endpoints: `endpoints`, or `baseUrl` alone.
    pub fn base_urls(&self) -> Vec<String> {
        if self.endpoints.is_empty() {
            vec![self.base_url.clone()]
        } else {
            self.endpoints
                .iter()
                .map(|endpoint| endpoint.base_url.clone())
                .collect()
        }
    }
}

/// The most a run may spend on its model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct BudgetSpec {
    /// USD, over the whole run: what earlier runs of the same output spent counts too.
    pub max_cost: f64,
}

/// The model's prices: USD per million tokens given inline (`input` and `output` at least), or
/// one model's entry of `LiteLLM`'s price table in its own format (`litellm`), not both. Each
/// completion is priced on its own, as `LiteLLM` prices it: input tokens that were neither read
/// from nor written to a cache at `input`, cache reads at `cachedInput`, cache writes at
/// `cacheWrite` (each `input` when unset), output at `output`, reasoning tokens at `reasoning`
/// (`output` when unset).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct PricingSpec {
    /// USD per million input tokens not read from or written to a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<f64>,
    /// USD per million input tokens read from the provider's prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<f64>,
    /// USD per million input tokens written to the provider's prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<f64>,
    /// USD per million output tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<f64>,
    /// USD per million reasoning tokens, where the model prices them apart from other output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<f64>,
    /// One model's entry of `LiteLLM`'s `model_prices_and_context_window.json`, as it is there
    /// (`input_cost_per_token`, `output_cost_per_token`, `cache_read_input_token_cost`,
    /// `cache_creation_input_token_cost`, `output_cost_per_reasoning_token`, and tiers such as
    /// `input_cost_per_token_above_200k_tokens`); its other fields are ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("x-kubernetes-preserve-unknown-fields" = true)))]
    pub litellm: Option<Value>,
    /// Take the cost the provider reports with a completion's usage (`OpenRouter`'s
    /// `usage.cost`) over these prices.
    #[serde(default = "default_prefer_reported_cost")]
    pub prefer_reported_cost: bool,
    /// USD per million tokens of calls at the flex tier (`serviceTier`), inline; a rate left
    /// out is the standard one. With `litellm`, the entry's `*_flex` rates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flex: Option<TierPricingSpec>,
    /// USD per million tokens of calls at the priority tier, inline; a rate left out is the
    /// standard one. With `litellm`, the entry's `*_priority` rates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<TierPricingSpec>,
    /// USD per million tokens of calls through a provider's Batch API, inline; a rate left out
    /// is the standard one, and without this every rate is half the standard one (as `LiteLLM`
    /// prices batches of models without batch rates). With `litellm`, the entry's `*_batches`
    /// rates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<TierPricingSpec>,
}

/// One service tier's prices, USD per million tokens; what is left out is the standard price.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct TierPricingSpec {
    /// Input tokens not read from or written to a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<f64>,
    /// Input tokens read from the provider's prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<f64>,
    /// Input tokens written to the provider's prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<f64>,
    /// Output tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<f64>,
    /// Reasoning tokens, where the model prices them apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<f64>,
}

impl Default for PricingSpec {
    fn default() -> Self {
        Self {
            input: None,
            cached_input: None,
            cache_write: None,
            output: None,
            reasoning: None,
            litellm: None,
            prefer_reported_cost: default_prefer_reported_cost(),
            flex: None,
            priority: None,
            batch: None,
        }
    }
}

fn default_prefer_reported_cost() -> bool {
    true
}

/// A key of a Kubernetes Secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub struct SecretKeyRef {
    /// Secret name, in the run's namespace.
    pub name: String,
    /// Key inside the Secret.
    pub key: String,
}

impl SecretKeyRef {
    /// The environment variable a run's pods get this key as, when a tool setting refers to it:
    /// `TRAJ_SECRET_<NAME>__<KEY>`, upper-cased, with every other character than letters and
    /// digits written `_`.
    pub fn env_var(&self) -> String {
        let part = |text: &str| -> String {
            text.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() {
                        c.to_ascii_uppercase()
                    } else {
                        '_'
                    }
                })
                .collect()
        };
        format!("TRAJ_SECRET_{}__{}", part(&self.name), part(&self.key))
    }
}

/// Reasoning ("thinking") settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReasoningSpec {
    /// Effort level (`none`, `minimal`, `low`, `medium`, `high`, `xhigh`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effort: Option<String>,
    /// Turn thinking off entirely; wins over `effort`.
    #[serde(default)]
    pub disabled: bool,
}

/// Agent loop settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentSpec {
    /// Model calls per conversation before a final call without tools asks for an answer.
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    /// System prompt used while generating and never saved into trajectories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral_system_prompt: Option<String>,
    /// Wall-clock budget of one conversation, in seconds.
    #[serde(default = "default_prompt_timeout")]
    pub prompt_timeout_seconds: u64,
    /// The oracle pass: each row's solution (a Harbor task's `solution/solve.sh`) runs where
    /// its conversation would, instead of the model (which is not asked), and its verifier
    /// judges what it left: a row whose reward is not full names a broken task before any
    /// token is paid for.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub oracle: bool,
}

impl Default for AgentSpec {
    fn default() -> Self {
        Self {
            max_turns: default_max_turns(),
            ephemeral_system_prompt: None,
            prompt_timeout_seconds: default_prompt_timeout(),
            oracle: false,
        }
    }
}

/// Tool settings.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ToolsSpec {
    /// Terminal tool settings.
    #[serde(default)]
    pub terminal: TerminalSpec,
    /// Keep each conversation's workspace directory after it ends (for debugging).
    #[serde(default)]
    pub keep_workspaces: bool,
    /// The `web` toolset (`web_search`, `web_extract`). A distribution that can draw `web` needs
    /// `web.search`.
    #[serde(default)]
    pub web: WebSpec,
    /// MCP servers. Each one is a toolset, named by its `name`, that distributions (inline maps)
    /// can draw; its tools are listed once, when the run is planned, and frozen into the plan.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp: Vec<McpServerSpec>,
    /// Tools that call a team's own HTTP services, declared here, grouped into toolsets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub http: Vec<HttpToolsetSpec>,
    /// Browser tool settings (`browser_*`: headless Chromium over the `DevTools` protocol). A run
    /// whose distribution can draw `browser` needs this section, even if empty (`browser: {}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub browser: Option<BrowserSpec>,
    /// The `vision` toolset (`vision_analyze`) and, with `browser`, `browser_vision`: an
    /// OpenAI-compatible multimodal chat endpoint. A run whose distribution can draw `vision`
    /// needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vision: Option<VisionSpec>,
    /// The `image_gen` toolset (`image_generate`): an `OpenAI` Images-compatible endpoint. A run
    /// whose distribution can draw `image_gen` needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_gen: Option<ImageGenSpec>,
}

impl ToolsSpec {
    /// The toolset names the spec declares (MCP servers and HTTP toolsets), in declaration order.
    pub fn declared_toolsets(&self) -> impl Iterator<Item = &str> {
        self.mcp
            .iter()
            .map(|server| server.name.as_str())
            .chain(self.http.iter().map(|group| group.toolset.as_str()))
    }
}

/// An MCP server whose tools the agent is offered, as the toolset `name`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct McpServerSpec {
    /// Toolset name (letters, digits, `_` and `-`); the server's tools are offered to the model
    /// as `mcp__<name>__<tool>`, as hermes-agent names them.
    pub name: String,
    /// Reach the server over MCP's streamable HTTP transport. Exactly one of `streamableHttp`
    /// and `stdio` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streamable_http: Option<McpHttpTransport>,
    /// Start the server as a program and talk to it over stdin/stdout: the worker's child in local
    /// runs; on a cluster in the pod's sandbox container (the plan pod gets one too). Exactly one
    /// of `streamableHttp` and `stdio` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdio: Option<McpStdioTransport>,
    /// Time limit of one tool call, in seconds; a call that takes longer is a tool error.
    #[serde(default = "default_mcp_call_timeout")]
    pub timeout_seconds: u64,
    /// Time limit of connecting to the server (starting it, for stdio) and listing its tools
    /// when the run is planned, and of a reconnection before a call.
    #[serde(default = "default_mcp_connect_timeout")]
    pub connect_timeout_seconds: u64,
    /// Bytes of one tool result the model is shown; longer results are cut with a marker.
    #[serde(default = "default_tool_result_bytes")]
    pub max_result_bytes: u64,
}

/// MCP streamable HTTP transport settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct McpHttpTransport {
    /// The server's MCP endpoint, an http:// or https:// URL (e.g. `http://tools.team:8080/mcp`).
    pub url: String,
    /// Headers sent with every request (an `Authorization` token, say), values from the
    /// environment or a Secret.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<NamedValue>,
}

/// MCP stdio transport settings: the server is a child process of the worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct McpStdioTransport {
    /// The program, found on `PATH` unless it is a path. On a cluster it runs in the pod's
    /// sandbox container, confined like a terminal command: `spec.sandbox.image` must have it,
    /// under a system directory (`/usr`, `/opt`, …).
    pub command: String,
    /// Its arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Its whole environment besides `PATH`: the worker's own environment (which holds the model's
    /// API key) is never passed on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<NamedValue>,
}

/// A named value (an HTTP header, an environment variable): a constant, or read from the
/// worker's environment or a Secret. Secrets are never written inline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct NamedValue {
    /// The header's or variable's name.
    pub name: String,
    /// A constant value, for what is not secret (`Accept: application/json`). Refused for names
    /// that look like credentials (authorization, cookie, and names with key, token, secret,
    /// password or auth in them): use `valueFrom`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Where the value comes from. Exactly one of `value` and `valueFrom` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<ValueSource>,
}

/// Where a secret value comes from: exactly one of `env` (local runs) and `secretKeyRef` (cluster).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ValueSource {
    /// Environment variable of the worker holding the value (local runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
    /// Secret key holding the value (cluster): the run's pods get it as the environment variable
    /// [`SecretKeyRef::env_var`] names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_key_ref: Option<SecretKeyRef>,
}

impl ValueSource {
    /// Whether exactly one of `env` (non-empty) and `secretKeyRef` (name and key) is set.
    pub fn is_well_formed(&self) -> bool {
        match (&self.env, &self.secret_key_ref) {
            (Some(env), None) => !env.is_empty(),
            (None, Some(secret)) => !secret.name.is_empty() && !secret.key.is_empty(),
            _ => false,
        }
    }

    /// The environment variable the worker reads the value from.
    pub fn env_var(&self) -> Option<String> {
        match (&self.env, &self.secret_key_ref) {
            (Some(env), _) => Some(env.clone()),
            (None, Some(secret)) => Some(secret.env_var()),
            (None, None) => None,
        }
    }
}

/// A toolset of declared HTTP tools.
///
/// A list of `{toolset, tools}` rather than a `toolset` field on each tool: distributions draw
/// toolsets, so the group is the unit a user thinks in (one service, one toolset), declaration
/// order is kept (it is the catalog order), and a list of objects reads and merges well in a
/// Kubernetes resource where a map keyed by name would not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct HttpToolsetSpec {
    /// Toolset name (letters, digits, `_` and `-`), as distributions name it.
    pub toolset: String,
    /// Its tools, in the order they are offered.
    pub tools: Vec<HttpToolSpec>,
}

/// One declared HTTP tool: what the model is told, and the request a call makes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct HttpToolSpec {
    /// Tool name the model calls (letters, digits, `_` and `-`, at most 64).
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// JSON schema of the arguments: an object schema whose `properties` name every placeholder
    /// the templates use; `required` ones must be given in a call.
    #[cfg_attr(feature = "schema", schemars(extend("x-kubernetes-preserve-unknown-fields" = true)))]
    pub parameters: Value,
    /// HTTP method.
    #[serde(default)]
    pub method: HttpMethod,
    /// URL template, an http:// or https:// URL; `{name}` is replaced by the argument `name`,
    /// percent-encoded (an absent optional argument by nothing). Placeholders may appear in the
    /// path and query only, never in the scheme, host or port.
    pub url: String,
    /// JSON body template: a string that is exactly `"{name}"` becomes the argument with its JSON
    /// type (an absent optional argument: `null`); `{name}` inside a longer string is replaced by
    /// the argument's text. Sent as `application/json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("x-kubernetes-preserve-unknown-fields" = true)))]
    pub body: Option<Value>,
    /// Headers sent with every call, values from the environment or a Secret.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<NamedValue>,
    /// Time limit of one call, in seconds.
    #[serde(default = "default_http_tool_timeout")]
    pub timeout_seconds: u64,
    /// Bytes of response body accepted; a longer answer is a tool error.
    #[serde(default = "default_tool_result_bytes")]
    pub max_response_bytes: u64,
}

/// The HTTP method of a declared tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "UPPERCASE")]
pub enum HttpMethod {
    #[default]
    Get,
    Post,
    Put,
    Patch,
    Delete,
}

/// Web search and page extraction.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct WebSpec {
    /// The search backend of `web_search`; required when the distribution can draw `web`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub search: Option<WebSearchSpec>,
    /// Limits of the page fetches of `web_extract` (it fetches pages itself, no backend needed).
    #[serde(default)]
    pub extract: WebExtractSpec,
}

/// Which API a search backend speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum WebSearchBackend {
    /// A `SearXNG` (or searx) instance's JSON API: `<url>/search?q=<query>&format=json`, no key.
    /// The instance must list `json` in `search.formats`.
    #[default]
    Searxng,
    /// Any JSON search endpoint: `url` is a template, the result fields are found by the
    /// `*Pointer` settings (Brave's API, for example, is `json` with `apiKeyHeader`).
    Json,
}

/// The search backend of `web_search`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct WebSearchSpec {
    /// The API the backend speaks.
    #[serde(default)]
    pub backend: WebSearchBackend,
    /// `searxng`: the instance's base URL (e.g. `http://searxng.search:8080`). `json`: a URL
    /// template in which `{query}` is replaced by the URL-encoded query and `{limit}` by the
    /// result count (e.g. `https://api.search.brave.com/res/v1/web/search?q={query}&count={limit}`).
    pub url: String,
    /// `json`: JSON pointer (RFC 6901) to the array of results in the answer.
    #[serde(default = "default_results_pointer")]
    pub results_pointer: String,
    /// `json`: JSON pointer to the title inside one result.
    #[serde(default = "default_title_pointer")]
    pub title_pointer: String,
    /// `json`: JSON pointer to the URL inside one result.
    #[serde(default = "default_url_pointer")]
    pub url_pointer: String,
    /// `json`: JSON pointer to the snippet (the result's `description`) inside one result.
    #[serde(default = "default_snippet_pointer")]
    pub snippet_pointer: String,
    /// Header that carries the API key (e.g. `X-Subscription-Token`); unset, a configured key is
    /// sent as `Authorization: Bearer <key>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_header: Option<String>,
    /// Secret holding the backend's API key (cluster; the worker reads it from
    /// `TRAJ_WEB_SEARCH_API_KEY`). Never inline, never logged, never in a record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret_ref: Option<SecretKeyRef>,
    /// Environment variable holding the backend's API key (local runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Time limit of one search request, in seconds.
    #[serde(default = "default_web_search_timeout")]
    pub timeout_seconds: u64,
    /// Results shown to the model per search (1–20; the reference shows 5).
    #[serde(default = "default_web_max_results")]
    pub max_results: u32,
}

/// Limits of `web_extract`'s page fetches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct WebExtractSpec {
    /// Time limit of fetching one page (connect, redirects and body), in seconds.
    #[serde(default = "default_web_extract_timeout")]
    pub timeout_seconds: u64,
    /// Bytes of one page's body read at most; a longer page is cut there and extracted from
    /// what was read.
    #[serde(default = "default_web_max_page_bytes")]
    pub max_page_bytes: u64,
    /// Redirects followed per page; one more is a tool error (so is a redirect loop).
    #[serde(default = "default_web_max_redirects")]
    pub max_redirects: u32,
    /// Characters of one page's Markdown shown to the model (the reference's budget is 5000);
    /// the rest is cut with a note saying so.
    #[serde(default = "default_web_max_chars")]
    pub max_chars: u64,
    /// Allow pages on loopback, private, link-local and other non-public addresses (by literal
    /// address or by what the name resolves to). Off, such a URL is refused, as the reference
    /// does: the model must not reach the cluster's or the host's internal services.
    #[serde(default)]
    pub allow_private_addresses: bool,
}

impl Default for WebExtractSpec {
    fn default() -> Self {
        Self {
            timeout_seconds: default_web_extract_timeout(),
            max_page_bytes: default_web_max_page_bytes(),
            max_redirects: default_web_max_redirects(),
            max_chars: default_web_max_chars(),
            allow_private_addresses: false,
        }
    }
}

/// Browser tool settings: the Chromium the worker starts (once per worker process; one
/// browser context per conversation) and what the model may do with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct BrowserSpec {
    /// The Chromium executable (Debian's `chromium` package installs `/usr/bin/chromium`). On a
    /// cluster Chromium runs in the generation pods' sandbox container: `spec.sandbox.image` must
    /// have it there.
    #[serde(default = "default_chromium_path")]
    pub chromium_path: String,
    /// Time for Chromium to start and open its `DevTools` endpoint, in seconds.
    #[serde(default = "default_browser_launch_timeout")]
    pub launch_timeout_seconds: u64,
    /// Time one navigation (`browser_navigate`, or a click, key press or `browser_back` that
    /// loads a page) may take, in seconds; a page that takes longer is a tool error.
    #[serde(default = "default_browser_navigation_timeout")]
    pub navigation_timeout_seconds: u64,
    /// Characters of one `browser_snapshot`; a longer snapshot is cut (the reference's 8000).
    #[serde(default = "default_snapshot_max_chars")]
    pub snapshot_max_chars: u64,
    /// URL schemes `browser_navigate` accepts (lower case). `file` and `chrome` are left out by
    /// default so that the model cannot read the worker's files or the browser's internals.
    #[serde(default = "default_allowed_schemes")]
    pub allowed_schemes: Vec<String>,
}

impl Default for BrowserSpec {
    fn default() -> Self {
        Self {
            chromium_path: default_chromium_path(),
            launch_timeout_seconds: default_browser_launch_timeout(),
            navigation_timeout_seconds: default_browser_navigation_timeout(),
            snapshot_max_chars: default_snapshot_max_chars(),
            allowed_schemes: default_allowed_schemes(),
        }
    }
}

/// The multimodal model of `vision_analyze` and `browser_vision`: an OpenAI-compatible chat
/// completions endpoint (vLLM or llama.cpp serving a vision-language model, or a hosted API), and
/// the limits of fetching the images the model names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct VisionSpec {
    /// Base URL of the API, up to and including its version (e.g. `http://vllm-vl:8000/v1`);
    /// requests go to `<baseUrl>/chat/completions`.
    pub base_url: String,
    /// The model name sent in every request.
    pub model: String,
    /// The API key, sent as `Authorization: Bearer <key>`: `{env: NAME}` (local runs) or
    /// `{secretKeyRef: {name, key}}` (cluster). Unset, no key is sent. Never inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<ValueSource>,
    /// Time limit of one request to the model, in seconds.
    #[serde(default = "default_vision_timeout")]
    pub timeout_seconds: u64,
    /// `max_tokens` of the model's answer (the reference's 2000).
    #[serde(default = "default_vision_max_tokens")]
    pub max_tokens: u32,
    /// Bytes of one image read at most (from a URL or the workspace); a larger image is a tool
    /// error.
    #[serde(default = "default_vision_max_image_bytes")]
    pub max_image_bytes: u64,
    /// Time limit of fetching one image URL (connect, redirects and body), in seconds.
    #[serde(default = "default_vision_download_timeout")]
    pub download_timeout_seconds: u64,
    /// Redirects followed when fetching an image; one more is a tool error (so is a loop).
    #[serde(default = "default_web_max_redirects")]
    pub max_redirects: u32,
    /// Allow image URLs on loopback, private, link-local and other non-public addresses. Off, such
    /// a URL is refused (as `web_extract` refuses it): the model must not reach internal services.
    #[serde(default)]
    pub allow_private_addresses: bool,
}

/// The image model of `image_generate`: an `OpenAI` Images-compatible endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ImageGenSpec {
    /// Base URL of the API, up to and including its version (e.g. `https://api.openai.com/v1`);
    /// requests go to `<baseUrl>/images/generations`.
    pub base_url: String,
    /// The model name sent in every request (e.g. `gpt-image-1`).
    pub model: String,
    /// The API key, sent as `Authorization: Bearer <key>`: `{env: NAME}` (local runs) or
    /// `{secretKeyRef: {name, key}}` (cluster). Unset, no key is sent. Never inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<ValueSource>,
    /// Time limit of one generation (and of downloading an image the endpoint answers with a
    /// URL), in seconds.
    #[serde(default = "default_image_gen_timeout")]
    pub timeout_seconds: u64,
    /// The `size` sent for each of the tool's aspect ratios.
    #[serde(default)]
    pub sizes: ImageSizes,
    /// The `response_format` to ask for (`b64_json` or `url`). Unset, none is sent (some models,
    /// such as `gpt-image-1`, refuse the parameter); both kinds of answer are accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ImageResponseFormat>,
    /// Bytes of one generated image accepted; a larger one is a tool error.
    #[serde(default = "default_image_gen_max_image_bytes")]
    pub max_image_bytes: u64,
    /// Extra JSON merged into every request body (`quality`, `style`, provider options).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("x-kubernetes-preserve-unknown-fields" = true)))]
    pub extra_body: Option<Value>,
}

/// The `size` of an image request for each aspect ratio `image_generate` offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ImageSizes {
    /// `landscape` (the reference's 16:9 wide, its default).
    #[serde(default = "default_landscape_size")]
    pub landscape: String,
    /// `square` (1:1).
    #[serde(default = "default_square_size")]
    pub square: String,
    /// `portrait` (the reference's 16:9 tall).
    #[serde(default = "default_portrait_size")]
    pub portrait: String,
}

impl Default for ImageSizes {
    fn default() -> Self {
        Self {
            landscape: default_landscape_size(),
            square: default_square_size(),
            portrait: default_portrait_size(),
        }
    }
}

/// How an Images endpoint is asked to return the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
pub enum ImageResponseFormat {
    /// The image's bytes, base64-encoded, in the answer.
    #[serde(rename = "b64_json")]
    B64Json,
    /// A URL the worker downloads the image from.
    #[serde(rename = "url")]
    Url,
}

/// Terminal tool settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct TerminalSpec {
    /// Time limit, in seconds, of a command that names none (hermes-agent's `TERMINAL_TIMEOUT`);
    /// also the longest a `process` `wait` blocks. A command may name up to 600 seconds. Past
    /// its time, everything the command started is killed and the model gets exit code 124 with
    /// the output so far.
    #[serde(default = "default_command_timeout")]
    pub timeout_seconds: u64,
    /// Bytes of a command's output shown to the model: the first 40% and the last 60%, with a
    /// notice of what was left out in between (hermes-agent shows 50,000 characters).
    #[serde(default = "default_max_output_bytes")]
    pub max_output_bytes: u64,
}

impl Default for TerminalSpec {
    fn default() -> Self {
        Self {
            timeout_seconds: default_command_timeout(),
            max_output_bytes: default_max_output_bytes(),
        }
    }
}

/// Where the model's terminal commands run, and how they are confined. Every command runs under
/// the tool executor, confined to its conversation's workspace; on a cluster, in a sandbox
/// container of the generation pod that holds no secret and no shared storage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct SandboxSpec {
    /// Image of the generation pods' sandbox container, in which the model's commands run
    /// (cluster only): the run's task image, for example a Python or a repository image. It needs
    /// `bash` or `sh`; the executor binary is copied in by an init container, and the container
    /// runs as uid and gid 65532 whatever the image's user. Default: the worker image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Landlock confinement of the commands to their workspace. `auto`: confined where the
    /// kernel has Landlock; where it has not, the run says so in its Events and status and runs
    /// unconfined. `required`: commands that Landlock cannot confine are refused (the run fails
    /// with the reason). `off`: not used. A local run's `--landlock` flag overrides it.
    #[serde(default)]
    pub landlock: LandlockSetting,
    /// What a conversation's shell (its foreground commands and the jobs they leave running
    /// with `&`) may use, and each of its background jobs. Past a limit the shell or the job is
    /// stopped with everything it started, and the model gets a tool error (a job's result, its
    /// `stopped_reason`) naming the limit; the worker and the other conversations go on. Checked
    /// by the tool executor every 10 to 100 ms and at each command's end, locally and in pods.
    #[serde(default)]
    pub limits: SandboxLimits,
    /// Resources of the generation pods' sandbox container (cluster only), as a container's
    /// `resources`: `requests` and `limits` of `cpu`, `memory` and `ephemeral-storage`. A memory
    /// limit puts the kernel's OOM killer in the sandbox container's cgroup, never the worker's;
    /// an `ephemeral-storage` limit adds to the pod's, against which the kubelet counts the
    /// workspace volume. Default: none (the namespace's `LimitRange`, if any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("x-kubernetes-preserve-unknown-fields" = true)))]
    pub resources: Option<Value>,
    /// Registry prefixes to replace in the images the dataset's rows name (`image`, else
    /// `docker_image`), for a mirror: `{from: "docker.io/", to: "mirror.internal:5000/"}` pulls
    /// `docker.io/swebench/x:latest` as `mirror.internal:5000/swebench/x:latest`. The longest
    /// matching `from` wins; an image no entry matches is pulled as the row names it. Records
    /// keep the row's own fields. Cluster only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_rewrite: Vec<ImageRewrite>,
    /// How long a task container's image may keep failing to pull (`ErrImagePull`,
    /// `ImagePullBackOff`) before its rows are recorded as failed with reason
    /// `image_unavailable`. A pull that is slow but progressing never counts; an image the
    /// registry says does not exist or may not be read, or a malformed reference, counts at once.
    #[serde(default = "default_image_unavailable_after_seconds")]
    pub image_unavailable_after_seconds: u64,
    /// How many images of the rows next in line to pull ahead of their Jobs (0: none): while the
    /// window's Jobs run, a short pod of each of the next `prefetch` images (`<run>-pull-<n>`)
    /// has a node pull it, and that image's Job then prefers that node. The pods run only a
    /// static program of the worker image's that exits at once (as an unprivileged user, nothing
    /// mounted but it), and request 10m CPU and 16 MiB. Set it to the images the nodes can pull
    /// at once beside the running ones (`workers` is a good start). Cluster only.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prefetch: u32,
    /// Directories of the machine that a local run's commands may read and run programs from,
    /// besides their workspace and the system's (`/usr`, `/bin`, `/etc`, `/opt`, ...): a
    /// toolchain installed under the home directory, such as a pyenv version
    /// (`~/.pyenv/versions/3.12.7`), a conda environment (`~/miniconda3/envs/tools`), nvm's Node
    /// or `~/.cargo`. Each is absolute or starts with `~/`. A directory's `bin`, when it has one,
    /// goes first on the commands' `PATH`, in the order named. An interpreter needs its whole
    /// prefix: for Python, the directory that `python3 -c 'import sys; print(sys.base_prefix)'`
    /// prints (a virtual environment's base interpreter lives there: name both). Refused at start:
    /// the home directory itself, and any directory that holds the run's storage, the model's key
    /// file or the conversations' workspaces; a named Python that does not run in the sandbox.
    /// Local runs only (`trajectory-worker local` and `prompt`, whose `--tool-dir` adds more); a
    /// cluster's sandbox container has the directories of its image.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_dirs: Vec<String>,
    /// How the images of Harbor tasks whose `environment/Dockerfile` needs a build (a `RUN`,
    /// `COPY`, `ENV`, ... line, or more than one stage) are built, before any of their
    /// conversations starts. Unset: such tasks are refused by name. Cluster only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builds: Option<ImageBuilds>,
}

/// Where and how task images are built ([`SandboxSpec::builds`]).
///
/// Each distinct build context (a task's `environment/` directory, byte for byte) is built once
/// by a build Job of the run, with `buildah`, and pushed as `<repository>:<its sha256>`; a tag the
/// registry already holds is not built again, in this run or a later one. A build that fails
/// records its tasks' conversations failed with reason `image_build_failed`, without a model
/// request. The build container runs privileged (`buildah` needs to mount and to change root
/// for `RUN` steps) with nothing of the run's but the task's build context: no storage, no
/// model key, no service account token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ImageBuilds {
    /// The repository the images are pushed to, and the generation pods pull them from:
    /// `registry.example.com/team/harbor-envs` (no tag). The nodes must be able to pull from it.
    pub repository: String,
    /// Speak plain HTTP to the registry (an in-cluster registry without TLS), and to the
    /// mirrors `imageRewrite` names (the build's bases come from them); every other registry
    /// over verified TLS.
    #[serde(default)]
    pub insecure: bool,
    /// A Secret of type `kubernetes.io/dockerconfigjson` whose credentials push to
    /// `repository`: mounted in the build containers only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push_secret: Option<String>,
    /// Image of the build containers: it needs `buildah` on `PATH` and runs as root. Default:
    /// the worker image, which has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Resources of a build container, as a container's `resources`. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("x-kubernetes-preserve-unknown-fields" = true)))]
    pub resources: Option<Value>,
}

/// The registry host an image reference names, and the rest of it: its first path component when
/// that is a host a registry can be (it has a `.` or a port, or is `localhost`), as Docker tells a
/// registry from a Docker Hub namespace (`team/tool:1` names none).
pub fn registry_host(reference: &str) -> Option<(&str, &str)> {
    reference
        .split_once('/')
        .filter(|(host, _)| host.contains(['.', ':']) || *host == "localhost")
}

impl ImageBuilds {
    /// The image a build context of digest `hash` (hex sha256) is built as.
    pub fn image_of(&self, hash: &str) -> String {
        format!("{}:{hash}", self.repository.trim_end_matches('/'))
    }
}

/// One prefix of [`SandboxSpec::image_rewrite`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ImageRewrite {
    /// The prefix an image name starts with (`docker.io/`, `ghcr.io/org/`).
    pub from: String,
    /// What replaces it.
    pub to: String,
}

impl Default for SandboxSpec {
    fn default() -> Self {
        Self {
            image: None,
            landlock: LandlockSetting::default(),
            limits: SandboxLimits::default(),
            resources: None,
            image_rewrite: Vec::new(),
            image_unavailable_after_seconds: default_image_unavailable_after_seconds(),
            prefetch: 0,
            tool_dirs: Vec::new(),
            builds: None,
        }
    }
}

impl SandboxSpec {
    /// `image` as the generation pods pull it: the longest [`SandboxSpec::image_rewrite`]
    /// prefix that matches, replaced.
    pub fn rewritten_image(&self, image: &str) -> String {
        self.image_rewrite
            .iter()
            .filter(|rewrite| image.starts_with(&rewrite.from))
            .max_by_key(|rewrite| rewrite.from.len())
            .map_or_else(
                || image.to_owned(),
                |rewrite| format!("{}{}", rewrite.to, &image[rewrite.from.len()..]),
            )
    }
}

/// Whether a count is left at its default, 0 (and so out of the serialised spec, which reads as
/// it did before the field was there).
#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_zero(value: &u32) -> bool {
    *value == 0
}

fn default_image_unavailable_after_seconds() -> u64 {
    300
}

/// Limits on one terminal command and everything it starts (see [`SandboxSpec::limits`]). Zero
/// means no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct SandboxLimits {
    /// Processes and threads alive at once: a fork bomb is stopped when it passes this.
    #[serde(default = "default_sandbox_processes")]
    pub processes: u64,
    /// Bytes of resident memory (anonymous and shared, not the page cache), summed over the
    /// shell's (or the job's) processes. No single process may map more than twice this: an
    /// allocation beyond it fails in the program itself.
    #[serde(default = "default_sandbox_memory_bytes")]
    pub memory_bytes: u64,
    /// Bytes the conversation's workspace may hold on disk. No single file may grow beyond it.
    /// A workspace already past it when a shell starts (an earlier shell's files) stops only
    /// what makes it grow, so the model can still delete files.
    #[serde(default = "default_sandbox_workspace_bytes")]
    pub workspace_bytes: u64,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            processes: default_sandbox_processes(),
            memory_bytes: default_sandbox_memory_bytes(),
            workspace_bytes: default_sandbox_workspace_bytes(),
        }
    }
}

fn default_sandbox_processes() -> u64 {
    256
}

fn default_sandbox_memory_bytes() -> u64 {
    2 << 30
}

fn default_sandbox_workspace_bytes() -> u64 {
    1 << 30
}

/// Landlock confinement of the model's commands (see [`SandboxSpec::landlock`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum LandlockSetting {
    /// Confine where the kernel supports it, and say so where it does not.
    #[default]
    Auto,
    /// Refuse to run commands that cannot be confined.
    Required,
    /// Do not use Landlock.
    Off,
}

/// Where a run's recorded tool outputs come from (`spec.replay`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReplaySpec {
    /// Another run's output, relative to the storage volume (absolute paths and `..` are
    /// refused): its output directory (`trajectories.jsonl` in it is read) or a trajectories
    /// file (`.jsonl`). Its conversations are matched to this run's by `prompt_index` and
    /// `sample`, and must have the same prompt.
    pub from: String,
}

impl ReplaySpec {
    /// The trajectories file `from` names, relative to the storage volume.
    pub fn trajectories(&self) -> String {
        file_or_default(&self.from, "trajectories.jsonl")
    }
}

/// Which conversations are kept.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct FiltersSpec {
    /// Discard conversations in which no assistant turn has reasoning (the reference always did).
    #[serde(default)]
    pub require_reasoning: bool,
    /// Keep a verified conversation as a trajectory only when its reward is at least this; one
    /// below it is kept as a discarded record (`filter: below_reward`, conversation and reward
    /// included), so nothing is lost and statistics still count it. Conversations that were not
    /// verified are not filtered by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_reward: Option<f64>,
}

/// How verifiers run and how their reward is read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct VerifierSpec {
    /// The command (`bash -c`) that verifies a row naming no verifier of its own, run where the
    /// conversation started. Unset: such rows are not verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Seconds a verifier may run; one that runs longer is stopped, with everything it started,
    /// and gives reward 0 with the reason.
    #[serde(default = "default_verifier_timeout")]
    pub timeout_seconds: u64,
    /// Where a row's tests (`tests_tar` unpacked, `test_sh` as `test.sh`) go: an absolute path in
    /// a task container; in a workspace, the same path under its `.verifier` directory. Given to
    /// the command as `$TESTS_DIR`.
    #[serde(default = "default_tests_dir")]
    pub tests_dir: String,
    /// The file the command writes its reward to (a number; `1` passed, `0` failed), placed as
    /// `testsDir` is and given as `$REWARD_FILE`. Its directory is made afresh before the
    /// command runs, so nothing the model wrote can be read as a reward. Without the file, the
    /// reward is 1 when the command exits 0, else 0.
    #[serde(default = "default_reward_file")]
    pub reward_file: String,
    /// The least reward that counts as passed.
    #[serde(default = "default_passing_reward")]
    pub passing_reward: f64,
    /// Stop sampling a prompt once this many of its samples passed (best-of-n with early stop,
    /// with `samplesPerPrompt` as n): its samples run no more at once than could still be needed,
    /// and the ones not run are recorded as discarded (`filter: enough_passed`). Unset: every
    /// sample runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passes_per_prompt: Option<u32>,
}

impl Default for VerifierSpec {
    fn default() -> Self {
        Self {
            command: None,
            timeout_seconds: default_verifier_timeout(),
            tests_dir: default_tests_dir(),
            reward_file: default_reward_file(),
            passing_reward: default_passing_reward(),
            passes_per_prompt: None,
        }
    }
}

/// Where outputs go.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct StorageSpec {
    /// The shared volume (a Kubernetes volume source, cluster only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("x-kubernetes-preserve-unknown-fields" = true)))]
    pub volume: Option<Value>,
    /// Object storage instead of a volume: the dataset (`spec.dataset.path`) and the run's
    /// directory (`outputPath`) are keys under an S3 bucket's prefix, and no pod mounts a
    /// volume. Refused together with `volume`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<ObjectStorageSpec>,
    /// Output directory relative to the volume (or the bucket's prefix); defaults to
    /// `runs/<namespace>/<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_path: Option<String>,
}

/// An S3 bucket (AWS S3 or any S3-compatible server) that holds a run's dataset and files.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ObjectStorageSpec {
    /// `s3://<bucket>/<prefix>`: the dataset path and the output path are keys under the
    /// prefix.
    pub url: String,
    /// The S3 server's URL (`https://s3.eu-west-1.amazonaws.com`, `http://minio.storage:9000`);
    /// AWS's own for the region when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The region requests are signed for (default: the pod's `AWS_REGION`, else `us-east-1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Address the bucket as `<endpoint>/<bucket>` rather than `<bucket>.<endpoint>` (most
    /// self-hosted servers need it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub path_style: bool,
    /// A Secret in the run's namespace holding `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`
    /// (and `AWS_SESSION_TOKEN` if the keys are temporary), given to the worker container alone,
    /// never to a container the model's commands run in. Unset: the pod's workload identity
    /// (EKS IRSA or Pod Identity through the service account of `spec.podTemplate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<String>,
}

/// Retry limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct RetrySpec {
    /// Retries of one batch before it counts as failed.
    #[serde(default = "default_per_batch")]
    pub per_batch: u32,
    /// Failed batches tolerated before the whole run fails.
    #[serde(default = "default_max_failed_batches")]
    pub max_failed_batches: u32,
}

impl Default for RetrySpec {
    fn default() -> Self {
        Self {
            per_batch: default_per_batch(),
            max_failed_batches: default_max_failed_batches(),
        }
    }
}

fn default_verifier_timeout() -> u64 {
    180
}
fn default_tests_dir() -> String {
    "/tests".to_owned()
}
fn default_reward_file() -> String {
    "/logs/verifier/reward.txt".to_owned()
}
fn default_passing_reward() -> f64 {
    1.0
}
fn default_batch_size() -> u32 {
    10
}
fn default_workers() -> u32 {
    4
}
fn default_concurrency() -> u32 {
    4
}
fn default_samples_per_prompt() -> u32 {
    1
}
fn default_prompt_field() -> String {
    "prompt".to_owned()
}
fn default_request_timeout() -> u64 {
    600
}
fn default_max_attempts() -> u32 {
    6
}
fn default_load_bound() -> f64 {
    1.25
}
fn default_session_header() -> String {
    "x-session-id".to_owned()
}
fn default_max_turns() -> u32 {
    10
}
fn default_prompt_timeout() -> u64 {
    1800
}
fn default_command_timeout() -> u64 {
    180
}
fn default_max_output_bytes() -> u64 {
    50_000
}
fn default_mcp_call_timeout() -> u64 {
    60
}
fn default_mcp_connect_timeout() -> u64 {
    30
}
fn default_http_tool_timeout() -> u64 {
    30
}
fn default_tool_result_bytes() -> u64 {
    64 * 1024
}
fn default_results_pointer() -> String {
    "/results".to_owned()
}
fn default_title_pointer() -> String {
    "/title".to_owned()
}
fn default_url_pointer() -> String {
    "/url".to_owned()
}
fn default_snippet_pointer() -> String {
    "/content".to_owned()
}
fn default_web_search_timeout() -> u64 {
    10
}
fn default_web_max_results() -> u32 {
    5
}
fn default_web_extract_timeout() -> u64 {
    20
}
fn default_web_max_page_bytes() -> u64 {
    5 * 1024 * 1024
}
fn default_web_max_redirects() -> u32 {
    5
}
fn default_web_max_chars() -> u64 {
    5000
}
fn default_chromium_path() -> String {
    "/usr/bin/chromium".to_owned()
}
fn default_browser_launch_timeout() -> u64 {
    30
}
fn default_browser_navigation_timeout() -> u64 {
    30
}
fn default_snapshot_max_chars() -> u64 {
    8000
}
fn default_allowed_schemes() -> Vec<String> {
    vec!["http".to_owned(), "https".to_owned()]
}
fn default_vision_timeout() -> u64 {
    120
}
fn default_vision_max_tokens() -> u32 {
    2000
}
fn default_vision_max_image_bytes() -> u64 {
    20 * 1024 * 1024
}
fn default_vision_download_timeout() -> u64 {
    30
}
fn default_image_gen_timeout() -> u64 {
    180
}
fn default_image_gen_max_image_bytes() -> u64 {
    32 * 1024 * 1024
}
// gpt-image-1's sizes; `tools.imageGen.sizes` sets others (dall-e-3: 1792x1024, 1024x1792).
fn default_landscape_size() -> String {
    "1536x1024".to_owned()
}
fn default_square_size() -> String {
    "1024x1024".to_owned()
}
fn default_portrait_size() -> String {
    "1024x1536".to_owned()
}
fn default_per_batch() -> u32 {
    3
}
fn default_max_failed_batches() -> u32 {
    10
}

impl RunSpec {
    /// The output directory relative to the storage root.
    pub fn output_path(&self, namespace: &str, name: &str) -> String {
        self.storage
            .output_path
            .clone()
            .unwrap_or_else(|| format!("runs/{namespace}/{name}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_a_minimal_spec() {
        let spec: RunSpec = serde_json::from_value(serde_json::json!({
            "dataset": {"path": "data/p.jsonl"},
            "model": {"baseUrl": "http://127.0.0.1:1/v1", "name": "m"},
        }))
        .unwrap();
        assert_eq!(spec.batch_size, 10);
        assert_eq!(spec.dataset.prompt_field, "prompt");
        assert_eq!(spec.agent.max_turns, 10);
        assert_eq!(
            spec.distribution,
            DistributionSpec::Named("terminal_only".into())
        );
        assert_eq!(spec.output_path("research", "run"), "runs/research/run");
    }

    #[test]
    fn secrets_come_from_the_environment_named_after_their_secret() {
        let secret = SecretKeyRef {
            name: "team-api".into(),
            key: "token.v1".into(),
        };
        assert_eq!(secret.env_var(), "TRAJ_SECRET_TEAM_API__TOKEN_V1");
    }
}
