//! The image a vision call sends: read from an http(s) URL (through `web_extract`'s guard, with
//! time, size and redirect limits) or from a file of the conversation's workspace (confined as
//! the file tools are), recognised by its first bytes — never by a name or a declared type — and
//! written as a `data:` URL.

use std::io::Read;
use std::time::Duration;

use base64::Engine as _;
use reqwest::header::{ACCEPT, CONTENT_LENGTH, CONTENT_TYPE};
use url::Url;

use crate::spec::VisionSpec;
use crate::tools::web::{error_chain, guard, read_capped};
use crate::tools::{ToolContext, Workspace};
use trajectory_sandbox::files::confine;

/// The raster formats the `OpenAI` chat API (and the vision-language models vLLM serves)
/// accept in an `image_url` part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ImageKind {
    Png,
    Jpeg,
    Gif,
    Webp,
}

impl ImageKind {
    /// The format of `bytes` by its signature, or `None` for anything else.
    pub(crate) fn sniff(bytes: &[u8]) -> Option<Self> {
        if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
            Some(Self::Png)
        } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
            Some(Self::Jpeg)
        } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
            Some(Self::Gif)
        } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
            Some(Self::Webp)
        } else {
            None
        }
    }

    pub(crate) fn mime(self) -> &'static str {
        match self {
            Self::Png => "image/png",
            Self::Jpeg => "image/jpeg",
            Self::Gif => "image/gif",
            Self::Webp => "image/webp",
        }
    }

    pub(crate) fn extension(self) -> &'static str {
        match self {
            Self::Png => "png",
            Self::Jpeg => "jpg",
            Self::Gif => "gif",
            Self::Webp => "webp",
        }
    }
}

/// `data:<mime>;base64,<bytes>`.
pub(crate) fn data_url(kind: ImageKind, bytes: &[u8]) -> String {
    let prefix = format!("data:{};base64,", kind.mime());
    let mut url = String::with_capacity(prefix.len() + bytes.len().div_ceil(3) * 4);
    url.push_str(&prefix);
    base64::engine::general_purpose::STANDARD.encode_string(bytes, &mut url);
    url
}

/// The format of `bytes`, or an error saying what they are instead (`declared`: the type a
/// server declared, if any).
pub(crate) fn checked_kind(
    bytes: &[u8],
    source: &str,
    declared: Option<&str>,
) -> Result<ImageKind, String> {
    ImageKind::sniff(bytes).ok_or_else(|| {
        format!(
            "{source} is not a PNG, JPEG, GIF or WebP image: {}",
            describe(bytes, declared)
        )
    })
}

/// What non-image bytes look like, in a few words.
fn describe(bytes: &[u8], declared: Option<&str>) -> String {
    let head = String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).to_ascii_lowercase();
    let what = if bytes.is_empty() {
        "it is empty".to_owned()
    } else if head.contains("<svg") {
        "it is an SVG drawing (a vector image; convert it to PNG first)".to_owned()
    } else if head.contains("<html") || head.contains("<!doctype html") {
        "it is an HTML page".to_owned()
    } else if bytes.starts_with(b"%PDF-") {
        "it is a PDF document".to_owned()
    } else if bytes.starts_with(b"BM") {
        "it is a BMP image (convert it to PNG first)".to_owned()
    } else if std::str::from_utf8(&bytes[..bytes.len().min(512)]).is_ok() {
        "it is text".to_owned()
    } else {
        format!("its {} bytes have no image signature", bytes.len())
    };
    match declared {
        Some(declared) if !declared.is_empty() => format!("{what} (served as {declared})"),
        _ => what,
    }
}

/// An image, read and recognised.
#[derive(Debug)]
pub(crate) struct Image {
    pub kind: ImageKind,
    pub bytes: Vec<u8>,
}

/// Where images come from, with the limits of `spec.tools.vision`.
#[derive(Debug)]
pub(crate) struct ImageSource {
    client: reqwest::Client,
    max_bytes: usize,
    allow_private: bool,
}

impl ImageSource {
    pub(crate) fn new(spec: &VisionSpec) -> Result<Self, reqwest::Error> {
        let timeout = Duration::from_secs(spec.download_timeout_seconds.max(1));
        let client =
            guard::guarded_client(spec.max_redirects, spec.allow_private_addresses, timeout)
                .build()?;
        Ok(Self {
            client,
            max_bytes: usize::try_from(spec.max_image_bytes).unwrap_or(usize::MAX),
            allow_private: spec.allow_private_addresses,
        })
    }

    /// The image `source` names: an http(s) URL, or a path relative to the workspace.
    pub(crate) async fn load(&self, source: &str, ctx: &ToolContext) -> Result<Image, String> {
        let source = source.trim();
        if source.is_empty() {
            return Err("image_url is required".to_owned());
        }
        let lower = source.to_ascii_lowercase();
        if lower.starts_with("http://") || lower.starts_with("https://") {
            return self.fetch(source).await;
        }
        if let Some(scheme) = url_scheme(source) {
            return Err(format!(
                "{scheme}: URLs are not supported; give an http:// or https:// URL or a path \
                 relative to the workspace"
            ));
        }
        let workspace = ctx.workspace.clone();
        let requested = source.to_owned();
        let max_bytes = self.max_bytes;
        tokio::task::spawn_blocking(move || read_workspace_image(&workspace, &requested, max_bytes))
            .await
            .map_err(|err| format!("reading the image failed internally: {err}"))?
    }

    async fn fetch(&self, raw: &str) -> Result<Image, String> {
        let url = Url::parse(raw).map_err(|err| format!("not a URL ({err})"))?;
        if let Some(refusal) = guard::refusal(&url, self.allow_private) {
            return Err(refusal);
        }
        let request = self.client.get(url).header(ACCEPT, "image/*,*/*;q=0.8");
        download(request, raw, self.max_bytes)
            .await?
            .ok_or_else(|| too_large(raw, self.max_bytes))
    }
}

/// Sends `request` (for the image `shown`) and reads the image it answers with, at most
/// `max_bytes` of it (`None`: longer, by its declared length or by what came), recognised by its
/// signature.
pub(crate) async fn download(
    request: reqwest::RequestBuilder,
    shown: &str,
    max_bytes: usize,
) -> Result<Option<Image>, String> {
    let fail = |err: reqwest::Error| format!("cannot fetch {shown}: {}", error_chain(&err));
    let mut response = request.send().await.map_err(fail)?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("cannot fetch {shown}: HTTP {status}"));
    }
    let declared_length = response
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared_length.is_some_and(|length| length > max_bytes as u64) {
        return Ok(None);
    }
    let declared = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let (bytes, cut) = read_capped(&mut response, max_bytes).await.map_err(fail)?;
    if cut {
        return Ok(None);
    }
    let kind = checked_kind(&bytes, shown, declared.as_deref())?;
    Ok(Some(Image { kind, bytes }))
}

fn too_large(source: &str, max_bytes: usize) -> String {
    format!("{source} is larger than {max_bytes} bytes, the limit of tools.vision.maxImageBytes")
}

/// The scheme of `text` if it starts like a URL (`name:`, the name 2+ letters, digits, `+`, `-`
/// or `.` starting with a letter); a one-letter "scheme" would be a Windows drive.
fn url_scheme(text: &str) -> Option<&str> {
    let (scheme, _) = text.split_once(':')?;
    (scheme.len() >= 2
        && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)))
    .then_some(scheme)
}

/// Reads an image file of the workspace, confined as the file tools read (no absolute path, no
/// `..` out, no symlink out, a regular file), at most `max_bytes` of it.
fn read_workspace_image(
    workspace: &Workspace,
    requested: &str,
    max_bytes: usize,
) -> Result<Image, String> {
    let path = confine::resolve(workspace, requested)?;
    let file = confine::open_confined(
        workspace,
        &path,
        requested,
        std::fs::OpenOptions::new().read(true),
    )?;
    let mut bytes = Vec::new();
    file.take(max_bytes as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|err| confine::io_message(&err, requested))?;
    if bytes.len() > max_bytes {
        return Err(too_large(requested, max_bytes));
    }
    let kind = checked_kind(&bytes, requested, None)?;
    Ok(Image { kind, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_recognised_by_their_bytes_and_others_described() {
        assert_eq!(
            ImageKind::sniff(b"\x89PNG\r\n\x1a\n\0\0"),
            Some(ImageKind::Png)
        );
        assert_eq!(
            ImageKind::sniff(&[0xFF, 0xD8, 0xFF, 0xE0]),
            Some(ImageKind::Jpeg)
        );
        assert_eq!(ImageKind::sniff(b"GIF89a..."), Some(ImageKind::Gif));
        assert_eq!(
            ImageKind::sniff(b"RIFF\0\0\0\0WEBPVP8 "),
            Some(ImageKind::Webp)
        );
        assert_eq!(ImageKind::sniff(b"RIFF\0\0\0\0WAVE"), None);
        let refused = |bytes: &[u8]| checked_kind(bytes, "x", None).unwrap_err();
        assert!(refused(b"<svg xmlns=").contains("SVG"));
        assert!(refused(b"<!DOCTYPE html><html>").contains("HTML page"));
        assert!(refused(b"%PDF-1.7").contains("PDF"));
        assert!(refused(b"").contains("empty"));
        assert!(
            checked_kind(b"hello", "notes.txt", Some("text/plain"))
                .unwrap_err()
                .ends_with("it is text (served as text/plain)")
        );
    }

    #[test]
    fn a_data_url_holds_the_type_and_the_bytes() {
        assert_eq!(
            data_url(ImageKind::Png, b"abc"),
            "data:image/png;base64,YWJj"
        );
        assert_eq!(data_url(ImageKind::Jpeg, b""), "data:image/jpeg;base64,");
    }

    #[test]
    fn url_schemes_are_told_from_paths() {
        assert_eq!(url_scheme("file:///etc/passwd"), Some("file"));
        assert_eq!(url_scheme("data:image/png;base64,AAAA"), Some("data"));
        assert_eq!(url_scheme("images/cat.png"), None);
        assert_eq!(url_scheme("c:/x.png"), None);
        assert_eq!(url_scheme("./a:b.png"), None);
    }
}
