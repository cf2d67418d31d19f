//! Strict safetensors loading: every file's header is checked against its size before MLX maps
//! it, each tensor remembers its file, layers take what they need with shape and dtype checks,
//! and anything left over is an error. Reference: mlx-swift-lm `Load.swift`, mlx-lm `utils.py`
//! (`load_model`: `model*.safetensors`, the index's `weight_map`).

use std::{
    collections::{BTreeMap, HashMap},
    fs,
    io::Read,
    path::{Path, PathBuf},
};

use mlx_rs::{Array, Dtype};

use crate::error::{EngineError, Result};

/// Header entry of one tensor in a safetensors file.
#[derive(serde::Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: [u64; 2],
}

/// The bytes a safetensors dtype takes per element (for the size check).
fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" | "C64" => 8,
        _ => return None,
    })
}

/// Reads and checks a safetensors header without touching tensor data: a truncated file, bad
/// offsets or an unknown dtype name the file and the tensor.
pub(crate) fn check_header(file: &Path) -> Result<Vec<String>> {
    let io_error = |error: std::io::Error| EngineError::WeightsFile {
        file: file.to_path_buf(),
        message: error.to_string(),
    };
    let handle = fs::File::open(file).map_err(io_error)?;
    let file_len = handle.metadata().map_err(io_error)?.len();
    check_header_from(handle, file_len, file)
}

/// The header check of a safetensors file given as bytes (`file` names it in errors): what
/// the header fuzzer drives.
pub fn check_safetensors_header(bytes: &[u8], file: &Path) -> Result<Vec<String>> {
    check_header_from(bytes, bytes.len() as u64, file)
}

/// Reads the 8-byte length and the JSON header from `handle` (a file of `file_len` bytes) and
/// checks every entry against the data that follows, without reading the data.
fn check_header_from(mut handle: impl Read, file_len: u64, file: &Path) -> Result<Vec<String>> {
    let io_error = |error: std::io::Error| EngineError::WeightsFile {
        file: file.to_path_buf(),
        message: error.to_string(),
    };
    let bad = |message: String| EngineError::WeightsFile {
        file: file.to_path_buf(),
        message,
    };
    let mut len_bytes = [0u8; 8];
    handle.read_exact(&mut len_bytes).map_err(|_| {
        bad("not a safetensors file (shorter than its 8-byte header length)".into())
    })?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > 100 << 20 || 8 + header_len > file_len {
        return Err(bad(format!(
            "truncated or not safetensors: header claims {header_len} bytes, file has {file_len}"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    handle.read_exact(&mut header).map_err(io_error)?;
    let entries: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|error| bad(format!("unreadable safetensors header: {error}")))?;
    let data_len = file_len - 8 - header_len;
    let mut names = Vec::new();
    for (name, value) in entries {
        if name == "__metadata__" {
            continue;
        }
        let tensor_error = |message: String| EngineError::Tensor {
            file: file.to_path_buf(),
            tensor: name.clone(),
            message,
        };
        let entry: HeaderEntry = serde_json::from_value(value)
            .map_err(|error| tensor_error(format!("bad header entry: {error}")))?;
        let size = dtype_size(&entry.dtype)
            .ok_or_else(|| tensor_error(format!("unsupported dtype {}", entry.dtype)))?;
        let elements = entry.shape.iter().try_fold(1u64, |acc, &dim| {
            u64::try_from(dim).ok().and_then(|dim| acc.checked_mul(dim))
        });
        let [start, end] = entry.data_offsets;
        if elements.and_then(|n| n.checked_mul(size)) != Some(end.wrapping_sub(start))
            || end < start
        {
            return Err(tensor_error(format!(
                "data offsets {start}..{end} do not fit shape {:?} of {}",
                entry.shape, entry.dtype
            )));
        }
        if end > data_len {
            return Err(tensor_error(format!(
                "file is truncated: tensor data ends at byte {end} but only {data_len} data bytes exist"
            )));
        }
        names.push(name);
    }
    Ok(names)
}

/// What a layer accepts for a tensor's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeKind {
    /// f32, f16 or bf16.
    Float,
    /// Packed quantized weights.
    Uint32,
    /// Quantization scales: float (affine) or uint8 (E8M0/E4M3 in the fp modes).
    Scales { fp_mode: bool },
}

impl DtypeKind {
    fn accepts(self, dtype: Dtype) -> bool {
        let float = matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16);
        match self {
            Self::Float => float,
            Self::Uint32 => dtype == Dtype::Uint32,
            Self::Scales { fp_mode: true } => dtype == Dtype::Uint8,
            Self::Scales { fp_mode: false } => float,
        }
    }
}

/// All tensors of a checkpoint folder, each with the file it came from, consumed by the model.
pub struct WeightStore {
    tensors: HashMap<String, (Array, PathBuf)>,
    files: Vec<PathBuf>,
    taken: Vec<Array>,
    /// Weights computed at load from taken tensors (stacked or re-laid-out experts).
    derived: Vec<Array>,
    parameters: u64,
    /// While set, taken tensors are parts of a fused weight (see [`Self::fusing`]): not
    /// evaluated on their own, only counted.
    fusing: bool,
    fused_bytes: u64,
}

/// What a finished load used: the arrays (to evaluate once) and their totals.
pub struct LoadSummary {
    pub arrays: Vec<Array>,
    /// Logical parameters (packed quantized weights counted unpacked).
    pub parameters: u64,
    pub bytes: u64,
}

impl WeightStore {
    /// Opens `model.safetensors.index.json`'s shards, or every `model*.safetensors` (as mlx-lm).
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut expected: Option<BTreeMap<String, String>> = None;
        let files: Vec<PathBuf> = if index_path.exists() {
            let index = crate::config::read_json(&index_path)?;
            let map: BTreeMap<String, String> = serde_json::from_value(index["weight_map"].clone())
                .map_err(|error| EngineError::Config {
                    path: index_path.clone(),
                    message: format!("weight_map: {error}"),
                })?;
            let mut names: Vec<&String> = map.values().collect();
            names.sort();
            names.dedup();
            let files = names
                .into_iter()
                .map(|name| safe_join(dir, name, &index_path))
                .collect::<Result<Vec<_>>>()?;
            expected = Some(map);
            files
        } else {
            let mut files: Vec<PathBuf> = fs::read_dir(dir)
                .map_err(|error| EngineError::Io {
                    path: dir.to_path_buf(),
                    message: error.to_string(),
                })?
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .filter(|path| {
                    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    name.starts_with("model") && name.ends_with(".safetensors")
                })
                .collect();
            files.sort();
            files
        };
        if files.is_empty() {
            return Err(EngineError::Io {
                path: dir.to_path_buf(),
                message: "no model*.safetensors weights found".into(),
            });
        }

        let mut tensors = HashMap::new();
        for file in &files {
            let names = check_header(file)?;
            let arrays =
                Array::load_safetensors(file).map_err(|error| EngineError::WeightsFile {
                    file: file.clone(),
                    message: error.to_string(),
                })?;
            for name in names {
                let array = arrays
                    .get(&name)
                    .cloned()
                    .ok_or_else(|| EngineError::Tensor {
                        file: file.clone(),
                        tensor: name.clone(),
                        message: "listed in the header but not loaded by MLX".into(),
                    })?;
                if let Some(map) = &expected {
                    let listed = map.get(&name).map(|listed| dir.join(listed));
                    if listed.as_deref() != Some(file.as_path()) {
                        return Err(EngineError::Tensor {
                            file: file.clone(),
                            tensor: name,
                            message: format!(
                                "the index places it in {}",
                                listed.map_or("no file".into(), |p| p.display().to_string())
                            ),
                        });
                    }
                }
                if let Some((_, first)) = tensors.insert(name.clone(), (array, file.clone())) {
                    return Err(EngineError::Tensor {
                        file: file.clone(),
                        tensor: name,
                        message: format!("also present in {}", first.display()),
                    });
                }
            }
        }
        if let Some(map) = &expected {
            if let Some((name, file)) = map.iter().find(|(name, _)| !tensors.contains_key(*name)) {
                return Err(EngineError::Tensor {
                    file: dir.join(file),
                    tensor: name.clone(),
                    message: "listed in model.safetensors.index.json but absent from the file"
                        .into(),
                });
            }
        }
        Ok(Self {
            tensors,
            files,
            taken: Vec::new(),
            fusing: false,
            fused_bytes: 0,
            derived: Vec::new(),
            parameters: 0,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Adds every tensor of `file` (a draft head's sidecar), named by `rename`; a name the
    /// store already holds is an error naming both files. Returns the names added.
    pub fn add_file(
        &mut self,
        file: &Path,
        rename: impl Fn(&str) -> String,
    ) -> Result<Vec<String>> {
        let names = check_header(file)?;
        let arrays = Array::load_safetensors(file).map_err(|error| EngineError::WeightsFile {
            file: file.to_path_buf(),
            message: error.to_string(),
        })?;
        let mut added = Vec::with_capacity(names.len());
        for name in names {
            let array = arrays
                .get(&name)
                .cloned()
                .ok_or_else(|| EngineError::Tensor {
                    file: file.to_path_buf(),
                    tensor: name.clone(),
                    message: "listed in the header but not loaded by MLX".into(),
                })?;
            let renamed = rename(&name);
            if let Some((_, first)) = self.tensors.get(&renamed) {
                return Err(EngineError::Tensor {
                    file: file.to_path_buf(),
                    tensor: name,
                    message: format!("also present in {}", first.display()),
                });
            }
            self.tensors
                .insert(renamed.clone(), (array, file.to_path_buf()));
            added.push(renamed);
        }
        self.files.push(file.to_path_buf());
        Ok(added)
    }

    /// The names of the tensors not yet taken, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }

    /// The file a tensor not yet taken came from.
    pub fn file_of(&self, name: &str) -> Option<PathBuf> {
        self.tensors.get(name).map(|(_, file)| file.clone())
    }

    /// The shape of a tensor not yet taken.
    pub fn shape_of(&self, name: &str) -> Option<Vec<i32>> {
        self.tensors
            .get(name)
            .map(|(array, _)| array.shape().to_vec())
    }

    /// Renames every tensor under `from` to sit under `to` (a Hugging Face release's names to
    /// the mlx names the model loads, as the reference's sanitize does).
    pub fn rename_prefix(&mut self, from: &str, to: &str) {
        let names: Vec<String> = self
            .tensors
            .keys()
            .filter(|name| name.starts_with(from))
            .cloned()
            .collect();
        for name in names {
            let entry = self.tensors.remove(&name).expect("listed above");
            self.tensors
                .insert(format!("{to}{}", &name[from.len()..]), entry);
        }
    }

    /// Replaces a tensor by `change(tensor)` (a layout change of the reference's sanitize),
    /// keeping the file it came from for error messages.
    pub fn transform(
        &mut self,
        name: &str,
        change: impl FnOnce(&Array) -> Result<Array>,
    ) -> Result<()> {
        if let Some((array, file)) = self.tensors.remove(name) {
            let changed = change(&array)?;
            self.tensors.insert(name.to_string(), (changed, file));
        }
        Ok(())
    }

    /// A tensor's element type, before it is taken.
    pub fn dtype(&self, name: &str) -> Option<mlx_rs::Dtype> {
        self.tensors.get(name).map(|(array, _)| array.dtype())
    }

    /// Drops a tensor the model does not use by design (e.g. `lm_head` of a tied model).
    pub fn discard(&mut self, name: &str) {
        self.tensors.remove(name);
    }

    /// Drops every tensor under `prefix` (a layer another pipeline rank holds): never read.
    pub fn discard_prefix(&mut self, prefix: &str) {
        self.tensors.retain(|name, _| !name.starts_with(prefix));
    }

    /// Takes a tensor, checking its shape and element type.
    pub fn take(&mut self, name: &str, shape: &[i32], kind: DtypeKind) -> Result<Array> {
        let (array, file) =
            self.tensors
                .remove(name)
                .ok_or_else(|| EngineError::MissingTensor {
                    tensor: name.to_string(),
                    files: self.file_list(),
                })?;
        if array.shape() != shape {
            return Err(EngineError::Tensor {
                file,
                tensor: name.to_string(),
                message: format!("shape {:?}, expected {shape:?}", array.shape()),
            });
        }
        if !kind.accepts(array.dtype()) {
            return Err(EngineError::Tensor {
                file,
                tensor: name.to_string(),
                message: format!("dtype {:?}, expected {kind:?}", array.dtype()),
            });
        }
        if kind == DtypeKind::Float {
            self.parameters += array.size() as u64;
        }
        let array = if crate::runtime::weights_go_to_device() {
            device_copy(&array).map_err(|message| EngineError::Tensor {
                file,
                tensor: name.to_string(),
                message,
            })?
        } else {
            array
        };
        match self.fusing {
            true => self.fused_bytes += array.nbytes() as u64,
            false => self.taken.push(array.clone()),
        }
        Ok(array)
    }

    /// Runs `load` with every tensor it takes counted but not evaluated on its own: the caller
    /// builds one weight from them (projections concatenated) and registers it with
    /// [`Self::derived_now`], which reads the parts into it at once, so the load holds one
    /// weight's parts beside the weights at most.
    pub fn fusing<T>(&mut self, load: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.fusing = true;
        let loaded = load(self);
        self.fusing = false;
        loaded
    }

    /// Registers a view of taken weights (a transposed weight for `x @ w.T`) for the load to
    /// evaluate, so the forward gets an evaluated array instead of a graph node every step.
    pub fn view(&mut self, array: Array) -> Array {
        self.derived.push(array.clone());
        array
    }

    /// Registers a weight computed from taken tensors (a stack of per-expert matrices, a
    /// transposed half of a fused one) as a row-major copy that the load evaluates with the rest,
    /// so the first request neither builds it nor reads a strided view of it on every step. Its
    /// sources were already counted.
    pub fn derived(&mut self, array: Array) -> Result<Array> {
        let array = array.contiguous()?;
        self.derived.push(array.clone());
        Ok(array)
    }

    /// [`Self::derived`], evaluated now: a weight fused from parts taken under [`Self::fusing`].
    /// Left to the load's one evaluation at the end, MLX reads parts of several layers ahead
    /// of their concatenations (a test load of 8 layers held ~5 layers' parts at once).
    pub fn derived_now(&mut self, array: Array) -> Result<Array> {
        let array = self.derived(array)?;
        crate::runtime::eval([&array])?;
        Ok(array)
    }

    /// Counts parameters stored packed (quantized weights), which `take` cannot size.
    pub fn count_parameters(&mut self, count: u64) {
        self.parameters += count;
    }

    /// Succeeds only when every tensor was used.
    pub fn finish(self) -> Result<LoadSummary> {
        if self.tensors.is_empty() {
            let bytes = self.fused_bytes
                + self
                    .taken
                    .iter()
                    .map(|array| array.nbytes() as u64)
                    .sum::<u64>();
            let mut arrays = self.taken;
            arrays.extend(self.derived);
            return Ok(LoadSummary {
                arrays,
                parameters: self.parameters,
                bytes,
            });
        }
        let mut tensors: Vec<(String, PathBuf)> = self
            .tensors
            .into_iter()
            .map(|(name, (_, file))| (name, file))
            .collect();
        tensors.sort();
        Err(EngineError::UnusedTensors { tensors })
    }

    fn file_list(&self) -> String {
        self.files
            .iter()
            .map(|file| file.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A copy of `array` made on the default stream, so it lives in the device's own memory.
fn device_copy(array: &Array) -> std::result::Result<Array, String> {
    let stream = mlx_rs::Stream::thread_local_or_default();
    // SAFETY: both handles are live for the call; `out` becomes an owned Array.
    unsafe {
        let mut out = mlx_sys::mlx_array_new();
        if mlx_sys::mlx_copy(&mut out, array.as_ptr(), stream.as_ptr()) != 0 {
            mlx_sys::mlx_array_free(out);
            return Err("copying it to the device failed".into());
        }
        Ok(Array::from_ptr(out))
    }
}

/// A shard name from the index must stay inside the model folder.
fn safe_join(dir: &Path, name: &str, index: &Path) -> Result<PathBuf> {
    let relative = Path::new(name);
    let plain = relative
        .components()
        .all(|part| matches!(part, std::path::Component::Normal(_)));
    if !plain {
        return Err(EngineError::Config {
            path: index.to_path_buf(),
            message: format!("shard `{name}` escapes the model folder"),
        });
    }
    Ok(dir.join(relative))
}
