//! Chosen tensors of a repository's safetensors files, fetched by byte ranges (each file's
//! header, then each chosen tensor's data) instead of whole files: `rmlx pull --mtp` takes a
//! release's draft head (`mtp.*`, a few per cent of its bytes) without the rest.
//! Reference: the safetensors format (an 8-byte little-endian header length, a JSON header of
//! `{name: {dtype, shape, data_offsets}}`, then the data); huggingface_hub's
//! `get_safetensors_metadata` reads headers with the same ranges.

use std::{collections::BTreeMap, ops::Range};

use reqwest::{header, StatusCode};

use crate::{
    api::check_status,
    error::{describe, HubError, Result},
    HubClient, RepoId,
};

/// One tensor as stored: its safetensors dtype name (`BF16`, `F32`, ...), shape and bytes.
#[derive(Debug, Clone)]
pub struct RemoteTensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// Headers past this are not a model's (a hostile or broken file): refused before reading.
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// The tensors of `repo` at `revision` whose names `choose` accepts, from the files the index
/// places them in (or every `*.safetensors` file without an index). Returns them by name, and
/// the bytes read over the network.
pub async fn fetch_tensors(
    client: &HubClient,
    repo: &RepoId,
    revision: &str,
    choose: impl Fn(&str) -> bool,
) -> Result<(Vec<RemoteTensor>, u64)> {
    let listing = client.list_files(repo, revision).await?;
    let at = listing.commit.as_deref().unwrap_or(revision).to_string();
    let mut read = 0u64;
    let index = "model.safetensors.index.json";
    let files: Vec<String> = match listing.files.iter().find(|file| file.name == index) {
        Some(file) => {
            let bytes = fetch(client, repo, &at, index, 0..file.size).await?;
            read += bytes.len() as u64;
            let bad = |reason: String| HubError::BadListing {
                url: client.file_url(repo, &at, index).to_string(),
                reason,
            };
            let parsed: serde_json::Value = serde_json::from_slice(&bytes)
                .map_err(|error| bad(format!("not JSON: {error}")))?;
            let map = parsed["weight_map"]
                .as_object()
                .ok_or_else(|| bad("no weight_map".into()))?;
            let mut files: Vec<String> = map
                .iter()
                .filter(|(name, _)| choose(name))
                .filter_map(|(_, file)| file.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            files
        }
        None => listing
            .files
            .iter()
            .filter(|file| file.name.ends_with(".safetensors"))
            .map(|file| file.name.clone())
            .collect(),
    };
    let mut tensors = Vec::new();
    for file in files {
        crate::check_file_name(&file)?;
        let url = client.file_url(repo, &at, &file).to_string();
        let bad = |reason: String| HubError::BadListing {
            url: url.clone(),
            reason,
        };
        let length = fetch(client, repo, &at, &file, 0..8).await?;
        let header_len = u64::from_le_bytes(length.try_into().map_err(|_| bad("short".into()))?);
        if header_len > MAX_HEADER_BYTES {
            return Err(bad(format!("a safetensors header of {header_len} bytes")));
        }
        let header = fetch(client, repo, &at, &file, 8..8 + header_len).await?;
        read += 8 + header_len;
        let header: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&header)
            .map_err(|error| bad(format!("safetensors header: {error}")))?;
        let data_start = 8 + header_len;
        for (name, entry) in header.iter().filter(|(name, _)| *name != "__metadata__") {
            if !choose(name) {
                continue;
            }
            let field = |key: &str| entry.get(key).cloned().unwrap_or_default();
            let dtype = field("dtype").as_str().unwrap_or_default().to_string();
            let shape: Vec<u64> = serde_json::from_value(field("shape"))
                .map_err(|error| bad(format!("{name}: shape: {error}")))?;
            let offsets: [u64; 2] = serde_json::from_value(field("data_offsets"))
                .map_err(|error| bad(format!("{name}: data_offsets: {error}")))?;
            if offsets[1] < offsets[0] {
                return Err(bad(format!("{name}: data_offsets {offsets:?}")));
            }
            let range = data_start + offsets[0]..data_start + offsets[1];
            let data = fetch(client, repo, &at, &file, range).await?;
            read += data.len() as u64;
            tensors.push(RemoteTensor {
                name: name.clone(),
                dtype,
                shape,
                data,
            });
        }
    }
    Ok((tensors, read))
}

/// Bytes `range` of a file: a 206 answer of exactly that length (a server that ignores ranges
/// is refused rather than followed through a whole shard).
async fn fetch(
    client: &HubClient,
    repo: &RepoId,
    revision: &str,
    file: &str,
    range: Range<u64>,
) -> Result<Vec<u8>> {
    let url = client.file_url(repo, revision, file);
    let url_text = url.to_string();
    if range.is_empty() {
        return Ok(Vec::new());
    }
    let response = client
        .get(url)
        .header(
            header::RANGE,
            format!("bytes={}-{}", range.start, range.end - 1),
        )
        .send()
        .await
        .map_err(|error| HubError::Connection {
            url: url_text.clone(),
            reason: describe(error),
        })?;
    check_status(&response, repo, revision, Some(file))?;
    if response.status() != StatusCode::PARTIAL_CONTENT {
        return Err(HubError::BadListing {
            url: url_text,
            reason: format!(
                "asked for bytes {}..{}, got HTTP {} (the server does not serve ranges)",
                range.start,
                range.end,
                response.status().as_u16()
            ),
        });
    }
    let bytes = response
        .bytes()
        .await
        .map_err(|error| HubError::Connection {
            url: url_text.clone(),
            reason: describe(error),
        })?;
    if bytes.len() as u64 != range.end - range.start {
        return Err(HubError::SizeMismatch {
            file: file.to_string(),
            expected: range.end - range.start,
            actual: bytes.len() as u64,
        });
    }
    Ok(bytes.to_vec())
}
