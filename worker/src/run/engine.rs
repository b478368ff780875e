//! The engine: what a process needs to run conversations (the model client, the tools, the
//! distribution, the sandbox and the run's settings), built once from the spec and shared by all
//! the batches it runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::RunError;
use super::ledger::Ledger;
use crate::agent::AgentConfig;
use crate::distribution::Distribution;
use crate::model::limits::Limits;
use crate::model::{ApiKey, ModelClient, ModelSettings};
use crate::simulator::UserSimulator;
use crate::spec::{RunSpec, TokenRequest, VerifierSpec};
use crate::storage::StorageError;
use crate::tools::sandbox::{LandlockMode, Sandbox};
use crate::tools::{Registry, ToolLimits};
use crate::training::TokensContext;

/// What a process needs to run conversations, built once and shared by all batches.
#[derive(Debug, Clone)]
pub struct Engine {
    pub client: ModelClient,
    pub registry: Registry,
    pub distribution: Distribution,
    pub agent: AgentConfig,
    pub limits: ToolLimits,
    pub workspace_root: PathBuf,
    pub keep_workspaces: bool,
    /// How terminal commands are confined: by default this binary as the executor, Landlock
    /// where the kernel has it.
    pub sandbox: Sandbox,
    /// Set in a pod whose task containers run the rows' images: the directory of their sockets
    /// ([`crate::contract::paths::task_socket`]), one container a conversation of the batch.
    pub task_sockets: Option<PathBuf>,
    /// Set in such a pod: when its containers started, for what it waited for its image.
    pub pod_start: Option<super::pulls::PodStart>,
    /// Set in a pod of rows whose image could not be pulled: why. Each of its conversations is
    /// recorded failed (`image_unavailable`) without a model request.
    pub image_unavailable: Option<String>,
    /// Set in a pod of rows whose image could not be built: why. Each of its conversations is
    /// recorded failed (`image_build_failed`) without a model request.
    pub image_build_failed: Option<String>,
    /// The oracle pass (`spec.agent.oracle`): rows' solutions run instead of the model.
    pub oracle: Option<super::oracle::Oracle>,
    pub require_reasoning: bool,
    /// How rows' verifiers run, and the default one.
    pub verifier: VerifierSpec,
    /// Verified conversations below this reward are discarded (`below_reward`).
    pub min_reward: Option<f64>,
    /// A prompt's sampling stops once this many of its samples passed.
    pub passes_per_prompt: Option<u32>,
    pub openai_format: bool,
    /// What each trajectory's tokens line says of the run, when the run keeps tokens
    /// (`spec.model.tokens`; see [`crate::training`]).
    pub tokens: Option<TokensContext>,
    pub seed: u64,
    pub samples_per_prompt: u32,
    pub concurrency: usize,
    /// Time in-flight conversations get to finish after a shutdown request (zero: they stop at
    /// once, keeping their finished turns).
    pub grace: Duration,
    /// What the run spends, counted with its other processes when it has prices, and
    /// `spec.model.budget` when it has one: conversations start only while it has room.
    pub ledger: Option<Arc<Ledger>>,
    /// Whether finished turns are kept in the batch's turn log, so that a conversation an
    /// earlier attempt left unfinished is taken up from it (see `run::turns`).
    pub turns: TurnLogging,
    /// The simulated user of rows with a `user_scenario` (`spec.userSimulator`).
    pub simulator: Option<Arc<UserSimulator>>,
}

/// What becomes of a conversation's finished turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnLogging {
    /// Each is durable before the next model call; resumes take them up.
    Logged,
    /// Kept nowhere until the record (only to measure what the log costs).
    Off,
}

impl Engine {
    /// Builds the engine from a spec, finding the API key by the contract's rules.
    pub fn new(spec: &RunSpec, workspace_root: PathBuf) -> Result<Self, RunError> {
        let api_key =
            ApiKey::discover(spec.model.api_key_env.as_deref()).map_err(RunError::Spec)?;
        let settings = ModelSettings::from_spec(&spec.model, api_key)
            .map_err(|err| RunError::Spec(err.to_string()))?;
        Self::with_client(
            spec,
            workspace_root,
            ModelClient::new(settings).map_err(|err| RunError::Spec(err.to_string()))?,
        )
    }

    /// Asks the model's servers which chat template they apply, for the tokens lines'
    /// `tokenization` (a run whose ids llama.cpp's server gives or makes: others say nothing).
    pub async fn learn_chat_template(&mut self) {
        let Some(tokens) = self.tokens.as_mut().filter(|tokens| {
            matches!(
                tokens.request,
                TokenRequest::LlamaServer | TokenRequest::Retokenize
            )
        }) else {
            return;
        };
        tokens.chat_template_sha256 = self.client.chat_template_sha256().await;
        if tokens.chat_template_sha256.is_none() {
            tracing::warn!(
                "the model's servers did not name one chat template (GET /props): the tokens \
                 lines' tokenization has no chat_template_sha256"
            );
        }
    }

    /// Counts what the run spends in `ledger` (its client adds each completion's cost to it),
    /// and holds it to the ledger's budget: conversations start only while it has room.
    pub fn keep_ledger(&mut self, ledger: Arc<Ledger>) {
        self.client = self.client.with_spending(ledger.spending());
        self.ledger = Some(ledger);
    }

    /// Holds the model's requests to this process's share of `spec.model.limits` and of the
    /// limits the provider tells, as one of `processes` that may run the run's batches at once
    /// (its `workers` on a cluster; a local run is one).
    pub fn keep_limits(&mut self, spec: &RunSpec, processes: u64) {
        if let Some(limits) = Limits::share(spec.model.limits.as_ref(), processes) {
            self.client = self.client.with_limits(Arc::new(limits));
        }
    }

    /// Builds the engine around a given client.
    pub fn with_client(
        spec: &RunSpec,
        workspace_root: PathBuf,
        client: ModelClient,
    ) -> Result<Self, RunError> {
        crate::tools::http::check_values(&spec.tools).map_err(RunError::Spec)?;
        let registry =
            Registry::builtin_with(&spec.tools, Sandbox::for_sessions(&spec.sandbox).as_ref());
        let distribution = Distribution::resolve(&spec.distribution, &registry)
            .map_err(|err| RunError::Spec(err.to_string()))?;
        std::fs::create_dir_all(&workspace_root)
            .map_err(|err| StorageError::new("creating", &workspace_root, err))?;
        let settings = client.settings();
        let tokens = settings.tokens.as_ref().map(|tokens| {
            TokensContext::new(
                tokens.request,
                &settings.model,
                settings.temperature,
                settings.max_tokens,
                &settings.extra_body,
            )
        });
        Ok(Self {
            client,
            registry,
            distribution,
            agent: AgentConfig {
                max_turns: spec.agent.max_turns,
                prompt_timeout: Duration::from_secs(spec.agent.prompt_timeout_seconds),
                ephemeral_system_prompt: spec.agent.ephemeral_system_prompt.clone(),
            },
            limits: ToolLimits {
                command_timeout: Duration::from_secs(spec.tools.terminal.timeout_seconds),
                max_output_bytes: usize::try_from(spec.tools.terminal.max_output_bytes)
                    .unwrap_or(usize::MAX),
                ..ToolLimits::default()
            },
            workspace_root,
            keep_workspaces: spec.tools.keep_workspaces,
            sandbox: Sandbox::local(LandlockMode::Auto),
            task_sockets: None,
            pod_start: None,
            image_unavailable: None,
            image_build_failed: None,
            oracle: spec.agent.oracle.then(|| super::oracle::Oracle {
                timeout: Duration::from_secs(spec.agent.prompt_timeout_seconds),
            }),
            require_reasoning: spec.filters.require_reasoning,
            verifier: spec.verifier.clone().unwrap_or_default(),
            min_reward: spec.filters.min_reward,
            passes_per_prompt: spec
                .verifier
                .as_ref()
                .and_then(|verifier| verifier.passes_per_prompt),
            openai_format: spec.openai_format,
            tokens,
            seed: spec.seed,
            samples_per_prompt: spec.samples_per_prompt,
            concurrency: usize::try_from(spec.concurrency).unwrap_or(1),
            grace: Duration::from_secs(20),
            ledger: None,
            turns: TurnLogging::Logged,
            simulator: spec
                .user_simulator
                .as_ref()
                .map(|simulator| UserSimulator::from_spec(simulator).map(Arc::new))
                .transpose()
                .map_err(RunError::Spec)?,
        })
    }
}
