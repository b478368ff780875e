//! `task.toml`, as Harbor 0.25 reads it (`harbor/models/task/config.py`): every table and field
//! with Harbor's defaults, so that a task means here what it means there. Harbor ignores keys it
//! does not know; so does this, and names them ([`TaskConfig::parse`]).

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

/// A task's `task.toml`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct TaskConfig {
    pub schema_version: Option<String>,
    /// The legacy name of `schema_version`.
    pub version: Option<String>,
    /// `[task]`: the package's `name` (`org/name`), `description`, `authors`, `keywords`.
    pub task: Option<Value>,
    /// `[metadata]`: free-form (difficulty, category, tags, …).
    pub metadata: BTreeMap<String, Value>,
    pub verifier: VerifierConfig,
    pub agent: AgentConfig,
    pub environment: EnvironmentConfig,
    pub solution: SolutionConfig,
    pub source: Option<String>,
    pub multi_step_reward_strategy: Option<String>,
    /// Multi-step tasks: several instructions, each verified.
    pub steps: Option<Vec<Value>>,
    /// Files collected from the environment after a trial.
    pub artifacts: Vec<Value>,
}

/// `[verifier]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct VerifierConfig {
    pub timeout_sec: f64,
    pub env: BTreeMap<String, String>,
    pub user: Option<Value>,
    /// `shared` (the agent's container) or `separate` (a verifier environment of its own).
    pub environment_mode: Option<String>,
    pub environment: Option<Value>,
    pub collect: Vec<Value>,
    pub network_mode: Option<String>,
    pub allowed_hosts: Option<Vec<String>>,
}

impl Default for VerifierConfig {
    fn default() -> Self {
        Self {
            timeout_sec: 600.0,
            env: BTreeMap::new(),
            user: None,
            environment_mode: None,
            environment: None,
            collect: Vec::new(),
            network_mode: None,
            allowed_hosts: None,
        }
    }
}

/// `[agent]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct AgentConfig {
    /// No limit when unset.
    pub timeout_sec: Option<f64>,
    pub user: Option<Value>,
    pub network_mode: Option<String>,
    pub allowed_hosts: Option<Vec<String>>,
}

/// `[environment]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct EnvironmentConfig {
    pub build_timeout_sec: f64,
    /// A prebuilt image: it wins over `environment/Dockerfile`.
    pub docker_image: Option<String>,
    pub os: Option<String>,
    pub cpus: Option<f64>,
    pub memory_mb: Option<u64>,
    pub storage_mb: Option<u64>,
    /// The deprecated forms of `memory_mb` and `storage_mb` (`"2G"`, `"512M"`).
    pub memory: Option<Value>,
    pub storage: Option<Value>,
    pub gpus: Option<u64>,
    pub gpu_types: Option<Vec<String>>,
    pub tpu: Option<Value>,
    pub mcp_servers: Vec<Value>,
    pub env: BTreeMap<String, String>,
    pub skills_dir: Option<String>,
    /// Where the agent's commands start (else the image's `WORKDIR`).
    pub workdir: Option<String>,
    pub healthcheck: Option<Value>,
    /// `public` (the default), `no-network` or `allowlist`.
    pub network_mode: Option<String>,
    pub allowed_hosts: Option<Vec<String>>,
    /// The deprecated form of `network_mode` (`false`: `no-network`).
    pub allow_internet: Option<bool>,
}

impl Default for EnvironmentConfig {
    fn default() -> Self {
        Self {
            build_timeout_sec: 600.0,
            docker_image: None,
            os: None,
            cpus: None,
            memory_mb: None,
            storage_mb: None,
            memory: None,
            storage: None,
            gpus: None,
            gpu_types: None,
            tpu: None,
            mcp_servers: Vec::new(),
            env: BTreeMap::new(),
            skills_dir: None,
            workdir: None,
            healthcheck: None,
            network_mode: None,
            allowed_hosts: None,
            allow_internet: None,
        }
    }
}

/// `[solution]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SolutionConfig {
    pub env: BTreeMap<String, String>,
}

impl TaskConfig {
    /// The config in `text`, and the keys Harbor would ignore (`verifier.bogus`).
    pub fn parse(text: &str) -> Result<(Self, Vec<String>), String> {
        let value: toml::Value = toml::from_str(text).map_err(|err| err.to_string())?;
        let mut ignored = Vec::new();
        let config = serde_ignored::deserialize(value, |path| ignored.push(path.to_string()))
            .map_err(|err: toml::de::Error| err.to_string())?;
        Ok((config, ignored))
    }

    /// The package name of `[task]`, if any.
    pub fn name(&self) -> Option<&str> {
        self.task.as_ref()?.get("name")?.as_str()
    }

    /// Where the verifier runs, as Harbor decides it: `verifier.environment_mode`, else
    /// `separate` when the verifier has an environment of its own, else `shared`.
    pub fn verifier_mode(&self) -> &str {
        match (&self.verifier.environment_mode, &self.verifier.environment) {
            (Some(mode), _) => mode,
            (None, Some(_)) => "separate",
            (None, None) => "shared",
        }
    }

    /// The network the environment is given: `network_mode`, else the deprecated
    /// `allow_internet`, else `public`.
    pub fn network_mode(&self) -> &str {
        match (
            &self.environment.network_mode,
            self.environment.allow_internet,
        ) {
            (Some(mode), _) => mode,
            (None, Some(false)) => "no-network",
            _ => "public",
        }
    }

    /// The fields this task sets that a run cannot honour, each with why: the task is refused
    /// rather than run otherwise than Harbor would run it.
    pub fn unsupported(&self) -> Vec<String> {
        let mut unsupported = Vec::new();
        let mut refuse = |set: bool, field: &str, why: &str| {
            if set {
                unsupported.push(format!("{field}: {why}"));
            }
        };
        let environment = &self.environment;
        let verifier = &self.verifier;
        refuse(
            self.steps.as_ref().is_some_and(|steps| !steps.is_empty()),
            "steps",
            "multi-step tasks are not supported",
        );
        refuse(
            self.verifier_mode() == "separate",
            "verifier.environment",
            "a verifier environment of its own is not supported (the verifier runs where the agent ran)",
        );
        refuse(
            environment
                .cpus
                .is_some_and(|cpus| !(cpus.is_finite() && cpus > 0.0)),
            "environment.cpus",
            "must be a positive number (the task container's CPU limit)",
        );
        refuse(
            environment.memory_mb == Some(0) || environment.storage_mb == Some(0),
            "environment.memory_mb/storage_mb",
            "must be positive (the task container's limits)",
        );
        refuse(
            environment
                .os
                .as_deref()
                .is_some_and(|os| !os.eq_ignore_ascii_case("linux")),
            "environment.os",
            "only linux environments run",
        );
        refuse(
            environment.gpus.is_some_and(|gpus| gpus > 0)
                || environment.gpu_types.is_some()
                || environment.tpu.is_some(),
            "environment.gpus",
            "accelerators are not given to task containers",
        );
        refuse(
            !environment.mcp_servers.is_empty(),
            "environment.mcp_servers",
            "a task's MCP servers are not started",
        );
        refuse(
            environment.healthcheck.is_some(),
            "environment.healthcheck",
            "health checks are not run",
        );
        refuse(
            !environment.env.is_empty(),
            "environment.env",
            "environment variables of a task are not set",
        );
        refuse(
            !verifier.env.is_empty(),
            "verifier.env",
            "environment variables of a verifier are not set",
        );
        refuse(
            verifier.user.is_some() || self.agent.user.is_some(),
            "agent.user",
            "commands run as the image's user",
        );
        refuse(
            !verifier.collect.is_empty(),
            "verifier.collect",
            "collect commands are not run",
        );
        refuse(
            self.network_mode() != "public"
                || self.agent.network_mode.is_some()
                || verifier.network_mode.is_some(),
            "environment.network_mode",
            "only public networking is given (the run's NetworkPolicy bounds it)",
        );
        unsupported
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn harbors_defaults_hold_and_ignored_keys_are_named() {
        let (config, ignored) = TaskConfig::parse(
            r#"
version = "1.0"
bogus = 1
[task]
name = "org/hello"
[metadata]
difficulty = "easy"
tags = ["a"]
[verifier]
timeout_sec = 120.0
typo = 2
[environment]
docker_image = "python:3.12"
cpus = 2
memory_mb = 4096
"#,
        )
        .unwrap();
        assert_eq!(ignored, ["bogus", "verifier.typo"]);
        assert_eq!(config.name(), Some("org/hello"));
        assert_eq!(config.version.as_deref(), Some("1.0"));
        let seconds = |value: f64| value.to_string();
        assert_eq!(seconds(config.verifier.timeout_sec), "120");
        assert_eq!(config.agent.timeout_sec, None);
        assert_eq!(seconds(config.environment.build_timeout_sec), "600");
        assert_eq!(config.environment.cpus, Some(2.0));
        assert_eq!(config.metadata["tags"], serde_json::json!(["a"]));
        assert_eq!(config.network_mode(), "public");
        assert!(config.unsupported().is_empty());

        let (defaults, _) = TaskConfig::parse("").unwrap();
        assert_eq!(seconds(defaults.verifier.timeout_sec), "600");
        assert!(TaskConfig::parse("[verifier]\ntimeout_sec = \"long\"").is_err());
    }

    #[test]
    fn what_would_run_otherwise_is_named() {
        let (config, _) = TaskConfig::parse(
            r#"
[environment]
allow_internet = false
gpus = 1
env = {A = "1"}
[verifier]
environment_mode = "separate"
"#,
        )
        .unwrap();
        let unsupported = config.unsupported();
        assert_eq!(
            unsupported
                .iter()
                .map(|why| why.split(':').next().unwrap())
                .collect::<Vec<_>>(),
            [
                "verifier.environment",
                "environment.gpus",
                "environment.env",
                "environment.network_mode"
            ],
            "{unsupported:?}"
        );
    }

    #[test]
    fn resources_that_cannot_be_limits_are_named() {
        for (environment, field) in [
            ("cpus = 0", "environment.cpus"),
            ("cpus = nan", "environment.cpus"),
            ("cpus = -1.5", "environment.cpus"),
            ("memory_mb = 0", "environment.memory_mb/storage_mb"),
        ] {
            let text = format!("[environment]\n{environment}\n");
            let (config, _) = TaskConfig::parse(&text).unwrap();
            let unsupported = config.unsupported();
            assert!(
                unsupported.iter().any(|why| why.starts_with(field)),
                "{environment}: {unsupported:?}"
            );
        }
        let (config, _) =
            TaskConfig::parse("[environment]\ncpus = 0.5\nmemory_mb = 512\n").unwrap();
        assert!(config.unsupported().is_empty());
    }
}
