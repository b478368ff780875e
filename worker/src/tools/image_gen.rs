//! The `image_gen` toolset: `image_generate`, which asks the `OpenAI` Images-compatible endpoint of
//! `spec.tools.imageGen` (`POST <baseUrl>/images/generations`) for one image, saves it into the
//! conversation's workspace as `generated_images/image_<n>.<ext>` and answers with that path.
//!
//! Name, argument schema and description are hermes-agent's (`tools/image_generation_tool.py`,
//! the version the other toolsets follow), and so is the result shape, `{"success": true,
//! "image": ...}` as two-space-indented JSON; `image` is the saved file's path (relative to the
//! workspace, where the file and terminal tools find it) rather than a hosted URL, and when the
//! endpoint answered with a URL the result adds it as `url`. Both answer kinds are accepted:
//! `b64_json` (decoded) and `url` (downloaded with the time and size limits). The saved bytes must
//! be an image by their signature. Every failure is a tool error; the conversation goes on.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Map, Value, json};

use super::args::optional_string_arg;
use super::endpoint::{self, Endpoint, EndpointError};
use super::vision::image::{ImageKind, checked_kind, download};
use super::web::reference_json;
use super::{
    ResumeRule, Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec, Workspace, WorkspaceError,
};
use crate::spec::{ImageGenSpec, ImageResponseFormat, ToolsSpec};
use trajectory_sandbox::files::confine;

pub const TOOLSET: &str = "image_gen";

/// The setting the endpoint comes from, as errors name it.
const FIELD: &str = "tools.imageGen";

/// The workspace directory generated images are saved in.
pub const IMAGE_DIR: &str = "generated_images";

/// Names tried in [`IMAGE_DIR`] before giving up (a conversation makes a handful).
const MAX_NAMES: u32 = 10_000;

/// The reference's aspect ratios; an unknown one falls back to the first, as the reference does.
const ASPECT_RATIOS: [&str; 3] = ["landscape", "square", "portrait"];

/// The toolset's tools; unavailable (saying why) when `spec.tools.imageGen` is missing or its
/// key variable is not set.
pub fn tools(config: &ToolsSpec) -> Result<Vec<Arc<dyn Tool>>, EndpointError> {
    let spec = config
        .image_gen
        .as_ref()
        .ok_or(EndpointError::NotConfigured { field: FIELD })?;
    let timeout = Duration::from_secs(spec.timeout_seconds.max(1));
    let max_image_bytes = usize::try_from(spec.max_image_bytes).unwrap_or(usize::MAX);
    // Base64 is 4/3 of the bytes; the rest of an answer is small.
    let max_answer_bytes = max_image_bytes
        .saturating_div(3)
        .saturating_mul(4)
        .saturating_add(1024 * 1024);
    let endpoint = Endpoint::new(
        FIELD,
        &spec.base_url,
        "images/generations",
        spec.api_key.as_ref(),
        timeout,
        max_answer_bytes,
    )?;
    // The URL comes from the configured endpoint, not from the model, so it is not held to the
    // public-address guard (an in-cluster image server answers with its own address).
    let download = endpoint::client(timeout)
        .build()
        .map_err(|source| EndpointError::Client {
            field: FIELD,
            source,
        })?;
    Ok(vec![Arc::new(ImageGenerate {
        spec: ToolSpec {
            name: "image_generate".to_owned(),
            description: "Generate high-quality images from text prompts using FLUX 2 Pro model with automatic 2x upscaling. Creates detailed, artistic images that are automatically upscaled for hi-rez results. Returns a single upscaled image URL. Display it using markdown: ![description](URL)".to_owned(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "prompt": {
                        "type": "string",
                        "description": "The text prompt describing the desired image. Be detailed and descriptive.",
                    },
                    "aspect_ratio": {
                        "type": "string",
                        "enum": ASPECT_RATIOS,
                        "description": "The aspect ratio of the generated image. 'landscape' is 16:9 wide, 'portrait' is 16:9 tall, 'square' is 1:1.",
                        "default": "landscape",
                    },
                },
                "required": ["prompt"],
            }),
        },
        settings: spec.clone(),
        endpoint,
        download,
        max_image_bytes,
    })])
}

#[derive(Debug)]
struct ImageGenerate {
    spec: ToolSpec,
    settings: ImageGenSpec,
    endpoint: Endpoint,
    download: reqwest::Client,
    max_image_bytes: usize,
}

/// A generated image, before it is saved.
struct Generated {
    kind: ImageKind,
    bytes: Vec<u8>,
    url: Option<String>,
}

impl ImageGenerate {
    /// The request body: the model, the prompt, one image of the ratio's size, the configured
    /// response format, then `extraBody` (whose keys win).
    fn body(&self, prompt: &str, ratio: &str) -> Vec<u8> {
        let sizes = &self.settings.sizes;
        let size = match ratio {
            "square" => &sizes.square,
            "portrait" => &sizes.portrait,
            _ => &sizes.landscape,
        };
        let mut body = Map::new();
        body.insert("model".into(), self.settings.model.clone().into());
        body.insert("prompt".into(), prompt.into());
        body.insert("n".into(), 1.into());
        body.insert("size".into(), size.clone().into());
        if let Some(format) = self.settings.response_format {
            let format = match format {
                ImageResponseFormat::B64Json => "b64_json",
                ImageResponseFormat::Url => "url",
            };
            body.insert("response_format".into(), format.into());
        }
        if let Some(Value::Object(extra)) = &self.settings.extra_body {
            body.extend(extra.clone());
        }
        // Serialising a `Value` cannot fail: its keys are strings.
        serde_json::to_vec(&body).expect("a JSON value serialises")
    }

    async fn generate(&self, prompt: &str, ratio: &str) -> Result<Generated, String> {
        let answer = self.endpoint.post_json(self.body(prompt, ratio)).await?;
        let first = answer.pointer("/data/0").ok_or_else(|| {
            let shown: String = answer.to_string().chars().take(200).collect();
            format!("the image endpoint's answer holds no image (no data[0]): {shown}")
        })?;
        if let Some(encoded) = first.get("b64_json").and_then(Value::as_str) {
            let bytes = self.decode(encoded)?;
            let kind = checked_kind(&bytes, "the generated image", None)?;
            return Ok(Generated {
                kind,
                bytes,
                url: None,
            });
        }
        if let Some(url) = first.get("url").and_then(Value::as_str) {
            let (kind, bytes) = self.fetch(url).await?;
            return Ok(Generated {
                kind,
                bytes,
                url: Some(url.to_owned()),
            });
        }
        Err("the image endpoint's answer holds neither data[0].b64_json nor data[0].url".to_owned())
    }

    fn decode(&self, encoded: &str) -> Result<Vec<u8>, String> {
        // Some servers send a data URL, some wrap the base64 in lines.
        let encoded = encoded
            .split_once(";base64,")
            .map_or(encoded, |(_, data)| data);
        let compact: String;
        let encoded = if encoded.bytes().any(|b| b.is_ascii_whitespace()) {
            compact = encoded.split_ascii_whitespace().collect();
            compact.as_str()
        } else {
            encoded
        };
        if encoded.len() / 4 * 3 > self.max_image_bytes.saturating_add(3) {
            return Err(self.too_large());
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|err| format!("data[0].b64_json is not base64 ({err})"))?;
        if bytes.len() > self.max_image_bytes {
            return Err(self.too_large());
        }
        Ok(bytes)
    }

    async fn fetch(&self, url: &str) -> Result<(ImageKind, Vec<u8>), String> {
        let image = download(self.download.get(url), url, self.max_image_bytes)
            .await?
            .ok_or_else(|| self.too_large())?;
        Ok((image.kind, image.bytes))
    }

    fn too_large(&self) -> String {
        format!(
            "the generated image is larger than {} bytes, the limit of tools.imageGen.maxImageBytes",
            self.max_image_bytes
        )
    }

    async fn run(&self, args: &Map<String, Value>, ctx: &ToolContext) -> Result<Value, String> {
        let prompt = match args.get("prompt") {
            Some(Value::String(prompt)) if !prompt.trim().is_empty() => prompt.trim(),
            _ => return Err("prompt is required for image generation".to_owned()),
        };
        let ratio = optional_string_arg(args, "aspect_ratio")?
            .map(|ratio| ratio.trim().to_ascii_lowercase())
            .filter(|ratio| ASPECT_RATIOS.contains(&ratio.as_str()))
            .unwrap_or_else(|| ASPECT_RATIOS[0].to_owned());
        let generated = self.generate(prompt, &ratio).await?;
        let workspace = ctx.workspace.clone();
        let Generated { kind, bytes, url } = generated;
        let path = tokio::task::spawn_blocking(move || save(&workspace, kind, &bytes))
            .await
            .map_err(|err| format!("saving the image failed internally: {err}"))??;
        let mut result = json!({"success": true, "image": path});
        if let Some(url) = url {
            result["url"] = url.into();
        }
        Ok(result)
    }
}

impl Tool for ImageGenerate {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    /// The image is generated again (another image, under the same name the model saw).
    fn on_resume(&self) -> ResumeRule {
        ResumeRule::RerunKeepGoing
    }

    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            match self.run(&args, ctx).await {
                Ok(value) => ToolOutcome::Ok(Value::String(reference_json(&value))),
                Err(message) => ToolOutcome::Err(format!("Error generating image: {message}")),
            }
        })
    }
}

/// Saves `bytes` as the first free `generated_images/image_<n>.<ext>` of the workspace (created
/// exclusively, so two calls of one turn never share a name, and never through a symlink) and
/// returns its path relative to the workspace.
fn save(workspace: &Workspace, kind: ImageKind, bytes: &[u8]) -> Result<String, String> {
    for n in 1..=MAX_NAMES {
        let requested = format!("{IMAGE_DIR}/image_{n}.{}", kind.extension());
        // A name taken by anything, a symlink too (which `prepare_file` would refuse), is skipped.
        if std::fs::symlink_metadata(workspace.root().join(&requested)).is_ok() {
            continue;
        }
        let path = confine::prepare_file(workspace, &requested)?;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        match confine::open_nofollow(&path, &mut options) {
            Ok(mut file) => {
                if !confine::opened_inside(&file, workspace) {
                    return Err(WorkspaceError::Escapes(requested).to_string());
                }
                file.write_all(bytes)
                    .map_err(|err| format!("cannot write {requested}: {err}"))?;
                return Ok(workspace.display(&path));
            }
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(confine::io_message(&err, &requested)),
        }
    }
    Err(format!("{IMAGE_DIR} already holds {MAX_NAMES} images"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";

    #[test]
    fn images_are_saved_under_fresh_names_and_never_through_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let workspace = Workspace::new(dir.path()).unwrap();
        assert_eq!(
            save(&workspace, ImageKind::Png, PNG).unwrap(),
            "generated_images/image_1.png"
        );
        // A name taken by a symlink (made by the model's terminal, say) is skipped, not followed.
        std::os::unix::fs::symlink(
            outside.path().join("x.png"),
            dir.path().join("generated_images/image_2.png"),
        )
        .unwrap();
        assert_eq!(
            save(&workspace, ImageKind::Png, PNG).unwrap(),
            "generated_images/image_3.png"
        );
        assert!(!outside.path().join("x.png").exists());
        assert_eq!(
            std::fs::read(dir.path().join("generated_images/image_3.png")).unwrap(),
            PNG
        );
        // The directory itself replaced by a symlink out of the workspace.
        std::fs::rename(
            dir.path().join("generated_images"),
            dir.path().join("moved"),
        )
        .unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("generated_images")).unwrap();
        assert!(
            save(&workspace, ImageKind::Jpeg, b"\xff\xd8\xff")
                .unwrap_err()
                .contains("escapes the workspace")
        );
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    }
}
