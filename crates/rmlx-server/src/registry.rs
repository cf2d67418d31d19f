//! Model ids and where they live: `--model` folders (id = folder name), `--models-dir` children
//! (id = relative path), and the Hugging Face hub cache (`models--org--name/snapshots/<rev>` as
//! `org/name`). Folders are rescanned on each lookup so fresh downloads appear without a restart;
//! a folder still holding `.partial` files is a download in progress and is not listed.
//! Reference: huggingface_hub `file_download.py` (cache layout, `refs/main`).

use std::{
    collections::HashMap,
    path::{Component, Path, PathBuf},
    sync::{Arc, Mutex},
    time::UNIX_EPOCH,
};

use rmlx_engine::{chat::ChatTokenizer, models::ModelInfo, sample::SamplingDefaults};

use crate::{error::ApiError, parse::ToolFormat, xml_calls::template_writes_xml};

/// Where a model was found; decides whether the server may delete it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A `--model` folder: the user pointed at it, the server never deletes it.
    Model,
    ModelsDir,
    HfCache,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Model => "model",
            Self::ModelsDir => "models_dir",
            Self::HfCache => "hf_cache",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelEntry {
    pub id: String,
    pub path: PathBuf,
    pub owned_by: String,
    /// Unix seconds of the folder's mtime (OpenAI's `created`).
    pub created: u64,
    pub source: Source,
}

pub struct Registry {
    explicit: Vec<ModelEntry>,
    models_dir: Option<PathBuf>,
    hf_hub: Option<PathBuf>,
    max_ctx: Option<usize>,
    tokenizers: Mutex<HashMap<PathBuf, Arc<ChatTokenizer>>>,
    /// How each model's template writes tool calls, read off the template once.
    tool_formats: Mutex<HashMap<PathBuf, ToolFormat>>,
    /// What the engine reported about a model once it loaded it, by canonical folder. Which
    /// models are resident is the engine's (LRU) business: `Engine::loaded` answers that.
    infos: Mutex<HashMap<PathBuf, ModelInfo>>,
}

impl Registry {
    pub fn new(
        models: &[PathBuf],
        models_dir: Option<PathBuf>,
        hf_cache: Option<PathBuf>,
        max_ctx: Option<usize>,
    ) -> Self {
        let explicit = models
            .iter()
            .map(|path| {
                let id = path
                    .canonicalize()
                    .unwrap_or_else(|_| path.clone())
                    .file_name()
                    .map_or_else(
                        || path.display().to_string(),
                        |n| n.to_string_lossy().into(),
                    );
                entry(id, path.clone(), "local", Source::Model)
            })
            .collect();
        Self {
            explicit,
            models_dir,
            hf_hub: hf_cache.or_else(default_hf_hub),
            max_ctx,
            tokenizers: Mutex::default(),
            tool_formats: Mutex::default(),
            infos: Mutex::default(),
        }
    }

    /// A `--model` folder whose name cannot be an id (`check_id`: a backslash in it), which no
    /// request could address; the server refuses to start with one.
    pub fn unaddressable(&self) -> Option<&str> {
        self.explicit
            .iter()
            .map(|entry| entry.id.as_str())
            .find(|id| check_id(id).is_err())
    }

    /// Every model we can serve, `--model` folders first; the first id wins on duplicates.
    pub fn list(&self) -> Vec<ModelEntry> {
        let mut all = self.explicit.clone();
        if let Some(dir) = &self.models_dir {
            all.extend(scan_models_dir(dir));
        }
        if let Some(hub) = &self.hf_hub {
            all.extend(scan_hf_hub(hub));
        }
        let mut seen = std::collections::HashSet::new();
        all.retain(|entry| seen.insert(entry.id.clone()));
        all
    }

    /// The model an id names, refusing ids that could reach outside the model folders (and any
    /// id not of that shape, `--model` ones included, as the OpenAPI document states it).
    pub fn resolve(&self, id: &str) -> Result<ModelEntry, ApiError> {
        check_id(id)?;
        if let Some(found) = self.explicit.iter().find(|entry| entry.id == id) {
            return Ok(found.clone());
        }
        if let Some(dir) = &self.models_dir {
            let path = dir.join(id);
            if is_model_dir(&path) && stays_inside(dir, &path) {
                let owned_by = id.split_once('/').map_or("local", |(org, _)| org);
                return Ok(entry(id.to_string(), path, owned_by, Source::ModelsDir));
            }
        }
        if let (Some(hub), Some((org, name))) = (&self.hf_hub, id.split_once('/')) {
            if !name.contains('/') {
                let repo = hub.join(format!("models--{org}--{name}"));
                if let Some(path) = hf_snapshot(&repo) {
                    if stays_inside(hub, &path) {
                        return Ok(entry(id.to_string(), path, org, Source::HfCache));
                    }
                }
            }
        }
        Err(ApiError::ModelNotFound(id.to_string()))
    }

    pub fn models_dir(&self) -> Option<&Path> {
        self.models_dir.as_deref()
    }

    /// The folder that deleting `entry` removes: the model's own folder in the models folder,
    /// or its whole repository folder (`models--org--name`: snapshots, blobs, refs) in the hub
    /// cache. `--model` folders are never deleted (a conflict with how the server was started,
    /// 409), and nothing outside the two roots is.
    pub fn deletable_folder(&self, entry: &ModelEntry) -> Result<PathBuf, ApiError> {
        let refuse = |why: &str| ApiError::BadRequest(format!("model `{}` {why}", entry.id));
        let (root, folder) = match entry.source {
            Source::Model => {
                return Err(ApiError::Conflict(format!(
                    "model `{}` was given with --model; rmlx serve does not delete folders it \
                     was pointed at (remove the folder yourself, or serve it from --models-dir)",
                    entry.id
                )))
            }
            Source::ModelsDir => (self.models_dir.as_ref(), entry.path.clone()),
            Source::HfCache => {
                let (org, name) = entry
                    .id
                    .split_once('/')
                    .ok_or_else(|| refuse("has no org"))?;
                let hub = self.hf_hub.as_ref();
                (
                    hub,
                    hub.map(|hub| hub.join(format!("models--{org}--{name}")))
                        .unwrap_or_default(),
                )
            }
        };
        let root = root.ok_or_else(|| refuse("has no models folder"))?;
        check_id(&entry.id)?;
        let (Ok(root), Ok(canonical_folder)) = (root.canonicalize(), folder.canonicalize()) else {
            return Err(ApiError::ModelNotFound(entry.id.clone()));
        };
        if canonical_folder == root || !canonical_folder.starts_with(&root) {
            return Err(refuse("lies outside the models folders"));
        }
        Ok(folder)
    }

    /// The model's tokenizer + template, loaded once (count_tokens, prompt inspection).
    pub fn tokenizer(&self, path: &Path) -> Result<Arc<ChatTokenizer>, ApiError> {
        if let Some(found) = self.tokenizers.lock().unwrap().get(path) {
            return Ok(found.clone());
        }
        let loaded =
            Arc::new(ChatTokenizer::from_dir(path).map_err(|error| {
                ApiError::Internal(format!("cannot load the tokenizer: {error}"))
            })?);
        self.tokenizers
            .lock()
            .unwrap()
            .insert(path.to_path_buf(), loaded.clone());
        Ok(loaded)
    }

    /// The sampling the model recommends (its `generation_config.json`), for requests that do
    /// not choose; none when its tokenizer cannot load (the request fails on that later).
    pub fn sampling_defaults(&self, path: &Path) -> SamplingDefaults {
        self.tokenizer(path)
            .map(|tokenizer| tokenizer.sampling_defaults())
            .unwrap_or_default()
    }

    /// How the model's chat template writes tool calls (`xml_calls::template_writes_xml`: the
    /// format is the template's, so a model of any architecture with such a template gets it).
    pub fn tool_format(&self, path: &Path) -> Result<ToolFormat, ApiError> {
        if let Some(found) = self.tool_formats.lock().unwrap().get(path) {
            return Ok(*found);
        }
        let format = if template_writes_xml(&*self.tokenizer(path)?) {
            ToolFormat::Xml
        } else {
            ToolFormat::Json
        };
        self.tool_formats
            .lock()
            .unwrap()
            .insert(path.to_path_buf(), format);
        Ok(format)
    }

    /// Context a request gets: the model's own, capped by `--max-ctx`.
    pub fn context_length(&self, entry: &ModelEntry) -> Option<usize> {
        let from_config = self
            .infos
            .lock()
            .unwrap()
            .get(&canonical(&entry.path))
            .map(|info| info.context_length)
            .or_else(|| config_context(&entry.path));
        match (from_config, self.max_ctx) {
            (Some(model), Some(cap)) => Some(model.min(cap)),
            (model, cap) => model.or(cap),
        }
    }

    pub fn info(&self, entry: &ModelEntry) -> Option<ModelInfo> {
        self.infos
            .lock()
            .unwrap()
            .get(&canonical(&entry.path))
            .cloned()
    }

    /// Keeps what the engine said about a model it loaded (context, vision) for listings.
    pub fn remember(&self, info: &ModelInfo) {
        self.infos
            .lock()
            .unwrap()
            .insert(canonical(&info.path), info.clone());
    }
}

/// The key the engine files models under (it canonicalizes too), so ids and residency match.
pub fn canonical(path: &Path) -> PathBuf {
    path.canonicalize().unwrap_or_else(|_| path.to_path_buf())
}

fn entry(id: String, path: PathBuf, owned_by: &str, source: Source) -> ModelEntry {
    let created = std::fs::metadata(&path)
        .and_then(|meta| meta.modified())
        .ok()
        .and_then(|time| time.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |age| age.as_secs());
    ModelEntry {
        id,
        path,
        owned_by: owned_by.to_string(),
        created,
        source,
    }
}

/// Relative, `/`-separated, no `.`/`..`, no backslashes or drive prefixes
/// (`constraints::MODEL_ID_PATTERN` states the same in the OpenAPI document).
pub(crate) fn check_id(id: &str) -> Result<(), ApiError> {
    let bad = id.is_empty()
        || id.contains('\\')
        || id.contains('\0')
        || Path::new(id)
            .components()
            .any(|part| !matches!(part, Component::Normal(_)))
        || id
            .split('/')
            .any(|part| part.is_empty() || part == "." || part == "..");
    if bad {
        return Err(ApiError::BadRequest(format!(
            "invalid model id `{id}`: ids are relative names like `qwen3` or `org/name`"
        )));
    }
    Ok(())
}

/// Symlinks inside a models folder may not lead out of it.
fn stays_inside(root: &Path, path: &Path) -> bool {
    match (root.canonicalize(), path.canonicalize()) {
        (Ok(root), Ok(path)) => path.starts_with(root),
        _ => false,
    }
}

/// A folder with config.json and no download in progress (`*.partial` files).
fn is_model_dir(path: &Path) -> bool {
    path.join("config.json").is_file() && !has_partials(path)
}

fn has_partials(path: &Path) -> bool {
    std::fs::read_dir(path).is_ok_and(|entries| {
        entries.filter_map(Result::ok).any(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .ends_with(rmlx_hub::PARTIAL_SUFFIX)
        })
    })
}

fn default_hf_hub() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("HF_HUB_CACHE") {
        return Some(PathBuf::from(home));
    }
    if let Some(home) = std::env::var_os("HF_HOME") {
        return Some(PathBuf::from(home).join("hub"));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/huggingface/hub"))
}

/// Direct children with config.json as `name`, and one level deeper as `org/name`.
fn scan_models_dir(dir: &Path) -> Vec<ModelEntry> {
    let mut found = Vec::new();
    // Symlinked folders are followed only while they stay inside (as `resolve` requires).
    let inside = |path: &PathBuf| stays_inside(dir, path);
    for child in sorted_children(dir).into_iter().filter(inside) {
        let name = child
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        if is_model_dir(&child) {
            found.push(entry(name, child, "local", Source::ModelsDir));
        } else {
            for grandchild in sorted_children(&child).into_iter().filter(inside) {
                if is_model_dir(&grandchild) {
                    let leaf = grandchild.file_name().unwrap_or_default().to_string_lossy();
                    let id = format!("{name}/{leaf}");
                    found.push(entry(id, grandchild, &name, Source::ModelsDir));
                }
            }
        }
    }
    found
}

fn scan_hf_hub(hub: &Path) -> Vec<ModelEntry> {
    let mut found = Vec::new();
    for repo in sorted_children(hub) {
        let folder = repo
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let Some(rest) = folder.strip_prefix("models--") else {
            continue;
        };
        let Some((org, name)) = rest.split_once("--") else {
            continue;
        };
        if let Some(path) = hf_snapshot(&repo) {
            found.push(entry(format!("{org}/{name}"), path, org, Source::HfCache));
        }
    }
    found
}

/// The snapshot `refs/main` points at, else the newest snapshot holding a config.json.
fn hf_snapshot(repo: &Path) -> Option<PathBuf> {
    let snapshots = repo.join("snapshots");
    if let Ok(main) = std::fs::read_to_string(repo.join("refs/main")) {
        let path = snapshots.join(main.trim());
        if is_model_dir(&path) {
            return Some(path);
        }
    }
    sorted_children(&snapshots)
        .into_iter()
        .filter(|path| is_model_dir(path))
        .max_by_key(|path| std::fs::metadata(path).and_then(|m| m.modified()).ok())
}

fn sorted_children(dir: &Path) -> Vec<PathBuf> {
    let mut children: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .filter(|path| path.is_dir())
                .collect()
        })
        .unwrap_or_default();
    children.sort();
    children
}

/// A model's config.json, read without loading weights (listings, fits hints).
pub fn read_config(dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// `max_position_embeddings` from config.json (or its `text_config`), without loading weights.
fn config_context(dir: &Path) -> Option<usize> {
    let config = read_config(dir)?;
    let read = |value: &serde_json::Value| value.get("max_position_embeddings")?.as_u64();
    read(&config)
        .or_else(|| read(config.get("text_config")?))
        .map(|n| n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rmlx-registry-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn model_at(path: &Path) {
        std::fs::create_dir_all(path).unwrap();
        std::fs::write(
            path.join("config.json"),
            r#"{"max_position_embeddings": 4096}"#,
        )
        .unwrap();
    }

    #[test]
    fn finds_models_dir_and_hf_cache_ids() {
        let root = temp("ids");
        model_at(&root.join("models/plain"));
        model_at(&root.join("models/org/nested"));
        model_at(&root.join("hub/models--Qwen--Qwen3-0.6B/snapshots/abc"));
        std::fs::create_dir_all(root.join("hub/models--Qwen--Qwen3-0.6B/refs")).unwrap();
        std::fs::write(root.join("hub/models--Qwen--Qwen3-0.6B/refs/main"), "abc").unwrap();
        let registry = Registry::new(
            &[],
            Some(root.join("models")),
            Some(root.join("hub")),
            Some(1024),
        );
        let ids: Vec<String> = registry.list().into_iter().map(|e| e.id).collect();
        assert_eq!(ids, ["org/nested", "plain", "Qwen/Qwen3-0.6B"]);
        let hf = registry.resolve("Qwen/Qwen3-0.6B").unwrap();
        assert!(hf.path.ends_with("snapshots/abc"));
        assert_eq!(hf.owned_by, "Qwen");
        assert_eq!(registry.context_length(&hf), Some(1024));
        assert!(registry.resolve("org/nested").is_ok());
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn ids_cannot_escape() {
        let root = temp("escape");
        model_at(&root.join("outside"));
        std::fs::create_dir_all(root.join("models")).unwrap();
        let registry = Registry::new(&[], Some(root.join("models")), Some(root.join("hub")), None);
        for id in ["../outside", "/etc", "a/../../outside", "", "./x", "a\\b"] {
            assert!(
                matches!(registry.resolve(id), Err(ApiError::BadRequest(_))),
                "{id}"
            );
        }
        assert!(matches!(
            registry.resolve("nope"),
            Err(ApiError::ModelNotFound(_))
        ));
        let _ = std::fs::remove_dir_all(root);
    }
}
